"""Horovod's torch API tests, ported (see tests/horovod/test_horovod_api.py): reducescatter and its
grouped form, sparse allreduce."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from tests.horovod.test_horovod_api import (
    DIMS,
    REDUCE_DTYPES,
    _scaled,
    close,
    on_ranks,
    raises,
    seeded,
    threshold,
)

pytestmark = pytest.mark.multi_process


def _expected(
    tensor: torch.Tensor, rank: int, size: int, op: str, where: str | None, factor: float
) -> torch.Tensor:
    if where == "pre":
        whole = _scaled(tensor, factor) * size
    elif where == "post":
        whole = _scaled(tensor * size, factor)
    else:
        whole = tensor * size if op == "Sum" else tensor
    return whole[rank * 4 : (rank + 1) * 4]


def r_reducescatter(hvd, op, where, grouped):
    rank, size = hvd.rank(), hvd.size()
    np.random.seed(12345)
    dtypes = (
        REDUCE_DTYPES
        if (op == "Sum" or where)
        else [torch.int32, torch.int64, torch.float32, torch.float64]
    )
    for dtype, dim in itertools.product(dtypes, DIMS):
        factor = float(np.random.uniform())
        kw = {f"{where}scale_factor": factor} if where else {}
        tensors = [seeded([size * 4] * dim, dtype) + i for i in range(5 if grouped else 1)]
        if grouped:
            out = hvd.grouped_reducescatter(tensors, op=getattr(hvd, op), **kw)
        else:
            out = [hvd.reducescatter(tensors[0], op=getattr(hvd, op), **kw)]
        for t, o in zip(tensors, out, strict=True):
            want = _expected(t, rank, size, op, where, factor)
            assert o.dtype == dtype and close(o, want, threshold(size, dtype)), (
                dtype,
                dim,
                op,
                where,
            )


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize(
    "op,where", [("Sum", None), ("Average", None), ("Sum", "pre"), ("Sum", "post")]
)
def test_horovod_reducescatter(op, where, grouped):
    """Sum, Average, prescale and postscale, single and grouped: rank r gets rows [4r, 4r+4) of the
    result."""
    on_ranks(r_reducescatter, op, where, grouped)


def r_reducescatter_uneven(hvd):
    rank, size = hvd.rank(), hvd.size()
    tensor = torch.arange(10 * 3, dtype=torch.float32).view(10, 3)
    out = hvd.reducescatter(tensor, op=hvd.Sum)
    bounds = [0, 3, 6, 8, 10]  # Horovod: the first rows % size ranks get one row more
    assert torch.equal(out, tensor[bounds[rank] : bounds[rank + 1]] * size)
    return list(out.shape)


def test_reducescatter_uneven_rows():
    """10 rows over 4 ranks: 3, 3, 2, 2 (Horovod's ReducescatterOp::ComputeOutputShapeForRank)."""
    assert [s[0] for s in on_ranks(r_reducescatter_uneven)] == [3, 3, 2, 2]


def r_reducescatter_async_fused(hvd):
    rank, size = hvd.rank(), hvd.size()
    pending, saw_pending = [], False
    for dtype, dim in itertools.product(REDUCE_DTYPES, DIMS):
        tensor = seeded([size * 4] * dim, dtype)
        handle = hvd.reducescatter_async(tensor, op=hvd.Sum)
        saw_pending |= not hvd.poll(handle)
        pending.append((dtype, tensor[rank * 4 : (rank + 1) * 4] * size, handle))
    assert saw_pending, "hvd.poll() was always True: not asynchronous?"
    for dtype, want, handle in pending:
        assert close(hvd.synchronize(handle), want, threshold(size, dtype)), dtype


def test_horovod_reducescatter_async_fused():
    on_ranks(r_reducescatter_async_fused)


def r_reducescatter_errors(hvd):
    rank = hvd.rank()
    dims = [17, 23 * 57] if rank == 0 else [17, 23, 57]
    return (
        raises(
            lambda: hvd.reducescatter(
                seeded([17 + rank] * 3, torch.float32), name="reducescatter_error1"
            )
        ),
        raises(lambda: hvd.reducescatter(seeded(dims, torch.float32), name="reducescatter_error2")),
        raises(
            lambda: hvd.reducescatter(
                torch.ones(17, 17, dtype=torch.int32 if rank % 2 else torch.float32)
            )
        ),
        raises(lambda: hvd.reducescatter(torch.tensor(float(rank))), (ValueError,)),
        raises(
            lambda: hvd.grouped_reducescatter([torch.zeros(3, 1), torch.tensor(float(rank))]),
            (ValueError,),
        ),
        raises(lambda: hvd.reducescatter(torch.ones(8), op=hvd.Adasum)),
    )


def test_horovod_reducescatter_errors():
    """Mismatched shapes / dtypes fail on every rank; a scalar (alone or in a group) is a
    ValueError; Adasum is refused (a RuntimeError, as in Horovod)."""
    res = on_ranks(r_reducescatter_errors)
    assert all(r[:3] == res[0][:3] for r in res)
    shape, ndim, dtype, scalar, grouped_scalar, adasum = res[0]
    assert (
        "reducescatter.reducescatter_error1: shape (17, 17, 17) on rank 0 but (18, 18, 18) on rank "
        "1" in shape
    )
    assert "shape (17, 1311) on rank 0 but (17, 23, 57) on rank 1" in ndim
    assert "dtype torch.float32 on rank 0 but torch.int32 on rank 1" in dtype
    assert "at least 1 dimension" in scalar and "at least 1 dimension" in grouped_scalar
    assert "Adasum" in adasum


def r_reducescatter_grad(hvd, op, grouped):
    size = hvd.size()
    for dtype, dim in itertools.product([torch.float32, torch.float64, torch.float16], DIMS):
        tensors = [
            seeded([size * 4] * dim, dtype).requires_grad_() for _ in range(5 if grouped else 1)
        ]
        hop = getattr(hvd, op)
        out = (
            hvd.grouped_reducescatter(tensors, op=hop)
            if grouped
            else [hvd.reducescatter(tensors[0], op=hop)]
        )
        for o in out:
            o.backward(torch.ones([4] + [size * 4] * (dim - 1), dtype=dtype))
        want = np.ones([size * 4] * dim) * (size if op == "Sum" else 1)
        assert all(np.linalg.norm(want - t.grad.double().numpy()) < 1e-8 for t in tensors), (
            dtype,
            dim,
        )


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_horovod_reducescatter_grad(op, grouped):
    """Horovod's gradient: the allgather of the output gradient, times the size for Sum."""
    on_ranks(r_reducescatter_grad, op, grouped)


def r_sparse_allreduce(hvd):
    torch.manual_seed(hvd.rank())
    rows = [17, 32, 81, 12, 15, 23, 22]
    tensors = []
    for n in rows:
        t = torch.rand(n, 10)
        t[t < 0.8] = 0
        tensors.append(t.to_sparse())
    dense = [hvd.allreduce(t.to_dense()) for t in tensors]
    waits = [
        hvd.sparse_allreduce_async(t, op=hvd.Average, name=str(i)) for i, t in enumerate(tensors)
    ]
    for want, wait in zip(dense, waits, strict=True):
        got = wait()
        assert got.is_sparse and torch.allclose(want, got.to_dense(), rtol=1e-6)


def test_horovod_async_sparse_allreduce():
    """Allgather of indices and values gives the same average as the dense allreduce."""
    on_ranks(r_sparse_allreduce)
