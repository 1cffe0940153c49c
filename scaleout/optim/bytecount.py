"""Bytes an optimizer step moves, counted op by op: what a GPU step reads from and writes to memory.

    with ByteCounter() as bc:
        opt.step()
    bc.total / n_params          # bytes per parameter (e.g. 28 for torch's fused AdamW, fp32)

On a GPU every kernel streams its operands from device memory and back, and an optimizer step is
memory-bound, so the sum over its kernels of "tensors read + tensors written" is its cost. This
counts that sum for every aten (or custom) op dispatched while the counter is active, on any
device, so a CPU run tells what the same code moves on a GPU. The rule, per op:

- **read**: every distinct tensor argument (lists flattened; a tensor passed twice, as ``g`` in
  ``addcmul(v, g, g)``, counts once: one kernel loads it once), ``numel * element_size`` bytes of
  the view given, not of its storage. The destination of a pure write (``copy_``, ``fill_``,
  ``zero_`` and their foreach forms) is not read.
- **written**: every tensor the op mutates (its schema marks the argument written, e.g. the ``self``
  of ``mul_`` or the ``exp_avgs`` of ``_fused_adamw_``) and every fresh tensor it returns; an
  in-place op's returned ``self`` is the mutated tensor, counted once. One exception, from the
  kernels' source: torch's fused optimizers (``_fused_adamw_``, ``_fused_sgd_``, ...) declare
  ``grads`` written but store them only when unscaling them (``grad_scale`` given).
- **not counted**: view and metadata ops (every return aliases an input without a write:
  ``view``, ``split``, ``unbind``, ``t``, ``detach``, ...) and allocations that fill nothing
  (``empty*``). Host scalars (Python numbers) are free.

A fused kernel is one op, so it counts exactly what it streams: ``_fused_adamw_`` reads p, g, m, v
and writes p, m, v (7 x 4 B per fp32 parameter). A chain of elementwise ops counts every
intermediate array each time it is written and read again, which is what it costs on a GPU. (On a
CPU the cache-blocked chains of scaleout/optim/chunks.py keep those intermediates in cache, so
there the count is the DRAM traffic of an unblocked run, an upper bound.) An op whose
implementation is opaque to the dispatcher (a custom op, scaleout/optim/fused.py) counts by its
operands: that is only honest if it is one pass over them, which its own docstring must justify.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# destinations these ops overwrite without reading them
_WRITE_ONLY = {
    "copy_",
    "fill_",
    "zero_",
    "_foreach_copy_",
    "_foreach_zero_",
    "_copy_from",
    "_copy_from_and_resize",
}
# torch's fused optimizers mark ``grads`` written in their schema, but their kernels store the
# gradients back only when they unscale them (a ``grad_scale`` is given): op -> (argument, the
# argument that must be set for it to be written)
_WRITTEN_IF = {
    "_fused_adam_": ("grads", "grad_scale"),
    "_fused_adamw_": ("grads", "grad_scale"),
    "_fused_sgd_": ("grads", "grad_scale"),
    "_fused_adagrad_": ("grads", "grad_scale"),
}
_ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _is_view(func: Any) -> bool:
    rets = func._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


def _written_args(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors the op's schema says it writes (``Tensor(a!)`` arguments)."""
    schema = func._schema
    names = [a.name for a in schema.arguments]

    def value(name: str) -> Any:
        i = names.index(name)
        return kwargs.get(name, args[i] if i < len(args) else None)

    skip, unless = _WRITTEN_IF.get(schema.name.split("::")[-1], (None, None))
    out: list[torch.Tensor] = []
    for a in schema.arguments:
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        if a.name == skip and value(unless) is None:
            continue
        out += [t for t in tree_leaves(value(a.name)) if isinstance(t, torch.Tensor)]
    return out


def _key(t: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    return (t.data_ptr(), t.dtype.itemsize, tuple(t.shape), tuple(t.stride()))


def _distinct(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = set()
    out = []
    for t in tensors:
        key = _key(t)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


@dataclass
class OpBytes:
    calls: int = 0
    read: int = 0
    written: int = 0


@dataclass
class ByteCounter(TorchDispatchMode):
    """A dispatch mode summing bytes read and written per op (see the module docstring)."""

    read: int = 0
    written: int = 0
    ops: dict[str, OpBytes] = field(default_factory=lambda: defaultdict(OpBytes))

    def __post_init__(self) -> None:
        super().__init__()

    @property
    def total(self) -> int:
        return self.read + self.written

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        if _is_view(func) or name in _ALLOCATIONS:
            return out
        written = _written_args(func, args, kwargs)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if name in _WRITE_ONLY:
            wkeys = {_key(t) for t in written}
            inputs = [t for t in inputs if _key(t) not in wkeys]
        returned = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        reads = sum(_nbytes(t) for t in _distinct(inputs))
        writes = sum(_nbytes(t) for t in _distinct([*written, *returned]))
        rec = self.ops[name]
        rec.calls += 1
        rec.read += reads
        rec.written += writes
        self.read += reads
        self.written += writes
        return out

    def table(self, per: int = 1) -> list[tuple[str, int, float, float]]:
        """(op, calls, bytes read / per, bytes written / per), largest first."""
        return sorted(
            ((k, r.calls, r.read / per, r.written / per) for k, r in self.ops.items()),
            key=lambda row: -(row[2] + row[3]),
        )


def step_bytes(
    step: Callable[[], Any], params: Iterable[torch.Tensor]
) -> tuple[float, ByteCounter]:
    """Bytes per parameter element that one call of ``step`` moves (reads + writes), and the
    counter (per-op detail). ``params``: the tensors the step updates (their total numel is the
    denominator)."""
    n = sum(p.numel() for p in params)
    with torch.no_grad(), ByteCounter() as bc:
        step()
    return bc.total / max(n, 1), bc
