"""Collectives on an emulated CUDA device obey the NCCL stream/thread rule (scaleout.comm.handles).

The GPU is the one thing mocked (tests/fakecuda.py; none exists here): real gloo ranks run the real
collectives while the emulation records which thread issued each one, on which stream it runs (a
synchronous collective on the issuing thread's current stream, an asynchronous one on its group's
own stream) and which stream waited for which. The multi-phase algorithms (hierarchical, torus2d)
used to run their phases as synchronous collectives from the comm thread: on a GPU they ran on the
default (compute) stream, so no bucket overlapped backward, they read gradients produced on another
stream without waiting for them, and with group BN's backward all-reduce issued from the autograd
thread two threads enqueued collectives of two communicators in a rank-dependent order (a hang).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from distutil import run_dist
from fakecuda import FakeCuda


# -- the harness itself ----------------------------------------------------------------------------
@pytest.mark.unit
def test_fakecuda_streams_threads_and_events() -> None:
    """Per-thread current streams, event and stream waits, the read-before-wait hazard, and the
    process-wide mode (a thread started in the context sees the emulated device)."""
    with FakeCuda() as fc:
        side = torch.cuda.Stream()
        assert torch.cuda.current_stream() is fc.default
        seen: dict[str, Any] = {}

        def other() -> None:
            seen["stream"] = torch.cuda.current_stream()
            seen["is_cuda"] = torch.zeros(2, device="cuda").is_cuda

        with torch.cuda.stream(side):
            assert torch.cuda.current_stream() is side
            t = threading.Thread(target=other)
            t.start()
            t.join()
            a = torch.ones(3, device="cuda")  # written on the side stream
        assert seen == {"stream": fc.default, "is_cuda": True}
        assert fc.hazards == []
        _ = a + 1  # the default stream reads it without waiting
        assert len(fc.hazards) == 1 and "written on stream side1" in fc.hazards[0]
        with torch.cuda.stream(side):
            b = torch.ones(3, device="cuda")
            event = torch.cuda.Event()
            event.record()
        torch.cuda.current_stream().wait_event(event)
        _ = b + 1
        with torch.cuda.stream(side):
            c = torch.ones(3, device="cuda")
        torch.cuda.current_stream().wait_stream(side)
        _ = c + 1
        assert len(fc.hazards) == 1, fc.hazards


def _collective_rules(world: Any) -> dict[str, Any]:
    import torch.distributed as dist

    with FakeCuda(world) as fc:
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            a = torch.ones(4, device=world.device)
            dist.all_reduce(a)  # sync: on this thread's current stream
            b = torch.ones(4, device=world.device)
            work = dist.all_reduce(b, async_op=True)  # async: on the group's stream
            early = float((b * 1).sum())  # reads it before waiting
            after_early = list(fc.hazards)
            work.wait()  # the current stream waits, not the host
            late = float((b * 1).sum())
            after_wait = list(fc.hazards)
        t = threading.Thread(target=lambda: dist.all_reduce(torch.ones(2, device=world.device)))
        t.start()
        t.join()
    return {
        "launches": fc.launches,
        "after_early": after_early,
        "after_wait": after_wait,
        "threads": fc.hazards[len(after_wait) :],
        "values": (early, late),
    }


@pytest.mark.multi_process
def test_fakecuda_collective_stream_rules() -> None:
    """The harness on 2 gloo ranks: a sync collective runs on the issuing thread's current stream,
    an async one on its group's own stream; reading its result before ``work.wait()`` is a hazard,
    after it is not; a second thread issuing device collectives is a hazard."""
    for out in run_dist(_collective_rules, nnodes=1, nproc_per_node=2):
        (sync, _, t0, s0, a0), (_, _, t1, s1, a1), (_, _, t2, *_) = out["launches"]
        assert (s0, a0) == ("side1", False) and s1.startswith("nccl:") and a1
        assert (t0, t1) == ("MainThread", "MainThread") and t2 != "MainThread"
        assert len(out["after_early"]) == 1 and "written on stream nccl:" in out["after_early"][0]
        assert out["after_wait"] == out["after_early"]
        assert len(out["threads"]) == 1 and "from threads" in out["threads"][0]
        assert out["values"][1] == 8.0  # (the early read may see 4.0: a real race on gloo too)


# -- the all-reduce algorithms ---------------------------------------------------------------------
def _grid_all_reduce(world: Any, algorithm: str, producer_side_stream: bool) -> dict[str, Any]:
    from scaleout.comm import all_reduce

    with FakeCuda(world) as fc:
        n = 1003  # not a multiple of the row: the padded path
        side = torch.cuda.Stream() if producer_side_stream else None
        with torch.cuda.stream(side):  # None: the default stream
            t = torch.arange(n, dtype=torch.float32, device=world.device) * (world.rank + 1)
            handle = all_reduce(t, world, algorithm, async_op=True)
            unrelated = torch.ones(4, device=world.device) * 2  # compute goes on meanwhile
            handle.wait()
            total = float(t.sum()) + float(unrelated.sum()) * 0
        sync = torch.full((5,), float(world.rank), device=world.device)
        all_reduce(sync, world, algorithm)
        sync_sum = float(sync.sum())
    return {
        "launches": fc.launches,
        "hazards": fc.hazards,
        "total": total,
        "sync": sync_sum,
    }


@pytest.mark.multi_process
@pytest.mark.parametrize("algorithm", ["hierarchical", "torus2d"])
@pytest.mark.parametrize("side", [False, True], ids=["default-stream", "side-stream"])
def test_grid_phases_run_on_the_comm_stream_from_the_caller(algorithm: str, side: bool) -> None:
    """2 nodes x 2 ranks (row reduce-scatter, column all-reduce, row all-gather): every phase is an
    async collective issued by the calling thread on a group's own stream, none runs on the
    compute stream, nothing reads a tensor before its writer's stream was waited for, and the sums
    are right. Before: sync collectives from the comm thread on the default stream (no overlap),
    and with the producer on a side stream the phases read the gradients unordered."""
    p = 4
    n = 1003
    expect = float(sum(r + 1 for r in range(p)) * (n - 1) * n / 2)
    for rank, out in enumerate(
        run_dist(_grid_all_reduce, nnodes=2, nproc_per_node=2, args=(algorithm, side))
    ):
        launches = out["launches"]
        assert out["hazards"] == [], f"rank {rank}: {out['hazards']}"
        ops = {op for op, *_ in launches}
        assert len(ops) == 3, f"rank {rank}: {launches}"  # reduce-scatter, all-reduce, all-gather
        on_default = [x for x in launches if x[3] == "default"]
        assert on_default == [], f"rank {rank}: collectives on the compute stream: {on_default}"
        assert all(x[4] for x in launches), f"rank {rank}: synchronous collectives: {launches}"
        assert {x[2] for x in launches} == {"MainThread"}, f"rank {rank}: {launches}"
        assert out["total"] == pytest.approx(expect, rel=1e-6)
        assert out["sync"] == pytest.approx(5 * sum(range(p)))


# -- group BN + DataParallel on one rank's device --------------------------------------------------
def _groupbn_backward(world: Any) -> dict[str, Any]:
    from torch import nn

    from scaleout.families.resnet.group_bn import GroupBatchNorm2d, bn_process_group
    from scaleout.parallel import DataParallel

    torch.manual_seed(0)
    with FakeCuda(world) as fc:
        group = bn_process_group(world, 2)
        model = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            GroupBatchNorm2d(8, group=group, group_size=2),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1),
            GroupBatchNorm2d(8, group=group, group_size=2),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1),
            GroupBatchNorm2d(8, group=group, group_size=2),
            nn.Flatten(),
            nn.Linear(8 * 6 * 6, 4),
        ).to(world.device)
        dp = DataParallel(model, world, algorithm="hierarchical", bucket_mb=0.001)
        torch.manual_seed(1 + world.rank)
        x = torch.randn(2, 3, 6, 6, device=world.device)
        start = len(fc.launches)
        for _ in range(2):
            dp(x).square().mean().backward()
        step = fc.launches[start:]
        grads = [float(p.grad.double().sum()) for p in model.parameters()]
    return {
        "launches": step,
        "hazards": fc.hazards,
        "grads": grads,
    }


@pytest.mark.multi_process
def test_group_bn_and_bucket_collectives_come_from_one_thread_in_one_order() -> None:
    """1 node x 2 ranks, group BN over both (its own communicator) inside a hierarchical
    DataParallel with tiny buckets: BN's backward all-reduces and the buckets' phases interleave
    during backward. On a GPU they must be issued by one thread per rank, in the same order on
    every rank, the bucket phases off the compute stream. Before: the bucket phases came from the
    comm thread (sync, on the default stream) while BN's came from the autograd thread."""
    results = run_dist(_groupbn_backward, nnodes=1, nproc_per_node=2)
    orders = []
    for rank, out in enumerate(results):
        launches = out["launches"]
        assert out["hazards"] == [], f"rank {rank}: {out['hazards']}"
        assert {x[2] for x in launches} == {"MainThread"}, f"rank {rank}: {launches}"
        bucket = [x for x in launches if x[4]]  # async: the buckets' phases
        assert len(bucket) >= 6, f"rank {rank}: {launches}"
        assert all(x[3] != "default" for x in bucket), f"rank {rank}: {launches}"
        groups = {g: k for k, g in enumerate(dict.fromkeys(y[1] for y in launches))}
        orders.append([(x[0], groups[x[1]]) for x in launches])
    assert orders[0] == orders[1]
    assert results[0]["grads"] == pytest.approx(results[1]["grads"], rel=1e-9)


