"""Horovod's torch API tests, ported (see tests/horovod/test_horovod_api.py): allgather, broadcast,
alltoall."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from tests.horovod.test_horovod_api import DIMS, MOVE_DTYPES, on_ranks, raises

pytestmark = pytest.mark.multi_process


def filled(shape: list[int], value: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, value).to(dtype)


# -- allgather -------------------------------------------------------------------------------------
def _check_gathered(
    gathered: torch.Tensor, rows: list[int], trailing: list[int], dtype: torch.dtype
) -> None:
    assert gathered.dtype == dtype and list(gathered.shape) == [sum(rows)] + trailing
    start = 0
    for r, n in enumerate(rows):
        block = gathered[start : start + n].to(torch.int64)
        assert list(block.shape) == [n] + trailing and bool(
            (block == int(bool(r)) if dtype == torch.bool else block == r).all()
        ), (dtype, r)
        start += n


def r_allgather(hvd, variable):
    rank, size = hvd.rank(), hvd.size()
    rows = [17, 32, 81, 12][:size] if variable else [17] * size
    for dtype, dim in itertools.product(MOVE_DTYPES, DIMS):
        tensor = filled([rows[rank]] + [17] * (dim - 1), rank, dtype)
        _check_gathered(hvd.allgather(tensor), rows, [17] * (dim - 1), dtype)


@pytest.mark.parametrize("variable", [False, True])
def test_horovod_allgather(variable):
    """Every dtype, 1-3 dims; with ``variable`` each rank has a different first dimension."""
    on_ranks(r_allgather, variable)


def r_allgather_async_fused(hvd):
    rank, size = hvd.rank(), hvd.size()
    pending, saw_pending = [], False
    for dtype, dim in itertools.product(MOVE_DTYPES, DIMS):
        handle = hvd.allgather_async(filled([17] * dim, rank, dtype))
        saw_pending |= not hvd.poll(handle)
        pending.append((dtype, dim, handle))
    assert saw_pending, "hvd.poll() was always True: not asynchronous?"
    for dtype, dim, handle in pending:
        _check_gathered(hvd.synchronize(handle), [17] * size, [17] * (dim - 1), dtype)


def test_horovod_allgather_async_fused():
    on_ranks(r_allgather_async_fused)


def r_allgather_errors(hvd):
    rank = hvd.rank()
    shape = [17, 10 * (rank + 1), 17]  # only the first dimension may differ
    return (
        raises(lambda: hvd.allgather(torch.ones(shape))),
        raises(
            lambda: hvd.allgather(
                torch.ones(17, 17, dtype=torch.int32 if rank % 2 else torch.float32)
            )
        ),
    )


def test_horovod_allgather_error_and_type_error():
    res = on_ranks(r_allgather_errors)
    assert all(r == res[0] for r in res)
    assert "shape after the first dimension (10, 17) on rank 0 but (20, 17) on rank 1" in res[0][0]
    assert "dtype torch.float32 on rank 0 but torch.int32 on rank 1" in res[0][1]


def r_allgather_grad(hvd, grouped):
    rank, size = hvd.rank(), hvd.size()
    rows = [3, 2, 7, 4][:size]
    for dtype, dim in itertools.product([torch.float32, torch.float64], DIMS):
        trailing = [17] * (dim - 1)
        tensors = [
            filled([rows[rank]] + trailing, rank, dtype).requires_grad_()
            for _ in range(5 if grouped else 1)
        ]
        grad_ys = torch.cat(
            [torch.ones([n] + trailing, dtype=dtype) * r for r, n in enumerate(rows)]
        )
        gathered = hvd.grouped_allgather(tensors) if grouped else [hvd.allgather(tensors[0])]
        for g in gathered:
            g.backward(grad_ys)
        want = np.ones([rows[rank]] + trailing) * rank
        assert all(np.linalg.norm(want - t.grad.numpy()) < 1e-8 for t in tensors), (dtype, dim)


@pytest.mark.parametrize("grouped", [False, True])
def test_horovod_allgather_grad(grouped):
    """The gradient of an allgather is this rank's rows of the (averaged) output gradient."""
    on_ranks(r_allgather_grad, grouped)


def r_grouped_allgather(hvd):
    rank, size = hvd.rank(), hvd.size()
    for dtype, dim in itertools.product(MOVE_DTYPES, DIMS):
        out = hvd.grouped_allgather([filled([17] * dim, rank, dtype) for _ in range(5)])
        assert len(out) == 5
        for g in out:
            _check_gathered(g, [17] * size, [17] * (dim - 1), dtype)


def test_horovod_grouped_allgather():
    on_ranks(r_grouped_allgather)


# -- broadcast -------------------------------------------------------------------------------------
def r_broadcast(hvd, inplace):
    rank, size = hvd.rank(), hvd.size()
    for dtype, dim, root in itertools.product(MOVE_DTYPES, DIMS, range(size)):
        tensor = filled([17] * dim, rank, dtype)
        want = filled([17] * dim, root, dtype)
        out = hvd.broadcast_(tensor, root) if inplace else hvd.broadcast(tensor, root)
        if inplace:
            assert out is tensor
        elif rank != root and dtype != torch.bool:
            assert not bool((tensor == want).any()), "broadcast modified its input"
        assert out.dtype == dtype and torch.equal(out, want), (dtype, dim, root)


@pytest.mark.parametrize("inplace", [False, True])
def test_horovod_broadcast(inplace):
    """Every dtype, 1-3 dims, every root; the out-of-place form leaves its input alone."""
    on_ranks(r_broadcast, inplace)


