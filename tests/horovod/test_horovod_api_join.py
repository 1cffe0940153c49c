"""Horovod's torch API tests, ported (see tests/horovod/test_horovod_api.py): join, barrier,
timeline; and the engine's own behaviour: fusion threshold, cycle time, response cache, uneven
inputs with join, what is not supported."""

from __future__ import annotations

import itertools
import json
import os
import tempfile
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.distutil import run_dist
from tests.horovod.test_horovod_api import DIMS, close, on_ranks, raises, seeded, threshold

pytestmark = pytest.mark.multi_process


# -- join ------------------------------------------------------------------------------------------
def r_join_allreduce(hvd):
    rank, size = hvd.rank(), hvd.size()
    for dtype, dim, first, caching in itertools.product(
        [torch.int32, torch.int64, torch.float32, torch.float64], DIMS, range(size), [False, True]
    ):
        a, b = seeded([5] * dim, dtype), seeded([17] * dim, dtype)

        def reduce_both(a=a, b=b):
            ha = hvd.allreduce_async(a, name="tensor_a", average=True)
            hb = hvd.allreduce_async(b, name="tensor_b", average=True)
            return hvd.synchronize(ha), hvd.synchronize(hb)

        if caching:
            reduce_both()
        if rank == first:
            ret = hvd.join()
        else:
            avg_a, avg_b = (
                reduce_both()
            )  # the joined rank contributes zeros; Average still divides by size
            ret = hvd.join()
            for got, t in ((avg_a, a), (avg_b, b)):
                want = (
                    (t * (size - 1)).div(size, rounding_mode="trunc")
                    if not dtype.is_floating_point
                    else t * (size - 1) / size
                )
                assert close(got, want, threshold(size, dtype)), (dtype, dim, first)
        assert ret != first
        assert hvd.allgather_object(ret) == [ret] * size


def test_horovod_join_allreduce():
    """Each rank in turn joins first; the others' allreduces (named, fresh and cached) go on with
    it."""
    on_ranks(r_join_allreduce, timeout=600)


def r_join_refuses(hvd, kind):
    rank, size = hvd.rank(), hvd.size()
    tensor = torch.ones(17, 17, 17)
    for first in range(size):
        if rank == first:
            ret = hvd.join()
        else:
            if kind == "allgather":
                msg = raises(lambda: hvd.allgather(tensor))
            else:
                msg = raises(
                    lambda: hvd.broadcast(tensor, rank, name="test_horovod_join_broadcast")
                )
            assert "hvd.join()" in msg or "Mismatched" in msg, msg
            ret = hvd.join()
        assert ret != first and hvd.allgather_object(ret) == [ret] * size


@pytest.mark.parametrize("kind", ["allgather", "broadcast"])
def test_horovod_join_allgather_broadcast(kind):
    """While a rank has joined, allgather and broadcast fail on the others (Horovod's restriction),
    then everyone joins and agrees on the last rank to join."""
    on_ranks(r_join_refuses, kind)


def r_uneven_inputs(hvd):
    rank = hvd.rank()
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    batches = 2 + rank  # rank r has 2 + r batches
    for step in range(batches):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 4, generator=g)
        opt.zero_grad()
        F.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        opt.step()
    last = hvd.join()
    return last, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _uneven_reference(size: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    for step in range(2 + size - 1):
        model.zero_grad()
        active = [r for r in range(size) if step < 2 + r]
        for r in active:
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(100 * step + r))
            (
                F.mse_loss(model(x), x.sum(1, keepdim=True)) / size
            ).backward()  # joined ranks add zeros
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    return dict(model.state_dict())


def test_join_with_uneven_inputs():
    """hvd.join() for uneven data: rank r trains 2 + r steps, then joins; each step's gradient is
    the sum over the ranks still training divided by the size (the joined ones contribute zeros), as
    in Horovod."""
    res = on_ranks(r_uneven_inputs)
    assert [last for last, _ in res] == [3] * 4
    want = _uneven_reference(4)
    for k, v in want.items():
        assert torch.allclose(res[3][1][k], v, atol=1e-6), k


