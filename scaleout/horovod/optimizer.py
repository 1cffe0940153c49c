"""``DistributedOptimizer``: Horovod's gradient averaging overlapped with backward, on the engine.

As in Horovod, the returned object is an instance of a subclass of the wrapped optimizer's class (LR
schedulers and ``isinstance`` checks keep working). A hook on every parameter fires when its
gradient has been accumulated; after ``backward_passes_per_step`` backward passes it queues an
in-place allreduce of that gradient named after the parameter, so communication overlaps the rest of
backward and the engine fuses what is ready in each cycle. ``step()`` (or ``synchronize()``) queues
the parameters whose hook did not fire (no gradient on this rank: zeros are reduced), waits, and
writes the results back.

Because the engine matches requests by name, a parameter that gets a gradient on some ranks only is
reduced correctly: the ranks that computed it queue it during backward, the others at ``step()``,
and the engine runs it once all have. Gradients accumulated over several passes are summed, not
divided by the number of passes (Horovod's behaviour).
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from scaleout.horovod import basics
from scaleout.horovod.basics import Average, check_process_set
from scaleout.horovod.compression import Compression
from scaleout.horovod.errors import HorovodValueError
from scaleout.horovod.movement import sparse_allreduce_async
from scaleout.horovod.ops import allreduce_async_, grouped_allreduce_async_, synchronize


def _names(optimizer: torch.optim.Optimizer, named_parameters: Any) -> dict[Any, str]:
    if named_parameters is None:
        named = [
            (f"allreduce.noname.{i}.{j}", p)
            for i, g in enumerate(optimizer.param_groups)
            for j, p in enumerate(g["params"])
        ]
    else:
        named = list(named_parameters)
    if any(not isinstance(x, tuple) or len(x) != 2 for x in named):
        raise HorovodValueError(
            "named_parameters: expected (name, parameter) tuples, as model.named_parameters() gives"
        )
    counts = Counter(n for n, _ in named)
    dups = sorted(n for n, c in counts.items() if c > 1)
    if dups:
        raise HorovodValueError(f"named_parameters: names must be unique, found duplicates {dups}")
    named_ids = {id(p) for _, p in named}
    unnamed = [
        i
        for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])
        if id(p) not in named_ids
    ]
    if unnamed:
        raise HorovodValueError(
            f"named_parameters does not name {len(unnamed)} optimizer parameter(s) (positions "
            f"{unnamed[:5]})"
        )
    return {p: n for n, p in sorted(named, key=lambda x: x[0])}


def _groups(params: list[Any], groups: Any, names: dict[Any, str]) -> list[tuple[Any, ...]] | None:
    """Parameters reduced together (Horovod's ``groups``): an int splits them (in name order, the
    same on every rank) into that many groups; a list of lists gives them explicitly."""
    if groups is None or groups == 0:
        return None
    if isinstance(groups, int) and groups > 0:
        ordered = sorted(params, key=names.__getitem__)
        k = -(-len(ordered) // groups)
        return [tuple(ordered[i : i + k]) for i in range(0, len(ordered), k)]
    if not isinstance(groups, list):
        raise HorovodValueError(
            f"groups={groups!r}: expected a positive integer or a list of lists of parameters"
        )
    out, taken = [], set()
    for g in groups:
        members = tuple(p for p in g if any(p is q for q in params))
        for p in members:
            if id(p) in taken:
                raise HorovodValueError("groups: a parameter can appear in only one group")
            taken.add(id(p))
        if members:
            out.append(members)
    return out + [(p,) for p in params if id(p) not in taken]


class _DistributedOptimizer:
    """Methods copied into the dynamic subclass; ``super(self.__class__, self)`` is the wrapped
    class."""

    def __init__(
        self,
        params: Any,
        named_parameters: Any,
        compression: Any,
        backward_passes_per_step: int,
        op: Any,
        gradient_predivide_factor: float,
        groups: Any,
        sparse_as_dense: bool,
    ):
        super(self.__class__, self).__init__(params)
        self._compression = Compression.of(compression)
        self._parameter_names = _names(self, named_parameters)
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self._requires_update = [
            p for g in self.param_groups for p in g["params"] if p.requires_grad
        ]
        self._allreduce_delay = {p: backward_passes_per_step for p in self._requires_update}
        self._handles: dict[Any, tuple[Any, Any]] = {}
        self._synchronized = False
        self._should_synchronize = True
        self._groups = _groups(self._requires_update, groups, self._parameter_names)
        self._p_to_group = {p: g for g in self._groups or [] for p in g}
        self._group_counts = {g: 0 for g in self._groups or []}
        self._grad_hooks = []
        if basics.size() > 1:
            self._grad_hooks = [
                p.register_post_accumulate_grad_hook(self._make_hook(p))
                for p in self._requires_update
            ]

    def load_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._handles = {}
        self._synchronized = False
        self._should_synchronize = True
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        super(self.__class__, self).load_state_dict(*args, **kwargs)

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def _scales(self) -> tuple[float, float]:
        if self.op is Average:  # split the averaging around the sum (the engine adds 1/size)
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _allreduce_grad_async(self, p: Any) -> tuple[Any, Any]:
        if p.grad is None:  # no gradient here, but other ranks may have one: take part with zeros
            p.grad = torch.zeros_like(p)
        name = self._parameter_names[p]
        tensor = p.grad
        if tensor.is_sparse:
            if not self.sparse_as_dense:
                return sparse_allreduce_async(tensor, name=name, op=self.op), None
            tensor = tensor.to_dense()
        wire, ctx = self._compression.compress(tensor)
        pre, post = self._scales()
        return allreduce_async_(
            wire, name=name, op=self.op, prescale_factor=pre, postscale_factor=post
        ), (ctx, wire)

    def _grouped_allreduce_grad_async(self, group: tuple[Any, ...]) -> tuple[Any, Any]:
        wires, ctxs = zip(*[self._compression.compress(p.grad) for p in group], strict=True)
        pre, post = self._scales()
        handle = grouped_allreduce_async_(
            list(wires),
            name=self._parameter_names[group[0]],
            op=self.op,
            prescale_factor=pre,
            postscale_factor=post,
        )
        return handle, list(zip(ctxs, wires, strict=True))

    def _make_hook(self, p: Any) -> Any:
        def hook(_: torch.Tensor) -> None:
            if (
                p in self._handles
                and self._handles[p][0] is not None
                and self._allreduce_delay[p] <= 0
            ):
                raise HorovodValueError(
                    f"gradient of {self._parameter_names[p]} computed more than "
                    "backward_passes_per_step="
                    f"{self.backward_passes_per_step} times before step(); raise "
                    "backward_passes_per_step to accumulate gradients locally"
                )
            self._allreduce_delay[p] -= 1
            handle, ctx = None, None
            if self._allreduce_delay[p] == 0:
                if self._groups is not None:
                    group = self._p_to_group[p]
                    self._group_counts[group] += 1
                    if self._group_counts[group] == len(group):
                        self._handles[group] = self._grouped_allreduce_grad_async(group)
                        for q in group:
                            self._handles.pop(q, None)
                        self._group_counts[group] = 0
                        return
                else:
                    handle, ctx = self._allreduce_grad_async(p)
            self._handles[p] = (handle, ctx)

        return hook

    def _write_back(self, p: Any, output: torch.Tensor, ctx: Any) -> None:
        self._allreduce_delay[p] = self.backward_passes_per_step
        if ctx is None:  # sparse allreduce: output is the aggregated sparse gradient
            p.grad.zero_().add_(output)
            return
        value = self._compression.decompress(output, ctx[0])
        if p.grad.is_sparse:  # sparse_as_dense: back to the layout the optimizer expects
            p.grad.zero_().add_(value.to_sparse())
        elif value is not p.grad:
            p.grad.copy_(value)

    def synchronize(self) -> None:
        """Queue what backward did not (parameters without a gradient here), wait, write gradients
        back."""
        done = {q for key in self._handles for q in (key if isinstance(key, tuple) else (key,))}
        for p in self._requires_update:
            if p not in done or self._handles.get(p, (0,))[0] is None:
                self._handles[p] = self._allreduce_grad_async(p)
        for key, (handle, ctx) in self._handles.items():
            if isinstance(key, tuple):
                for p, out, c in zip(key, synchronize(handle), ctx, strict=True):
                    self._write_back(p, out, c)
                self._group_counts[key] = 0
            else:
                self._write_back(key, handle() if callable(handle) else synchronize(handle), ctx)
        self._handles.clear()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """For ``optimizer.synchronize(); clip(...); with optimizer.skip_synchronize():
        optimizer.step()``."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(): the gradients are reduced a second time",
                    stacklevel=2,
                )
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise HorovodValueError(
                "optimizer.zero_grad() called after backward() and before step()/synchronize(): "
                "the gradients are still being reduced"
            )
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)


