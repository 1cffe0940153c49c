"""Straggler and desync attribution through the step's one agreement all-reduce
(scaleout/train/skew.py): a rank made slow in its data wait is named in report.json and
metrics.jsonl with its node and phase; a rank whose gradient buckets are laid out differently is
named at the first step boundary, on every rank, in one line, instead of training on silently
mixed gradients."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from scaleout.errors import UserError
from scaleout.train.faults import DelayInjection
from scaleout.train.skew import PHASES, PhaseSkew, SkewTracker, StepSkew, desync_message
from tests.distutil import run_dist
from tests.test_prefetch import SMALL_BERT

RUN = [
    *SMALL_BERT,
    "train.max_steps=6",
    "train.grad_accum=1",
    "train.eval_every=100",
    "train.target=null",
    "train.progress=false",
    "checkpoint.dir=null",
    "checkpoint.every_steps=0",
    "comm.algorithm=flat",
    "optim.warmup_steps=1",
    "optim.total_steps=6",
]


def _skew(**slow: tuple[float, int]) -> StepSkew:
    """Every phase 10 ms on every rank, except ``phase=(seconds, rank)``."""
    phases = {}
    for p in PHASES:
        s, r = slow.get(p, (0.01, 0))
        phases[p] = PhaseSkew(max_s=s, max_rank=r, min_s=0.01, min_rank=1, median_s=0.01)
    return StepSkew(phases)


@pytest.mark.unit
def test_tracker_names_the_slowest_rank_over_the_threshold_only() -> None:
    t = SkewTracker(node_of=(0, 0, 1, 1), threshold=1.3)
    for _ in range(3):
        t.add(_skew(data=(0.05, 2)), step_s=0.1)  # 5x the median, 40 ms of a 100 ms step
    t.add(_skew(compute=(0.012, 3)), step_s=0.1)  # 1.2x: under the threshold
    t.add(_skew(data=(0.0003, 1)), step_s=0.1)  # 30x, but 0.3 ms: under MIN_SHARE of the step
    t.add(_skew(sync_wait=(0.09, 0)), step_s=0.1)  # a victim's wait, not a cause
    out = t.report()
    assert out["stragglers"] == [
        {
            "rank": 2,
            "node": 1,
            "phase": "data",
            "slowdown": pytest.approx(5.0),
            "slowdown_max": pytest.approx(5.0),
            "excess_s": pytest.approx(0.04),
            "steps": 3,
        }
    ]
    data = out["spread"]["phases"]["data"]
    assert data["steps"] == 6 and data["worst_rank"] == 2 and data["worst_s"] == 0.05
    assert out["spread"]["phases"]["sync_wait"]["worst_rank"] == 0
    # persistence: one slow step of rank 1 in 25 is noise; rank 2's 3 of 25 (12 %) still counts
    for _ in range(18):
        t.add(_skew(data=(0.001, 0)), step_s=0.1)
    t.add(_skew(compute=(0.05, 1)), step_s=0.1)
    assert [(s["rank"], s["phase"]) for s in t.report()["stragglers"]] == [(2, "data")]


@pytest.mark.unit
def test_desync_message_names_the_odd_rank_and_bad_delay_spec_is_one_line() -> None:
    msg = desync_message(5, [7, 7, 9, 7], "this rank (0): 2 bucket all-reduces")
    assert msg.startswith("step 5: ") and "rank 2 0x000009" in msg and "\n" not in msg
    assert "rank 0 0x" not in msg and "other 3 ranks" in msg
    assert DelayInjection.from_env(2, {"SCALEOUT_TEST_DELAY": "2:data:50"}).seconds == {
        "data": 0.05
    }
    assert DelayInjection.from_env(1, {"SCALEOUT_TEST_DELAY": "2:data:50"}) is None
    with pytest.raises(UserError, match="'2:disk:50'.*data, compute"):
        DelayInjection.from_env(2, {"SCALEOUT_TEST_DELAY": "2:disk:50"})


def _straggler_run(world, out: str) -> dict:
    from scaleout.config import load_config
    from scaleout.train.trainer import Trainer

    os.environ[DelayInjection.VARIABLE] = "2:data:60"  # rank 2 waits 60 ms for every batch
    try:
        cfg = load_config(None, [*RUN, f"train.output_dir={out}", "train.log_every=3"])
        result = Trainer(cfg, world).train()
    finally:
        del os.environ[DelayInjection.VARIABLE]
    return {"status": result.status, "steps": result.steps}


@pytest.mark.multi_process
def test_a_slow_rank_is_named_with_its_node_and_phase(tmp_path: Path) -> None:
    """2 nodes x 2 ranks; rank 2 (node 1) sleeps 60 ms in every data wait (the test-only
    SCALEOUT_TEST_DELAY hook). report.json, written by rank 0, names rank 2, node 1, phase
    data, on most steps, and no other rank in that phase; the metrics records carry it too."""
    out = tmp_path / "run"
    res = run_dist(_straggler_run, 2, 2, args=(str(out),), timeout=240)
    assert [r["status"] for r in res] == ["max_steps"] * 4, res
    report = json.loads((out / "report.json").read_text())
    data = [s for s in report["stragglers"] if s["phase"] == "data"]
    assert [(s["rank"], s["node"]) for s in data] == [(2, 1)], report["stragglers"]
    assert data[0]["steps"] >= 4 and data[0]["excess_s"] > 0.04, data
    assert data[0]["slowdown"] > 1.3
    spread = report["spread"]["phases"]
    assert set(spread) == set(PHASES) and spread["data"]["worst_rank"] == 2, spread
    assert spread["data"]["min_s"] < 0.03 < spread["data"]["max_s"], spread["data"]
    train = [
        json.loads(line)
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if '"train"' in line
    ]
    assert len(train) == 2 and all(
        any(s["rank"] == 2 and s["phase"] == "data" for s in t["stragglers"]) for t in train
    ), train


def _swapped_layout_run(world, out: str) -> dict:
    """Rank 2 registers BERT's two hidden x hidden heads (pooler, mlm_transform) in the other
    order: the same bytes per bucket, so every collective completes, but its bucket positions hold
    other parameters than its peers' (today: gradients silently summed across the wrong
    parameters)."""
    from scaleout.config import load_config
    from scaleout.train import trainer as trainer_mod

    build = trainer_mod.build_task

    def swapped(cfg, world):
        task = build(cfg, world)
        mods = list(task.model._modules.items())
        names = [n for n, _ in mods]
        i, j = names.index("pooler"), names.index("mlm_transform")
        mods[i], mods[j] = mods[j], mods[i]
        task.model._modules = dict(mods)
        return task

    if world.rank == 2:
        trainer_mod.build_task = swapped
    t0 = time.monotonic()
    try:
        cfg = load_config(None, [*RUN, f"train.output_dir={out}", "train.step_timeout_s=60"])
        trainer_mod.Trainer(cfg, world).train()
        return {"error": None, "seconds": time.monotonic() - t0}
    except UserError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - t0}
    finally:
        trainer_mod.build_task = build


@pytest.mark.multi_process
def test_a_rank_with_another_bucket_layout_is_named_at_the_first_step(tmp_path: Path) -> None:
    res = run_dist(_swapped_layout_run, 2, 2, args=(str(tmp_path / "run"),), timeout=240)
    for rank, r in enumerate(res):
        err = r["error"]
        assert err is not None and err.startswith("CollectiveDesync: step 0: "), (rank, r)
        assert "rank 2 0x" in err and "\n" not in err, err
        assert not any(f"rank {o} 0x" in err for o in (0, 1, 3)), err
        assert f"this rank ({rank}): 1 bucket all-reduces" in err, err
        assert r["seconds"] < 60, r  # at the step boundary, not after a collective timeout