def r_broadcast_errors(hvd):
    rank = hvd.rank()
    return (
        raises(lambda: hvd.broadcast(torch.ones(17, 10 * (rank + 1), 17), 0)),
        raises(
            lambda: hvd.broadcast(
                torch.ones(17, 17, dtype=torch.int32 if rank % 2 else torch.float32), 0
            )
        ),
        raises(lambda: hvd.broadcast(torch.ones(17, 17), rank)),
        raises(lambda: hvd.broadcast(torch.ones(3), hvd.size()), (ValueError,)),
    )


def test_horovod_broadcast_error_type_error_rank_error():
    """Different shapes, dtypes or root ranks across ranks fail on every rank; an impossible root is
    a ValueError on the calling rank."""
    res = on_ranks(r_broadcast_errors)
    assert all(r[:3] == res[0][:3] for r in res)
    shape, dtype, root, bad_root = res[0]
    assert "shape (17, 10, 17) on rank 0 but (17, 20, 17) on rank 1" in shape
    assert "dtype torch.float32 on rank 0 but torch.int32 on rank 1" in dtype
    assert "root_rank 0 on rank 0 but 1 on rank 1" in root
    assert "root_rank=4: expected a rank in [0, 4)" in bad_root


def r_broadcast_grad(hvd):
    rank, size = hvd.rank(), hvd.size()
    for dtype, dim, root in itertools.product([torch.float32, torch.float64], DIMS, range(size)):
        tensor = filled([17] * dim, rank, dtype).requires_grad_()
        hvd.broadcast(tensor, root).backward(torch.ones([17] * dim, dtype=dtype))
        want = np.ones([17] * dim) * (1 if rank == root else 0)
        assert np.linalg.norm(want - tensor.grad.numpy()) < 1e-8, (dtype, dim, root)


def test_horovod_broadcast_grad():
    """The gradient reaches the root (averaged over ranks); the other ranks' inputs get zero."""
    on_ranks(r_broadcast_grad)


# -- alltoall --------------------------------------------------------------------------------------
def _alltoall_input(rank: int, size: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """rank+1 rows for every destination r, holding r; trailing dimensions of 2."""
    t = torch.tensor([r for r in range(size) for _ in range(rank + 1)], dtype=torch.float32)
    for _ in range(dim - 1):
        t = torch.stack([t, t], dim=-1)
    return t.to(dtype)


def r_alltoall(hvd, with_splits):
    rank, size = hvd.rank(), hvd.size()
    for dtype, dim in itertools.product(MOVE_DTYPES, DIMS):
        tensor = _alltoall_input(rank, size, dim, dtype)
        if with_splits:
            out, received = hvd.alltoall(tensor, torch.tensor([rank + 1] * size, dtype=torch.int32))
            assert received.dtype == torch.int32 and received.tolist() == [
                r + 1 for r in range(size)
            ]
        else:
            out = hvd.alltoall(tensor)
        want = rank if dtype != torch.bool else bool(rank)
        assert bool((out == want).all()), (dtype, dim)
        assert out.numel() == size * (size + 1) // 2 * 2 ** (dim - 1) and out.dtype == dtype, (
            dtype,
            dim,
        )


@pytest.mark.parametrize("with_splits", [True, False])
def test_horovod_alltoall(with_splits):
    """Uneven splits (rank r sends r+1 rows to everyone) and the equal split; every dtype, 1-3
    dims."""
    on_ranks(r_alltoall, with_splits)


def r_alltoall_errors(hvd):
    rank, size = hvd.rank(), hvd.size()
    return (
        raises(
            lambda: hvd.alltoall(
                torch.empty(size, dtype=torch.int32 if rank % 2 else torch.float32)
            )
        ),
        raises(lambda: hvd.alltoall(torch.ones([2 * size, 10 * (rank + 1), 2 * size]))),
        raises(lambda: hvd.alltoall(torch.empty(size + 1)), (ValueError,)),
        raises(
            lambda: hvd.alltoall(torch.empty(size - 1), torch.ones(size, dtype=torch.int32)),
            (ValueError,),
        ),
        raises(
            lambda: hvd.alltoall(torch.empty(size), torch.empty(size, dtype=torch.float32)),
            (ValueError,),
        ),
    )


def test_horovod_alltoall_errors():
    """Mismatched dtype / trailing shape fail on every rank; a length that does not split equally,
    splits that do not add up to it and non-integer splits are ValueErrors on the calling rank."""
    res = on_ranks(r_alltoall_errors)
    dtype, shape, length, splits, splits_type = res[0]
    assert all(r[:2] == res[0][:2] for r in res)
    assert "dtype torch.float32 on rank 0 but torch.int32 on rank 1" in dtype
    assert "shape after the first dimension (10, 8) on rank 0 but (20, 8) on rank 1" in shape
    assert "first dimension 5 is not a multiple of the size 4" in length
    assert "summing to the first dimension 3" in splits
    assert "splits dtype torch.float32" in splits_type


def r_alltoall_grad(hvd, with_splits):
    rank, size = hvd.rank(), hvd.size()
    for dtype, dim in itertools.product([torch.float32, torch.float64], DIMS):
        tensor = _alltoall_input(rank, size, dim, dtype).requires_grad_()
        if with_splits:
            out, _ = hvd.alltoall(tensor, torch.tensor([rank + 1] * size, dtype=torch.int32))
        else:
            out = hvd.alltoall(tensor)
        out.backward(torch.ones(out.shape, dtype=dtype))
        assert np.linalg.norm(np.ones(tensor.shape) - tensor.grad.numpy()) < 1e-8, (dtype, dim)


@pytest.mark.parametrize("with_splits", [True, False])
def test_horovod_alltoall_grad(with_splits):
    """The gradient travels back along the same splits: ones in, ones out."""
    on_ranks(r_alltoall_grad, with_splits)