# -- barrier ---------------------------------------------------------------------------------------
def r_global_barrier(hvd):
    hvd.allreduce(torch.ones(1))
    if hvd.rank() == 0:
        time.sleep(2)
    entered = time.time()
    hvd.barrier()
    return entered, time.time()


def test_global_barrier_op():
    """No rank leaves the barrier before the slow rank (rank 0 sleeps 2 s) has entered it."""
    res = on_ranks(r_global_barrier)
    slow_entered = res[0][0]
    assert all(left >= slow_entered for _, left in res)


def r_barrier_with_collectives(hvd):
    handles = [
        hvd.broadcast_async(torch.eye(3), root_rank=0),
        hvd.allgather_async(torch.eye(5)),
        hvd.allgather_async(torch.zeros(5, 5)),
    ]
    reduce_handle = hvd.allreduce_async(torch.eye(5))
    hvd.barrier()
    assert torch.equal(hvd.synchronize(reduce_handle), torch.eye(5))
    return [tuple(hvd.synchronize(h).shape) for h in handles]


def test_barrier_with_multiple_collectives():
    assert on_ranks(r_barrier_with_collectives) == [[(3, 3), (20, 5), (20, 5)]] * 4


# -- timeline, fusion, cycle time, response cache --------------------------------------------------
def r_timeline(hvd):
    texts = []
    for mark_cycles, twice in (
        (True, False),
        (True, False),
        (False, False),
        (True, False),
        (False, True),
    ):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "timeline.json")
            hvd.start_timeline(path, mark_cycles=mark_cycles)
            if twice:
                hvd.start_timeline(path, mark_cycles=mark_cycles)
            for _ in range(2 if twice else 1):
                hvd.allreduce(torch.tensor([1, 2, 3], dtype=torch.float32), name="test_allreduce")
            hvd.stop_timeline()
            if hvd.rank() == 0:
                texts.append((mark_cycles, open(path).read()))
    return texts


def test_timeline_api():
    """start_timeline/stop_timeline, restarted on new files: rank 0 writes one Chrome trace (all
    ranks) with the negotiation and the allreduce of 'allreduce.test_allreduce', and cycle marks
    when asked. (Horovod's version checks its own format's names; this is the same content in
    scaleout's format.)"""
    texts = on_ranks(r_timeline)[0]
    assert len(texts) == 5
    for mark_cycles, text in texts:
        events = json.loads(text)["traceEvents"]
        spans = [e for e in events if e.get("ph") == "X"]
        assert {e["pid"] for e in spans} == {0, 1, 2, 3}
        assert any(
            e["name"] == "NEGOTIATE_ALLREDUCE" and e["args"]["tensor"] == "allreduce.test_allreduce"
            for e in spans
        )
        assert any(
            e["name"] == "ALLREDUCE" and "allreduce.test_allreduce" in e["args"]["tensors"]
            for e in spans
        )
        assert any(e["name"] == "CYCLE_START" for e in spans) == mark_cycles


def r_fusion(hvd, n):
    handles = []
    # 80 ms of submissions (more on a loaded machine): one 2 s cycle holds them all (it ends early,
    # when the first synchronize blocks), 1 ms cycles do not.
    for i in range(n):
        handles.append(hvd.allreduce_async(torch.full((256,), float(i)), name=f"t{i}"))
        time.sleep(0.002)
    return [hvd.synchronize(h)[0].item() for h in handles]


