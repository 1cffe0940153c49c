"""Horovod's collectives (``horovod.torch.mpi_ops``), part 1: how requests are queued, poll,
synchronize, barrier, join, and the allreduce family (plain, in-place, async, grouped). Allgather,
broadcast, alltoall and sparse allreduce are in :mod:`scaleout.horovod.movement`, reducescatter in
:mod:`scaleout.horovod.reducescatter`.

Every call validates its arguments on the calling rank (a one-line :class:`HorovodValueError`),
queues one request per tensor with the engine and returns a handle; the blocking forms synchronize
it. What must agree across ranks (dtype, shape, op, scale factors, root) travels as the request's
metadata and is checked by the negotiation, so a mismatch fails on every rank instead of hanging.
The non-async forms are differentiable, with Horovod's gradients: allreduce -> allreduce of the
gradient with the same op; allgather -> averaged gradient, this rank's rows; broadcast -> averaged
gradient on the root, zero elsewhere; alltoall -> alltoall back; reducescatter -> allgather of the
(scaled) gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from scaleout.horovod import basics
from scaleout.horovod.basics import ReduceOp, check_process_set, global_process_set, resolve_op
from scaleout.horovod.compression import Compression
from scaleout.horovod.engine import Handle, Request
from scaleout.horovod.errors import HorovodValueError


def _tensor(t: Any, what: str, min_dim: int = 0) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise HorovodValueError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse:
        raise HorovodValueError(
            f"{what}: sparse tensors need hvd.sparse_allreduce_async (or sparse_as_dense=True)"
        )
    if t.dim() < min_dim:
        raise HorovodValueError(
            f"{what}: expected a tensor with at least {min_dim} dimension(s), got shape "
            f"{tuple(t.shape)}"
        )
    return t


def _names(name: str | None, n: int, grouped: bool) -> list[str | None]:
    if name is None:
        return [None] * n
    return [f"{name}.{i}" for i in range(n)] if grouped else [name]


def _submit(
    kind: str, tensors: list[torch.Tensor], name: str | None, grouped: bool, meta: Any, **kw: Any
) -> Handle:
    handle = Handle(len(tensors), list if grouped else None)
    reqs = [
        Request(kind, nm, t, meta(t), handle, slot=i, **kw)
        for i, (nm, t) in enumerate(zip(_names(name, len(tensors), grouped), tensors, strict=True))
    ]
    basics.state().engine.submit(reqs)
    return handle


# -- synchronisation -------------------------------------------------------------------------------
def poll(handle: Handle) -> bool:
    """True once the operation has finished (``synchronize`` will not block)."""
    return handle.done()


def synchronize(handle: Handle) -> Any:
    """Wait for an async operation; its result, or HorovodInternalError if it failed on the
    ranks."""
    return handle.wait()


def barrier(process_set: Any = global_process_set) -> None:
    """Return once every rank has called barrier."""
    check_process_set(process_set)
    handle = Handle(1)
    basics.state().engine.submit([Request("barrier", None, None, (), handle)])
    handle.wait()


def join(device: int = -1) -> int:
    """This rank has no more data: until every rank has joined, it takes part in the others'
    allreduces with zeros (allgather, broadcast, alltoall and reducescatter fail meanwhile, as in
    Horovod). Returns the rank that joined last, the same on every rank."""
    return basics.state().engine.join()


# -- allreduce -------------------------------------------------------------------------------------
def _allreduce_async(
    tensors: list[torch.Tensor],
    name: str | None,
    op: ReduceOp,
    prescale: float,
    postscale: float,
    inplace: bool,
    grouped: bool,
    what: str,
) -> Handle:
    for t in tensors:
        _tensor(t, what)
        if t.dtype == torch.bool or t.is_complex():
            raise HorovodValueError(
                f"{what}: dtype {t.dtype} cannot be reduced (expected an integer or floating dtype)"
            )
    alg = basics.state().algorithm

    def meta(t: torch.Tensor) -> tuple:
        return (
            str(t.dtype),
            tuple(t.shape),
            op.name,
            float(prescale),
            float(postscale),
            alg,
            t.device.type,
        )

    return _submit(
        "allreduce",
        tensors,
        name,
        grouped,
        meta,
        inplace=inplace,
        op=op,
        prescale=prescale,
        postscale=postscale,
        algorithm=alg,
    )


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> Handle:
    """Start reducing ``tensor`` over all ranks (default op Average); ``synchronize`` returns a new
    tensor."""
    check_process_set(process_set)
    op = resolve_op(average, op)
    return _allreduce_async(
        [tensor], name, op, prescale_factor, postscale_factor, False, False, "allreduce"
    )


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> Handle:
    """In-place form of :func:`allreduce_async`: the result is written into ``tensor``."""
    check_process_set(process_set)
    op = resolve_op(average, op)
    return _allreduce_async(
        [tensor], name, op, prescale_factor, postscale_factor, True, False, "allreduce_"
    )


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, pre: float, post: float
    ) -> torch.Tensor:
        ctx.op, ctx.pre, ctx.post = op, pre, post
        return synchronize(
            _allreduce_async([tensor], name, op, pre, post, False, False, "allreduce")
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return (
            allreduce(grad, op=ctx.op, prescale_factor=ctx.pre, postscale_factor=ctx.post),
            None,
            None,
            None,
            None,
        )


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> torch.Tensor:
    """Reduce over all ranks (default Average) and return a new tensor; differentiable."""
    check_process_set(process_set)
    op = resolve_op(average, op)
    compression = Compression.of(compression)
    wire, ctx = compression.compress(tensor)
    return compression.decompress(
        _Allreduce.apply(wire, name, op, prescale_factor, postscale_factor), ctx
    )


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> torch.Tensor:
    return synchronize(
        allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    )


def grouped_allreduce_async(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> Handle:
    """Reduce a list of tensors as one operation (negotiated and fused together)."""
    check_process_set(process_set)
    op = resolve_op(average, op, "grouped_allreduce")
    return _allreduce_async(
        list(tensors), name, op, prescale_factor, postscale_factor, False, True, "grouped_allreduce"
    )


def grouped_allreduce_async_(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> Handle:
    check_process_set(process_set)
    op = resolve_op(average, op, "grouped_allreduce_")
    return _allreduce_async(
        list(tensors), name, op, prescale_factor, postscale_factor, True, True, "grouped_allreduce_"
    )


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, name: str | None, op: ReduceOp, pre: float, post: float, *tensors: torch.Tensor
    ) -> tuple:
        ctx.op, ctx.pre, ctx.post = op, pre, post
        return tuple(
            synchronize(
                _allreduce_async(
                    list(tensors), name, op, pre, post, False, True, "grouped_allreduce"
                )
            )
        )

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        reduced = grouped_allreduce(
            list(grads), op=ctx.op, prescale_factor=ctx.pre, postscale_factor=ctx.post
        )
        return (None, None, None, None, *reduced)


def grouped_allreduce(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> list[torch.Tensor]:
    check_process_set(process_set)
    op = resolve_op(average, op, "grouped_allreduce")
    compression = Compression.of(compression)
    wires, ctxs = (
        zip(*[compression.compress(t) for t in tensors], strict=True) if tensors else ((), ())
    )
    out = _GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, *wires)
    return [compression.decompress(t, c) for t, c in zip(out, ctxs, strict=True)]


def grouped_allreduce_(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> list[torch.Tensor]:
    return synchronize(
        grouped_allreduce_async_(
            tensors, average, name, op, prescale_factor, postscale_factor, process_set
        )
    )
