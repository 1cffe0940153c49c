"""Issue 41 item 6: a slow GPU is named as slow, not its peers (scaleout/train/devicetime.py), and
the replicas vote periodically on a checksum of their weights (scaleout/train/replicas.py)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from distutil import run_dist
from fakecuda import FakeCuda, FakeEvent
from test_skew import RUN

from scaleout.train.devicetime import ComputeClock
from scaleout.train.faults import DelayInjection


def _step(clock: ComputeClock, forward_s: float, wait_s: float) -> None:
    """One micro-batch: a forward that takes ``forward_s``, then a backward whose end-of-backward
    callback (queued by a gradient hook, as the reducer's is) waits ``wait_s`` for peers."""
    from torch.autograd import Variable

    w = torch.ones(4, requires_grad=True)
    w.register_post_accumulate_grad_hook(
        lambda p: Variable._execution_engine.queue_callback(lambda: time.sleep(wait_s))
    )
    clock.begin()
    time.sleep(forward_s)
    loss = (w * 2).sum()
    clock.arm(loss)
    loss.backward()


@pytest.mark.unit
def test_compute_is_forward_and_backward_without_the_gradient_syncs_wait() -> None:
    """On CPU the same regions on the host clock: the forward's 60 ms count, the 200 ms the
    reducer's end-of-backward callback waits for peers do not (its callback runs after the
    clock's end mark: queued later, from a parameter's hook)."""
    clock = ComputeClock(torch.device("cpu"))
    _step(clock, 0.06, 0.2)
    own = clock.take()
    assert own is not None and 0.055 < own < 0.18, own
    assert clock.take() is None  # nothing measured since


class _TimedEvent(FakeEvent):
    """A fake CUDA event with a time and a completion flag: ``elapsed_time`` of an event the
    device has not passed yet is an error (on a GPU: a host sync, or cudaErrorNotReady)."""

    made: list[_TimedEvent] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.at, self.done = 0.0, False
        _TimedEvent.made.append(self)

    def record(self, stream=None) -> None:
        super().record(stream)
        self.at = time.perf_counter()

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, other: FakeEvent) -> float:
        assert self.done and other.done, "read before the device passed it"
        return (other.at - self.at) * 1e3


@pytest.mark.unit
def test_on_a_gpu_compute_is_device_time_read_one_step_late_without_a_sync(monkeypatch) -> None:
    """FakeCuda (no GPU here): the clock records timing events on the compute stream, reads
    step s-1's at step s, only once the device passed them (``query``), and never synchronises."""
    with FakeCuda() as fc:
        monkeypatch.setattr(torch.cuda, "Event", _TimedEvent)
        clock = ComputeClock(torch.device("cuda", 0))
        assert clock.on_device
        _step(clock, 0.05, 0.1)
        assert clock.take() is None  # step 0: nothing of a step before
        _step(clock, 0.0, 0.0)
        assert clock.take() is None  # step 0's events not passed yet: not read, no wait
        for e in _TimedEvent.made:
            e.done = True  # the step's agreement read returned: the device passed them
        _step(clock, 0.0, 0.0)
        late = clock.take()  # step 1's (step 0's were dropped, not waited for)
        assert late is not None and late < 0.04, late
        assert fc.syncs == [], fc.syncs
    _TimedEvent.made.clear()


def _train_with(world, out: str, env: dict[str, str], overrides: list[str]) -> dict:
    """RUN for 8 steps with the test-only faults of ``env`` (read once, when the Trainer starts)."""
    from scaleout.config import load_config
    from scaleout.train.trainer import Trainer

    os.environ.update(env)
    try:
        cfg = load_config(None, [*RUN, f"train.output_dir={out}", "train.max_steps=8", *overrides])
        result = Trainer(cfg, world).train()
    finally:
        for name in env:
            del os.environ[name]
    return {"status": result.status, "steps": result.steps}


@pytest.mark.multi_process
def test_a_slow_device_is_named_not_its_peers(tmp_path: Path) -> None:
    """2 nodes x 2 ranks, the flat all-reduce overlapped with backward: rank 2's forward is 0.5 s
    slower every step (above the noise of 4 ranks on 2 shared cores). The report names rank 2
    (node 1) as the slow device, from its own compute (forward + backward without the gradient
    sync's wait), and no other rank; its peers wait in sync_wait. Before: no slow device was named
    anywhere."""
    out = tmp_path / "run"
    delay = {DelayInjection.VARIABLE: "2:compute:500"}  # rank 2's forward: 0.5 s slower
    res = run_dist(_train_with, 2, 2, args=(str(out), delay, []), timeout=240)
    assert [r["status"] for r in res] == ["max_steps"] * 4, res
    report = json.loads((out / "report.json").read_text())
    slow = report["slow_devices"]
    assert [(s["rank"], s["node"], s["timing"]) for s in slow] == [(2, 1, "host")], slow
    assert slow[0]["steps"] >= 5 and slow[0]["excess_s"] > 0.3, slow
    compute = report["spread"]["phases"]["compute"]
    assert compute["worst_rank"] == 2 and compute["median_s"] < compute["max_s"] - 0.3, compute


@pytest.mark.multi_process
def test_a_replica_that_drifts_mid_run_is_caught_at_the_next_vote(tmp_path: Path) -> None:
    """2 x 2, train.replica_vote_every=2: rank 1's weights drift at its third step (a finite
    silent corruption); the vote after step 4 names rank 1 (node 0) and the run stops there
    (aborted) instead of training on to step 8 with a corrupted replica. Before: the vote ran at
    the end of the run only."""
    out = tmp_path / "run"
    drift = {"SCALEOUT_INJECT_CORRUPT": "2:1"}  # rank 1's update drifts at step 2 (0-based)
    args = (str(out), drift, ["train.replica_vote_every=2"])
    res = run_dist(_train_with, 2, 2, args=args, timeout=240)
    assert res == [{"status": "aborted", "steps": 4}] * 4, res
    report = json.loads((out / "report.json").read_text())
    assert report["weights_consistent"] is False and report["odd_ranks"] == [1], report
