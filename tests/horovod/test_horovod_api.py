"""Horovod's own torch API tests (horovod/horovod test/parallel/test_torch.py), ported to
scaleout.horovod.

Each test runs on 4 real gloo processes as 2 emulated nodes x 2 (tests/distutil.run_dist) with
``import scaleout.horovod as hvd``; the assertions are Horovod's (every dtype, 1-3 dims, many ranks,
gradients, errors on every rank instead of a hang), rewritten in this project's style. Tests that
need a GPU, process sets or elastic mode are not ported (docs/launchers.md lists them). This file:
basics and the allreduce family; test_horovod_api_{gather,reducescatter,optim}.py: the rest.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch

from tests.distutil import run_dist

pytestmark = pytest.mark.multi_process

# Horovod's CPU dtypes: allreduce takes int32, int64, float16, float32, float64 (mpi_ops_v2.cc);
# allgather, broadcast and alltoall also uint8, int8, int16. scaleout.horovod also reduces the small
# integer types and bfloat16, tested as EXTRA.
REDUCE_DTYPES = [torch.int32, torch.int64, torch.float16, torch.float32, torch.float64]
EXTRA_REDUCE_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.bfloat16]
MOVE_DTYPES = [
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.bool,
]
DIMS = [1, 2, 3]


def _entry(world, fn, args, env):
    import scaleout.horovod as hvd

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        hvd.init(world=world)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        return fn(hvd, *args)
    except (
        BaseException
    ):  # the pool reports the first rank to fail, which may be a victim of another's failure
        import sys
        import traceback

        print(f"rank {world.rank}: {traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    finally:
        if hvd.is_initialized():
            hvd.shutdown()


def on_ranks(fn, *args, env: dict[str, str] | None = None, timeout: float = 240) -> list:
    """``fn(hvd, *args)`` on 2 emulated nodes x 2 ranks, between hvd.init and hvd.shutdown (``env``:
    Horovod variables set while init reads them)."""
    return run_dist(_entry, 2, 2, args=(fn, args, env or {}), timeout=timeout)


def threshold(size: int, dtype: torch.dtype) -> float:
    """Horovod's relative tolerance against exact multiplication (0 for integers and up to 3 ranks);
    bfloat16 (8 significant bits, not in Horovod's tests) rounds its partial sums: 1/128."""
    if dtype == torch.bfloat16:
        return 1 / 128
    if size <= 3 or not dtype.is_floating_point:
        return 0.0
    return 1e-4 if size < 10 else 5e-4


def close(a: torch.Tensor, b: torch.Tensor, rtol: float) -> bool:
    a, b = a.detach(), b.detach()
    if a.is_floating_point() or b.is_floating_point():
        a, b = a.double(), b.double()
    return bool(torch.allclose(a, b, rtol=rtol, atol=0.0)) and a.shape == b.shape


def seeded(shape: list[int], dtype: torch.dtype, low: int = -100, high: int = 100) -> torch.Tensor:
    torch.manual_seed(1234)
    return torch.empty(shape).random_(low, high).to(dtype)


def raises(fn, errors: tuple = (RuntimeError,)) -> str:
    try:
        fn()
    except errors as exc:
        return str(exc)
    raise AssertionError(f"{fn} did not raise {errors}")


# -- basics ----------------------------------------------------------------------------------------
def r_reinit(hvd):
    world = hvd.world()
    before = (hvd.rank(), hvd.size())
    hvd.shutdown()
    assert not hvd.is_initialized()
    hvd.init(world=world)
    assert hvd.is_initialized() and (hvd.rank(), hvd.size()) == before
    return hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist()


def test_horovod_reinit():
    """init -> shutdown -> init keeps rank and size, and collectives work again."""
    assert on_ranks(r_reinit) == [[4.0, 4.0]] * 4


def r_identity(hvd):
    return (
        hvd.rank(),
        hvd.size(),
        hvd.local_rank(),
        hvd.local_size(),
        hvd.cross_rank(),
        hvd.cross_size(),
        hvd.is_initialized(),
        hvd.is_homogeneous(),
        tuple(
            int(os.environ[k])
            for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
        ),
    )


def test_horovod_rank_size_and_is_initialized():
    """rank/size (and local/cross ids) match what the launcher set; is_initialized after init."""
    for r, (rank, size, lrank, lsize, crank, csize, inited, homog, env) in enumerate(
        on_ranks(r_identity)
    ):
        assert (rank, size, lrank, lsize, crank) == env and rank == r
        assert (csize, inited, homog) == (2, True, True)


# -- allreduce -------------------------------------------------------------------------------------
def r_allreduce(hvd, dtypes, average):
    size = hvd.size()
    for dtype, dim in itertools.product(dtypes, DIMS):
        tensor = seeded([17] * dim, dtype)
        out = hvd.allreduce(tensor, average=average)
        want = tensor if average else tensor * size
        assert out.dtype == dtype and close(out, want, threshold(size, dtype)), (dtype, dim)


def test_horovod_allreduce():
    """Sum of 1-3 dim tensors of every dtype equals the tensor times the size."""
    on_ranks(r_allreduce, REDUCE_DTYPES + EXTRA_REDUCE_DTYPES, False)


def test_horovod_allreduce_average():
    """Average of equal tensors is the tensor, exactly for integers (truncating division)."""
    on_ranks(r_allreduce, REDUCE_DTYPES + [torch.bfloat16], True)


def r_allreduce_minmaxprod(hvd, opname):
    rank, size = hvd.rank(), hvd.size()
    for dtype, dim in itertools.product(
        [torch.int32, torch.int64, torch.float32, torch.float64], DIMS
    ):
        tensors = seeded([size] + [17] * dim, dtype)
        out = hvd.allreduce(tensors[rank], op=getattr(hvd, opname))
        if opname == "Product":
            assert close(out, tensors.prod(0).to(dtype), threshold(size, dtype)), (dtype, dim)
        else:
            want = tensors.min(0).values if opname == "Min" else tensors.max(0).values
            assert torch.equal(out, want), (dtype, dim)


@pytest.mark.parametrize("opname", ["Min", "Max", "Product"])
def test_horovod_allreduce_min_max_product(opname):
    """Element-wise Min, Max and Product over ranks holding different tensors."""
    on_ranks(r_allreduce_minmaxprod, opname)


def r_allreduce_inplace(hvd):
    size = hvd.size()
    for dtype, dim in itertools.product(REDUCE_DTYPES, DIMS):
        tensor = seeded([17] * dim, dtype)
        want = tensor * size
        assert hvd.allreduce_(tensor, average=False) is tensor
        assert close(tensor, want, threshold(size, dtype)), (dtype, dim)


def test_horovod_allreduce_inplace():
    on_ranks(r_allreduce_inplace)


def r_allreduce_async_fused(hvd):
    size = hvd.size()
    pending, saw_pending = [], False
    for dtype, dim in itertools.product(REDUCE_DTYPES, DIMS):
        tensor = seeded([17] * dim, dtype)
        handle = hvd.allreduce_async(tensor, average=False)
        saw_pending |= not hvd.poll(handle)
        pending.append((dtype, tensor * size, handle))
    assert saw_pending, "hvd.poll() was always True: not asynchronous?"
    for dtype, want, handle in pending:
        assert close(hvd.synchronize(handle), want, threshold(size, dtype)), dtype


def test_horovod_allreduce_async_fused():
    """Many async allreduces in flight at once (fused by the engine), results match."""
    on_ranks(r_allreduce_async_fused)


def _scaled(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Horovod's CPU scaling: integers in fp64 then truncated, fp16 in fp32, others in their own
    type."""
    dtype = tensor.dtype
    math_type = (
        torch.float32
        if dtype == torch.float16
        else torch.float64
        if not dtype.is_floating_point
        else dtype
    )
    return (torch.tensor(factor, dtype=torch.float64).to(math_type) * tensor.to(math_type)).to(
        dtype
    )


def r_allreduce_scaled(hvd, where):
    size = hvd.size()
    np.random.seed(1234)
    for dtype, dim in itertools.product(REDUCE_DTYPES, DIMS):
        factor = float(np.random.uniform())
        tensor = seeded([17] * dim, dtype)
        kw = {"prescale_factor" if where == "pre" else "postscale_factor": factor}
        out = hvd.allreduce(tensor, average=False, **kw)
        want = _scaled(tensor, factor) * size if where == "pre" else _scaled(tensor * size, factor)
        assert close(out, want, threshold(size, dtype)), (dtype, dim, factor)


@pytest.mark.parametrize("where", ["pre", "post"])
def test_horovod_allreduce_prescale_postscale(where):
    """prescale_factor scales before the sum, postscale_factor after, with Horovod's compute
    types."""
    on_ranks(r_allreduce_scaled, where)


def r_allreduce_errors(hvd):
    rank = hvd.rank()
    msgs = [raises(lambda: hvd.allreduce(seeded([17 + rank] * 3, torch.float32)))]
    dims = [17, 23 * 57] if rank == 0 else [17, 23, 57]  # same number of elements, different rank
    msgs.append(raises(lambda: hvd.allreduce(seeded(dims, torch.float32))))
    msgs.append(
        raises(
            lambda: hvd.allreduce(
                torch.ones(17, 17, dtype=torch.int32 if rank % 2 else torch.float32)
            )
        )
    )
    msgs.append(raises(lambda: hvd.allreduce(torch.ones(3), op=hvd.Max if rank else hvd.Sum)))
    assert hvd.allreduce(torch.ones(3), op=hvd.Sum).tolist() == [4.0] * 3  # still usable afterwards
    return msgs


def test_horovod_allreduce_error_and_type_error():
    """Different shapes, ranks, dtypes or ops across ranks: an error naming the field on every
    rank."""
    res = on_ranks(r_allreduce_errors)
    assert all(r == res[0] for r in res), "every rank reports the same error"
    shape, ndim, dtype, op = res[0]
    assert "shape (17, 17, 17) on rank 0 but (18, 18, 18) on rank 1" in shape
    assert "shape (17, 1311) on rank 0 but (17, 23, 57) on rank 1" in ndim
    assert "dtype torch.float32 on rank 0 but torch.int32 on rank 1" in dtype
    assert "op Sum on rank 0 but Max on rank 1" in op


def r_duplicate_name(hvd, kind):
    start = {
        "allreduce": lambda t: hvd.allreduce_async(t, name="duplicate_name"),
        "allgather": lambda t: hvd.allgather_async(t, name="duplicate_name"),
        "broadcast": lambda t: hvd.broadcast_async(t, root_rank=0, name="duplicate_name"),
        "reducescatter": lambda t: hvd.reducescatter_async(t, name="duplicate_name"),
    }[kind]
    tensor = torch.ones(16, 17)
    msgs, handles = [], []
    for turn in (lambda r: r == 0, lambda r: r > 0):  # rank 0 first, then the others
        if turn(hvd.rank()):
            handles.append(start(tensor))
            msgs.append(raises(lambda: start(tensor), (ValueError,)))
        hvd.barrier()
    results = [hvd.synchronize(h) for h in handles]
    return msgs, [r.shape if isinstance(r, torch.Tensor) else None for r in results]


@pytest.mark.parametrize("kind", ["allreduce", "allgather", "broadcast", "reducescatter"])
def test_horovod_duplicate_name_error(kind):
    """A second concurrent operation with the same name is refused (ValueError) on the rank issuing
    it; the first one still completes once every rank has issued it. As in Horovod, "concurrent"
    means not yet completed: a 100 ms HOROVOD_CYCLE_TIME keeps the first one queued while the second
    is issued, however the busy test machine schedules the threads."""
    for msgs, shapes in on_ranks(r_duplicate_name, kind, env={"HOROVOD_CYCLE_TIME": "100"}):
        assert len(msgs) == 1 and "'duplicate_name' is already in flight" in msgs[0]
        assert len(shapes) == 1


def r_allreduce_grad(hvd, average):
    size = hvd.size()
    for dtype, dim in itertools.product([torch.float32, torch.float64], DIMS):
        tensor = seeded([17] * dim, dtype).requires_grad_()
        hvd.allreduce(tensor, average=average).backward(torch.ones([17] * dim, dtype=dtype))
        want = np.ones([17] * dim) * (1 if average else size)
        assert np.linalg.norm(want - tensor.grad.numpy()) < 1e-8, (dtype, dim)


@pytest.mark.parametrize("average", [False, True])
def test_horovod_allreduce_grad(average):
    """The gradient of a sum allreduce is the size; of an average, one."""
    on_ranks(r_allreduce_grad, average)


# -- grouped allreduce -----------------------------------------------------------------------------
def r_grouped_allreduce(hvd, mode):
    size = hvd.size()
    for dtype, dim in itertools.product(REDUCE_DTYPES, DIMS):
        tensors = [seeded([17] * dim, dtype) + i for i in range(5)]
        if mode == "inplace":
            want = [t * size for t in tensors]
            out = hvd.grouped_allreduce_(tensors, average=False)
            assert all(o is t for o, t in zip(out, tensors, strict=True))
        else:
            want = tensors if mode == "average" else [t * size for t in tensors]
            out = hvd.grouped_allreduce(tensors, average=mode == "average")
        assert len(out) == 5 and all(
            close(o, w, threshold(size, dtype)) for o, w in zip(out, want, strict=True)
        )


@pytest.mark.parametrize("mode", ["sum", "average", "inplace"])
def test_horovod_grouped_allreduce(mode):
    on_ranks(r_grouped_allreduce, mode)


def r_grouped_allreduce_grad(hvd, average):
    size = hvd.size()
    for dtype, dim in itertools.product([torch.float32, torch.float64], DIMS):
        tensors = [seeded([17] * dim, dtype).requires_grad_() for _ in range(5)]
        for s in hvd.grouped_allreduce(tensors, average=average):
            s.backward(torch.ones([17] * dim, dtype=dtype))
        want = np.ones([17] * dim) * (1 if average else size)
        assert all(np.linalg.norm(want - t.grad.numpy()) < 1e-8 for t in tensors), (dtype, dim)


@pytest.mark.parametrize("average", [False, True])
def test_horovod_grouped_allreduce_grad(average):
    on_ranks(r_grouped_allreduce_grad, average)
