"""``DistributedOptimizer``: Horovod's gradient all-reduce overlapped with backward, on scaleout.comm.

As in Horovod, the returned object is an instance of a subclass of the wrapped optimizer's class (so LR
schedulers and ``isinstance`` checks keep working). A hook on every parameter fires when its gradient has
been accumulated; after ``backward_passes_per_step`` backward passes it starts an async all-reduce of that
gradient, so communication overlaps the rest of backward. ``step()`` waits for all of them, writes the
averaged gradients back and then runs the wrapped optimizer's step. Gradients accumulated locally over
several backward passes are summed, not divided by the number of passes (Horovod's behaviour too).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from scaleout.errors import UserError
from scaleout.horovod import basics
from scaleout.horovod.compression import Compression


class _DistributedOptimizer:
    """Methods copied into the dynamic subclass; ``super(self.__class__, self)`` is the wrapped class."""

    def __init__(self, params: Any, named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None,
                 compression: Any, backward_passes_per_step: int, op: Any, gradient_predivide_factor: float):
        super(self.__class__, self).__init__(params)
        if backward_passes_per_step < 1:
            raise UserError(f"backward_passes_per_step={backward_passes_per_step}: expected an integer >= 1")
        if gradient_predivide_factor != 1.0 and op is not basics.Average:
            raise UserError("gradient_predivide_factor needs op=hvd.Average")
        self._compression = compression
        self._passes = backward_passes_per_step
        self._op = op
        self._predivide = gradient_predivide_factor
        ordered = [p for g in self.param_groups for p in g["params"]]
        names = dict((id(p), n) for n, p in named_parameters) if named_parameters is not None else {}
        if named_parameters is not None and len(names) < len([p for p in ordered if p.requires_grad]):
            missing = [i for i, p in enumerate(ordered) if p.requires_grad and id(p) not in names]
            raise UserError(f"named_parameters does not name {len(missing)} optimizer parameter(s) (indices {missing[:5]})")
        self._params = [p for p in ordered if p.requires_grad]
        self._names = {id(p): names.get(id(p), f"param.{i}") for i, p in enumerate(self._params)}
        self._delay = {id(p): self._passes for p in self._params}
        self._handles: dict[int, Any] = {}
        self._skip_sync = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook()) for p in self._params]

    def _make_hook(self):
        def hook(p: torch.Tensor) -> None:
            key = id(p)
            if key in self._handles:
                raise UserError(
                    f"gradient of {self._names[key]} computed more than backward_passes_per_step={self._passes} "
                    "times before step(); raise backward_passes_per_step or call step()/synchronize()"
                )
            self._delay[key] -= 1
            if self._delay[key] == 0:
                self._handles[key] = self._allreduce_grad_async(p)

        return hook

    def _allreduce_grad_async(self, p: torch.Tensor) -> Any:
        if p.grad is None:
            p.grad = torch.zeros_like(p)  # an unused parameter still takes part (same call order everywhere)
        if self._op is basics.Average:
            pre, post = 1.0 / self._predivide, self._predivide
        else:
            pre, post = 1.0, 1.0
        return basics.allreduce_async_(p.grad, op=self._op, prescale_factor=pre, postscale_factor=post,
                                       compression=self._compression)

    def synchronize(self) -> None:
        """Start the all-reduces that backward has not (parameter order), wait for all, write gradients."""
        for p in self._params:
            if id(p) not in self._handles:
                self._handles[id(p)] = self._allreduce_grad_async(p)
        for p in self._params:
            basics.synchronize(self._handles[id(p)])
        self._handles.clear()
        self._delay = {id(p): self._passes for p in self._params}

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """For ``optimizer.synchronize(); clip(...); with optimizer.skip_synchronize(): optimizer.step()``."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    def step(self, closure: Any = None) -> Any:
        if not self._skip_sync:
            self.synchronize()
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise UserError("optimizer.zero_grad() called after backward() and before step()/synchronize(): "
                            "the gradients are still being all-reduced")
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)


def DistributedOptimizer(  # noqa: N802 -- Horovod's name
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    compression: Any = Compression.none,
    backward_passes_per_step: int = 1,
    op: Any = basics.Average,
    gradient_predivide_factor: float = 1.0,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged (or summed) over all ranks."""
    basics._s()
    if op not in (basics.Average, basics.Sum):
        raise UserError(f"DistributedOptimizer op={op!r}: expected hvd.Average or hvd.Sum")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor)