def _two_buckets(world: Any, algorithm: str) -> dict[str, Any]:
    """Two buckets all-reduced back to back (as backward hands them over), waited for after both
    are out: whether bucket 2's row reduce-scatter is ordered after bucket 1's column
    all-reduce."""
    from scaleout.comm import all_reduce

    with FakeCuda(world) as fc:
        a = torch.arange(1003, dtype=torch.float32, device=world.device) * (world.rank + 1)
        b = torch.ones(600, device=world.device) * (world.rank + 1)
        ha = all_reduce(a, world, algorithm, async_op=True)
        (_, row, *_), (_, col, *_) = fc.launches[:2]  # bucket 1: row RS, column AR, row AG
        col_stream = fc._internal[col]
        col_pos = col_stream.pos  # bucket 1's all-reduce on its group's stream
        hb = all_reduce(b, world, algorithm, async_op=True)
        row_stream = fc._internal[row]  # the row group's stream, after bucket 2's RS
        behind = row_stream.covers(col_stream, col_pos)
        ha.wait()
        hb.wait()
        sums = (float(a.sum()), float(b.sum()))
    return {"behind": behind, "hazards": fc.hazards, "sums": sums, "launches": fc.launches}


@pytest.mark.multi_process
@pytest.mark.parametrize("algorithm", ["hierarchical", "torus2d"])
def test_bucket_phases_pipeline_across_buckets(algorithm: str) -> None:
    """2 nodes x 2 ranks on an emulated GPU (tests/fakecuda.py: stream ordering only, no GPU can
    exist here): bucket 2's intra-node reduce-scatter is not ordered after bucket 1's inter-node
    all-reduce, so on a GPU the NVLink phase of one bucket overlaps the network phase of the one
    before; the sums stay right and nothing reads across streams unordered. Before: one comm
    stream per device, and every phase of bucket 1 ahead of bucket 2's first."""
    total = sum(r + 1 for r in range(4))
    for rank, out in enumerate(
        run_dist(_two_buckets, nnodes=2, nproc_per_node=2, args=(algorithm,))
    ):
        assert out["hazards"] == [], f"rank {rank}: {out['hazards']}"
        assert not out["behind"], f"rank {rank}: {out['launches']}"
        assert out["sums"] == pytest.approx((total * 1002 * 1003 / 2, total * 600.0))
