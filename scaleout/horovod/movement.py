"""Horovod's data-movement collectives: allgather (and grouped), broadcast, alltoall, sparse
allreduce (by allgather). See :mod:`scaleout.horovod.ops` for how requests are queued and
checked."""

from __future__ import annotations

from typing import Any

import torch

from scaleout.horovod import basics
from scaleout.horovod.basics import Average, Sum, check_process_set, global_process_set, resolve_op
from scaleout.horovod.engine import Handle
from scaleout.horovod.errors import HorovodValueError
from scaleout.horovod.ops import _submit, _tensor, allreduce, grouped_allreduce, synchronize


# -- allgather -------------------------------------------------------------------------------------
def _allgather_async(
    tensors: list[torch.Tensor], name: str | None, grouped: bool, what: str
) -> Handle:
    for t in tensors:
        _tensor(t, what, 1)
    return _submit(
        "allgather",
        tensors,
        name,
        grouped,
        lambda t: (str(t.dtype), tuple(t.shape[1:]), t.device.type),
    )


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set
) -> Handle:
    """Concatenate every rank's ``tensor`` along dimension 0 (the first dimension may differ by
    rank)."""
    check_process_set(process_set)
    return _allgather_async([tensor], name, False, "allgather")


def grouped_allgather_async(
    tensors: list[torch.Tensor], name: str | None = None, process_set: Any = global_process_set
) -> Handle:
    check_process_set(process_set)
    return _allgather_async(list(tensors), name, True, "grouped_allgather")


def _own_rows(grad: torch.Tensor, rows: list[int]) -> torch.Tensor:
    r = basics.rank()
    return grad.narrow(0, sum(rows[:r]), rows[r])


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None) -> torch.Tensor:
        handle = _allgather_async([tensor], name, False, "allgather")
        out = synchronize(handle)
        ctx.rows = handle.extra["rows"][0]
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _own_rows(allreduce(grad, op=Average), ctx.rows), None


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set
) -> torch.Tensor:
    check_process_set(process_set)
    return _Allgather.apply(tensor, name)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, *tensors: torch.Tensor) -> tuple:
        handle = _allgather_async(list(tensors), name, True, "grouped_allgather")
        out = synchronize(handle)
        ctx.rows = [handle.extra["rows"][i] for i in range(len(tensors))]
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        reduced = grouped_allreduce(list(grads), op=Average)
        return (None, *[_own_rows(g, rows) for g, rows in zip(reduced, ctx.rows, strict=True)])


def grouped_allgather(
    tensors: list[torch.Tensor], name: str | None = None, process_set: Any = global_process_set
) -> list[torch.Tensor]:
    check_process_set(process_set)
    return list(_GroupedAllgather.apply(name, *tensors))


# -- broadcast -------------------------------------------------------------------------------------
def _broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None, inplace: bool, what: str
) -> Handle:
    _tensor(tensor, what)
    n = basics.size()
    if not isinstance(root_rank, int) or not 0 <= root_rank < n:
        raise HorovodValueError(f"{what} root_rank={root_rank!r}: expected a rank in [0, {n})")
    return _submit(
        "broadcast",
        [tensor],
        name,
        False,
        lambda t: (str(t.dtype), tuple(t.shape), root_rank, t.device.type),
        inplace=inplace,
        root=root_rank,
    )


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> Handle:
    """Start sending root's ``tensor`` to every rank; ``synchronize`` returns a new tensor."""
    check_process_set(process_set)
    return _broadcast_async(tensor, root_rank, name, False, "broadcast")


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> Handle:
    check_process_set(process_set)
    return _broadcast_async(tensor, root_rank, name, True, "broadcast_")


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None) -> torch.Tensor:
        ctx.root = root_rank
        return synchronize(_broadcast_async(tensor, root_rank, name, False, "broadcast"))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        reduced = allreduce(grad, op=Average)
        return (reduced if basics.rank() == ctx.root else reduced * 0), None, None


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> torch.Tensor:
    check_process_set(process_set)
    return _Broadcast.apply(tensor, root_rank, name)


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# -- alltoall --------------------------------------------------------------------------------------
def _splits(tensor: torch.Tensor, splits: Any) -> list[int]:
    n, rows = basics.size(), tensor.shape[0]
    if splits is None:
        if rows % n:
            raise HorovodValueError(
                f"alltoall without splits: first dimension {rows} is not a multiple of the size {n}"
            )
        return [rows // n] * n
    if isinstance(splits, torch.Tensor):
        if splits.dtype not in (torch.int32, torch.int64):
            raise HorovodValueError(
                f"alltoall splits dtype {splits.dtype}: expected torch.int32 (or int64)"
            )
        splits = splits.tolist()
    splits = [int(s) for s in splits]
    if len(splits) != n or min(splits) < 0 or sum(splits) != rows:
        raise HorovodValueError(
            f"alltoall splits {splits}: expected {n} non-negative counts summing to the first "
            f"dimension {rows}"
        )
    return splits


def alltoall_async(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> Handle:
    """Send ``splits[r]`` rows to rank r (default: equal parts); ``synchronize`` returns (output,
    received_splits)."""
    check_process_set(process_set)
    _tensor(tensor, "alltoall", 1)
    parts = _splits(tensor, splits)
    return _submit(
        "alltoall",
        [tensor],
        name,
        False,
        lambda t: (str(t.dtype), tuple(t.shape[1:]), t.device.type),
        splits=parts,
    )


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None) -> Any:
        out, received = synchronize(alltoall_async(tensor, splits, name))
        ctx.received = received
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple:
        back, _ = alltoall(grad.contiguous(), splits=ctx.received)
        return back, None, None


def alltoall(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> Any:
    """Differentiable alltoall: the output, plus the received splits when ``splits`` is given."""
    check_process_set(process_set)
    return _Alltoall.apply(tensor, splits, name)


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str, op: Any, process_set: Any = global_process_set
) -> Any:
    """Reduce a sparse tensor by all-gathering its indices and values (as Horovod does); returns a
    callable that waits and returns the (uncoalesced) sparse result."""
    check_process_set(process_set)
    op = resolve_op(None, op, "sparse_allreduce")
    if op not in (Average, Sum):
        raise HorovodValueError(f"sparse_allreduce op={op!r}: expected hvd.Average or hvd.Sum")
    t = tensor.coalesce() if tensor.is_sparse else tensor.to_sparse()
    idx_h = allgather_async(t.indices().t().contiguous(), name=f"{name}.indices" if name else None)
    val_h = allgather_async(t.values(), name=f"{name}.values" if name else None)

    def wait() -> torch.Tensor:
        values, indices = synchronize(val_h), synchronize(idx_h)
        if op is Average:
            values = values / basics.size()
        return torch.sparse_coo_tensor(indices.t(), values, t.shape)

    return wait
