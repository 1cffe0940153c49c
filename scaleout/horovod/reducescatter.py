"""Horovod's reducescatter and grouped reducescatter. See :mod:`scaleout.horovod.ops`."""

from __future__ import annotations

from typing import Any

import torch

from scaleout.horovod import basics
from scaleout.horovod.basics import Average, ReduceOp, Sum, check_process_set, global_process_set
from scaleout.horovod.compression import Compression
from scaleout.horovod.engine import Handle
from scaleout.horovod.errors import HorovodNotSupportedError, HorovodValueError
from scaleout.horovod.movement import allgather, grouped_allgather
from scaleout.horovod.ops import _submit, _tensor, synchronize


# -- reducescatter ---------------------------------------------------------------------------------
def _reducescatter_async(
    tensors: list[torch.Tensor],
    name: str | None,
    op: Any,
    prescale: float,
    postscale: float,
    grouped: bool,
    what: str,
) -> Handle:
    if op is basics.Adasum:
        raise HorovodNotSupportedError(
            f"{what} op=hvd.Adasum is not supported (Horovod refuses it too)"
        )
    if op not in (Average, Sum):
        raise HorovodValueError(f"{what} op={op!r}: expected hvd.Average or hvd.Sum")
    for t in tensors:
        _tensor(t, what, 1)
        if t.dtype == torch.bool or t.is_complex():
            raise HorovodValueError(
                f"{what}: dtype {t.dtype} cannot be reduced (expected an integer or floating dtype)"
            )

    def meta(t: torch.Tensor) -> tuple:
        return (
            str(t.dtype),
            tuple(t.shape),
            op.name,
            float(prescale),
            float(postscale),
            t.device.type,
        )

    return _submit(
        "reducescatter", tensors, name, grouped, meta, op=op, prescale=prescale, postscale=postscale
    )


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: Any = Average,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Reduce over all ranks, then rank r keeps the r-th block of rows (the first ``rows % size``
    ranks get one row more)."""
    check_process_set(process_set)
    return _reducescatter_async(
        [tensor], name, op, prescale_factor, postscale_factor, False, "reducescatter"
    )


def grouped_reducescatter_async(
    tensors: list[torch.Tensor],
    name: str | None = None,
    op: Any = Average,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    check_process_set(process_set)
    return _reducescatter_async(
        list(tensors), name, op, prescale_factor, postscale_factor, True, "grouped_reducescatter"
    )


def _reducescatter_grad(grad: torch.Tensor, op: ReduceOp, pre: float, post: float) -> torch.Tensor:
    scale = (basics.size() if op is Sum else 1) * pre * post
    return grad * scale if scale != 1 else grad


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, pre: float, post: float
    ) -> torch.Tensor:
        ctx.op, ctx.pre, ctx.post = op, pre, post
        return synchronize(
            _reducescatter_async([tensor], name, op, pre, post, False, "reducescatter")
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return (
            allgather(_reducescatter_grad(grad, ctx.op, ctx.pre, ctx.post)),
            None,
            None,
            None,
            None,
        )


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = Average,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    check_process_set(process_set)
    compression = Compression.of(compression)
    wire, ctx = compression.compress(tensor)
    return compression.decompress(
        _Reducescatter.apply(wire, name, op, prescale_factor, postscale_factor), ctx
    )


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, name: str | None, op: ReduceOp, pre: float, post: float, *tensors: torch.Tensor
    ) -> tuple:
        ctx.op, ctx.pre, ctx.post = op, pre, post
        handle = _reducescatter_async(
            list(tensors), name, op, pre, post, True, "grouped_reducescatter"
        )
        return tuple(synchronize(handle))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        scaled = [_reducescatter_grad(g, ctx.op, ctx.pre, ctx.post) for g in grads]
        return (None, None, None, None, *grouped_allgather(scaled))


def grouped_reducescatter(
    tensors: list[torch.Tensor],
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = Average,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    check_process_set(process_set)
    compression = Compression.of(compression)
    wires, ctxs = (
        zip(*[compression.compress(t) for t in tensors], strict=True) if tensors else ((), ())
    )
    out = _GroupedReducescatter.apply(name, op, prescale_factor, postscale_factor, *wires)
    return [compression.decompress(t, c) for t, c in zip(out, ctxs, strict=True)]