@pytest.mark.parametrize(
    "threshold_bytes,cycle_ms,check",
    [
        ("0", "2000", lambda m: m == 1),
        ("4096", "2000", lambda m: m == 4),
        (None, "2000", lambda m: m == 40),
        (None, "1", lambda m: m < 40),
    ],
)
def test_fusion_threshold_and_cycle_time(tmp_path, threshold_bytes, cycle_ms, check):
    """Tensors queued within one HOROVOD_CYCLE_TIME are fused into buffers of at most
    HOROVOD_FUSION_THRESHOLD bytes (0: one tensor each; 4 KiB: four 1 KiB tensors; default 128 MiB:
    all 40); with 1 ms cycles the same submissions spread over several rounds. The timeline records
    every fused buffer."""
    env = {"HOROVOD_TIMELINE": str(tmp_path / "t.json"), "HOROVOD_CYCLE_TIME": cycle_ms}
    if threshold_bytes is not None:
        env["HOROVOD_FUSION_THRESHOLD"] = threshold_bytes
    results = on_ranks(r_fusion, 40, env=env)
    assert results == [[float(i) for i in range(40)]] * 4
    spans = [
        e
        for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"]
        if e.get("name") == "ALLREDUCE" and e["pid"] == 0
    ]
    sizes = [len(e["args"]["tensors"]) for e in spans]
    assert sum(sizes) == 40 and check(max(sizes)), sizes


def r_cache(hvd):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    neg = hvd.basics.state().engine.negotiator
    counts = []
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        counts.append(neg.uncached_rounds)
    return counts


def test_response_cache_steady_state():
    """After the first step every gradient is in the response cache: later steps negotiate with the
    small bit-vector all-reduce only, never a metadata exchange."""
    for counts in on_ranks(r_cache):
        assert counts[0] >= 1 and counts[1:] == [counts[0]] * 4


def r_stall(hvd):
    import logging

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("scaleout.horovod").addHandler(handler)
    try:
        if hvd.rank() != 0:
            time.sleep(2.5)  # rank 0 waits in the negotiation meanwhile
        hvd.allreduce(torch.ones(2), name="late")
    finally:
        logging.getLogger("scaleout.horovod").removeHandler(handler)
    return seen


def test_stall_warning():
    """A rank blocked for longer than HOROVOD_STALL_CHECK_TIME_SECONDS waiting for the others to
    queue an operation says so, naming it (Horovod's stall inspector); the operation completes when
    they do."""
    res = on_ranks(r_stall, env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "1"})
    assert any("allreduce.late" in m and "HOROVOD_STALL_CHECK_TIME_SECONDS" in m for m in res[0]), (
        res[0]
    )
    assert not any(res[1:])


# -- what is not implemented -----------------------------------------------------------------------
def r_not_supported(hvd):
    model = nn.Linear(2, 2)
    return [
        raises(f, (NotImplementedError,))
        for f in (
            lambda: hvd.add_process_set([0, 1]),
            lambda: hvd.allreduce(torch.ones(2), process_set=object()),
            lambda: hvd.elastic.run,
            lambda: hvd.allreduce(torch.ones(2), op=hvd.Adasum),
            lambda: hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum
            ),
            lambda: hvd.SyncBatchNorm,
        )
    ]


def test_not_supported_features_are_one_line_errors():
    """Process sets, elastic mode, Adasum and SyncBatchNorm raise a NotImplementedError (also a
    UserError) that says so, instead of misbehaving."""
    for msg in on_ranks(r_not_supported)[0]:
        assert "not supported" in msg or "not provided" in msg, msg
        assert "\n" not in msg


def r_single_process(world):
    import scaleout.horovod as hvd

    hvd.init(world=world)
    try:
        t = torch.arange(6.0).view(3, 2)
        out = (
            hvd.allreduce(t).tolist(),
            hvd.allgather(t).shape,
            hvd.broadcast(t, 0).tolist(),
            hvd.reducescatter(t, op=hvd.Sum).shape,
            hvd.alltoall(t).shape,
            hvd.join(),
            hvd.allgather_object("x"),
        )
        hvd.barrier()
        return out
    finally:
        hvd.shutdown()


def test_single_process_world():
    """With one rank every operation completes locally (no negotiation collectives)."""
    ((avg, gathered, bcast, scattered, a2a, last, objs),) = run_dist(r_single_process, 1, 1)
    assert avg == bcast == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    assert gathered == scattered == a2a == (3, 2) and last == 0 and objs == ["x"]