def is_distributed(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` was made by :func:`DistributedOptimizer` (its class is made per
    call)."""
    return (
        type(optimizer).__dict__.get("synchronize") is _DistributedOptimizer.__dict__["synchronize"]
    )


def DistributedOptimizer(  # noqa: N802 -- Horovod's name
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    compression: Any = Compression.none,
    backward_passes_per_step: int = 1,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: Any = basics.global_process_set,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged (or summed, ...) over all
    ranks."""
    basics.state()
    check_process_set(process_set)
    op = basics.resolve_op(None, op, "DistributedOptimizer")  # Adasum: HorovodNotSupportedError
    if gradient_predivide_factor != 1.0 and op is not Average:
        raise HorovodValueError(
            f"gradient_predivide_factor={gradient_predivide_factor} needs op=hvd.Average, got "
            f"{op!r}"
        )
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise HorovodValueError(
            f"backward_passes_per_step={backward_passes_per_step!r}: expected an integer >= 1"
        )
    # Only the methods: _DistributedOptimizer's own __dict__/__weakref__ descriptors would shadow
    # the wrapped class's (load_state_dict's __setstate__ writes self.__dict__).
    methods = {
        k: v
        for k, v in _DistributedOptimizer.__dict__.items()
        if k not in ("__dict__", "__weakref__")
    }
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    return cls(
        optimizer.param_groups,
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        groups if groups is not None else (num_groups or None),
        sparse_as_dense,
    )
