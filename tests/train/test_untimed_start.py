"""report.json splits the untimed start (allocation or launch to run_start: rendezvous, model and
data, communicators, checkpoint load, the last set-up) from MLPerf's run_start -> run_stop,
and the garbage collector runs only at evaluation and checkpoint boundaries
(scaleout/telemetry/startup.py, scaleout/train/gcpolicy.py)."""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import pytest

from scaleout.telemetry.startup import PHASES, StartClock, describe, launch_unix
from scaleout.train.gcpolicy import GcPolicy

RUN = [
    "data.source=synthetic",
    "data.eval_samples=8",
    "launch.env=single",
    "train.global_batch=8",
    "train.max_steps=12",
    "train.eval_every=4",
    "train.target=null",
    "train.progress=false",
    "train.metrics=[]",
    "checkpoint.every_steps=6",
    "optim.warmup_steps=2",
    "optim.total_steps=100",
    "comm.algorithm=flat",
]


class Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.mark.unit
def test_gc_policy_collects_only_at_boundaries() -> None:
    was = gc.isenabled()
    old = gc.get_threshold()
    gc.set_threshold(10)  # automatic collection would fire every 10 allocations
    seen: list[str] = []

    def watch(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append("in" if policy.in_boundary else "out")

    policy = GcPolicy()
    try:
        policy.start()
        gc.callbacks.append(watch)
        assert not gc.isenabled() and gc.get_freeze_count() > 0
        for _ in range(2000):  # a "step loop" that leaves reference cycles behind
            Cycle()
        assert seen == []  # no collection in the loop
        assert policy.collect() >= 2000  # the boundary frees the cycles
        assert seen == ["in"]
        summary = policy.summary()
        assert summary["unplanned_collections"] == 0 and summary["boundary_collections"] == 1
    finally:
        if watch in gc.callbacks:
            gc.callbacks.remove(watch)
        policy.stop()
        gc.set_threshold(*old)
    assert gc.isenabled() == was and gc.get_freeze_count() == 0


@pytest.mark.unit
def test_start_clock_phases_add_up_to_the_start() -> None:
    t0 = time.time() - 10.0
    env = {"SCALEOUT_LAUNCH_UNIX": f"{t0:.3f}"}
    assert launch_unix(env) == pytest.approx(t0, abs=1e-3)
    assert launch_unix({"SCALEOUT_LAUNCH_UNIX": "soon"}) is None
    assert launch_unix(env, before=t0 - 5) is None  # a launch after the process: clock skew
    clock = StartClock(t0 + 2.0, entry=t0 + 3.0)
    clock.launched = t0
    clock.mark("rendezvous", t0 + 5.0)
    clock.mark("model_and_data", t0 + 6.5)
    sec = clock.section(t0 + 9.0, init_start=t0 + 5.5)
    ph = sec["phases_s"]
    assert list(ph) == list(PHASES)
    assert (ph["launch"], ph["imports"], ph["rendezvous"]) == (2.0, 1.0, 2.0)
    assert ph["to_run_start"] == pytest.approx(2.5)
    assert sec["total_s"] == pytest.approx(9.0) == pytest.approx(sum(ph.values()))
    assert sec["to_init_start_s"] == pytest.approx(5.5)
    assert "untimed start: 9.00 s from the allocation" in describe(sec, 1.0)


@pytest.mark.full_system
def test_report_splits_the_untimed_start_and_gc_stays_out_of_the_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One real rank (tiny BERT, synthetic data, ~15 s): report.json has the untimed start's
    phases, summing to its total, and no collection ran inside a step."""
    import torch

    from scaleout.config import load_config
    from scaleout.train.trainer import process_start_unix, run_training

    torch.set_num_threads(1)
    # as a launcher would: its moment, here 1 s before this (pytest's) process started
    monkeypatch.setenv("SCALEOUT_LAUNCH_UNIX", f"{process_start_unix() - 1.0:.3f}")
    out = tmp_path / "out"
    cfg = load_config(
        "bert_tiny_cpu", [*RUN, f"train.output_dir={out}", f"checkpoint.dir={tmp_path / 'ck'}"]
    )
    was = gc.isenabled()
    result = run_training(cfg)
    assert result.status == "max_steps"
    assert gc.isenabled() == was and gc.get_freeze_count() == 0  # restored after the run
    printed = capsys.readouterr().out
    assert "untimed start: " in printed and f"report {out}/report.json" in printed
    report = json.loads((out / "report.json").read_text())
    start = report["untimed_start"]
    ph = start["phases_s"]
    assert set(ph) == set(PHASES) and start["from"] == "allocation"
    assert ph["launch"] >= 0.9  # the launcher's moment, 1 s before this process's start
    assert ph["rendezvous"] > 0 and ph["model_and_data"] > 0
    assert sum(ph.values()) == pytest.approx(start["total_s"], rel=1e-3, abs=1e-2)
    assert 0 < start["to_init_start_s"] < start["total_s"]
    assert report["time_to_train_s"] > 0
    g = report["gc"]
    assert g["unplanned_collections"] == 0 and g["frozen_objects"] > 0
    assert g["boundary_collections"] >= 12 // 4  # every evaluation (and save) is a boundary
