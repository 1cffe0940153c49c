"""Cross-stream frees on an emulated CUDA device (tests/fakecuda.py's caching-allocator model; no
GPU exists here, so the device is the one thing mocked).

The caching allocator hands a freed block to the next allocation on the stream that allocated it,
whatever other streams still have queued on it. ``all_reduce`` of a non-contiguous tensor with a
multi-phase algorithm stages it in a contiguous copy made on the caller's stream, whose phases run
on the comm stream: the copy must stay reserved until the comm stream is done with it
(``record_stream``), or the caller's next allocation overwrites it mid-reduction.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distutil import run_dist
from fakecuda import FakeCuda


@pytest.mark.unit
def test_fakecuda_flags_a_cross_stream_free_unless_recorded_or_waited() -> None:
    """The harness: a tensor allocated on the default stream, used on a side stream and freed is a
    hazard; with record_stream(side), or the default stream waiting for the side stream, it is
    not."""
    with FakeCuda() as fc:
        side = torch.cuda.Stream()
        for fix in ("none", "record_stream", "wait"):
            t = torch.ones(8, device="cuda")
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                t.mul_(2)
            if fix == "record_stream":
                t.record_stream(side)
            elif fix == "wait":
                torch.cuda.current_stream().wait_stream(side)
            del t
            assert len(fc.hazards) == 1, (fix, fc.hazards)
        assert "cross-stream free" in fc.hazards[0] and "stream side1" in fc.hazards[0]


@pytest.mark.unit
def test_fakecuda_engine_writes_and_finished_pixels() -> None:
    """An engine write (nvJPEG's hardware decoder) into a block handed out while its stream has
    unfinished work is a hazard, and not after a synchronisation; ``finished`` answers whether the
    host saw a tensor's last write complete."""
    with FakeCuda() as fc:
        busy = torch.ones(4, device="cuda") * 3  # queued work on the default stream
        out = torch.empty(4, device="cuda")
        fc.engine_write(out, "decoder")
        assert len(fc.hazards) == 1 and "decoder writes" in fc.hazards[0]
        assert not fc.finished(busy)
        torch.cuda.current_stream().synchronize()
        assert fc.finished(busy) and fc.finished(out)
        out2 = torch.empty(4, device="cuda")
        fc.engine_write(out2, "decoder")
        assert len(fc.hazards) == 1, fc.hazards
        y = out2 + 1
        assert not fc.finished(y)


def _noncontiguous(world: Any, algorithm: str) -> dict[str, Any]:
    from scaleout.comm import all_reduce

    with FakeCuda(world) as fc:
        base = torch.arange(12, dtype=torch.float32, device=world.device).view(3, 4)
        t = base.t()  # non-contiguous: the all-reduce stages a contiguous copy
        handle = all_reduce(t, world, algorithm, async_op=True)
        _ = torch.zeros(12, device=world.device)  # the caller allocates meanwhile
        handle.wait()
        total = float(base.sum())
    return {"hazards": fc.hazards, "total": total}


@pytest.mark.multi_process
@pytest.mark.parametrize("algorithm", ["hierarchical", "torus2d"])
def test_noncontiguous_all_reduce_keeps_its_staging_copy_for_the_comm_stream(
    algorithm: str,
) -> None:
    """``all_reduce(t.t(), world, "hierarchical"/"torus2d", async_op=True)`` on the device: no
    cross-stream free of the staging copy (review gpu-day-two finding 6), and the sum is right."""
    for out in run_dist(_noncontiguous, nnodes=2, nproc_per_node=1, args=(algorithm,)):
        assert out["hazards"] == [], out["hazards"]
        assert out["total"] == 2 * sum(range(12))
