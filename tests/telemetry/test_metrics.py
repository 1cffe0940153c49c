"""Metrics you can look at (scaleout/telemetry/metrics.py, `scaleout plot`) and torch.profiler
traces with the
communication timeline's ranges (scaleout/telemetry/profiler.py), from real 2-rank runs of the tiny
config."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scaleout.errors import ConfigError
from scaleout.telemetry.metrics import MIN_CURVE_POINTS, Metrics, plot_run, read_metrics
from scaleout.train.observe import EvalRecord, StepRecord

SHORT = [
    "train.global_batch=16",
    "data.eval_samples=32",
    "train.max_steps=6",
    "train.eval_every=3",
    "train.progress=false",
    "checkpoint.dir=null",
    # bert_tiny_cpu checkpoints every 200 steps, which needs a checkpoint.dir
    "checkpoint.every_steps=0",
]


def _train(out: Path, *overrides: str, nproc: int = 2) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "scaleout",
        "launch",
        "--nproc-per-node",
        str(nproc),
        "--",
        "scaleout",
        "train",
        "bert_tiny_cpu",
        *SHORT,
        f"train.output_dir={out}",
        *overrides,
    ]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )


def _eval(
    step: int, samples: int, metric: str, value: float, target: float | None = None
) -> EvalRecord:
    return EvalRecord(step, samples, 0, metric, value, target, continues=False)


def _records(path: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["type"] == kind]


def _tb_scalars(logdir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.mark.unit
def test_log_every_means_and_resume_dedup(tmp_path: Path) -> None:
    """log_every=3: one record per 3 steps with the mean loss and the summed throughput, a forced
    record at the last step; a resumed run appends and the reader keeps the latest record of a
    redone step."""
    m = Metrics(tmp_path, ["jsonl", "csv"], log_every=3)
    m.start(world_size=2, nodes=1, ranks_per_node=2, launcher="local", config="c")
    for s in range(1, 8):  # step s: loss s, 0.5 s, 10 samples
        m.step(
            StepRecord(
                step=s,
                samples=10 * s,
                loss=float(s),
                lr=0.1 * s,
                seconds=0.5,
                step_samples=10,
                step_tokens=100,
                breakdown_s={"forward": 0.2, "backward": 0.3},
                flush=s == 7,
            )
        )
    m.eval(_eval(7, 70, "mlm_accuracy", 0.25, target=0.3))
    m.close("max_steps")
    train = _records(tmp_path / "metrics.jsonl", "train")
    assert [r["step"] for r in train] == [3, 6, 7]
    assert [r["loss"] for r in train] == [2.0, 5.0, 7.0]
    assert train[0]["samples_per_s"] == pytest.approx(30 / 1.5) and train[0]["lr"] == pytest.approx(
        0.3
    )
    assert train[0]["breakdown_s"] == pytest.approx({"forward": 0.2, "backward": 0.3})
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert [(r["kind"], r["step"]) for r in rows] == [
        ("train", "3"),
        ("train", "6"),
        ("train", "7"),
        ("eval", "7"),
    ]
    assert float(rows[3]["value"]) == 0.25 and float(rows[0]["forward_s"]) == pytest.approx(0.2)
    again = Metrics(tmp_path, ["jsonl", "csv"], log_every=1)  # resumed from a checkpoint at step 5
    again.start(start_step=5)
    again.step(StepRecord(6, 60, 0.5, 0.6, 0.5, 10))
    again.close("max_steps")
    data = read_metrics(tmp_path)
    assert [(r["step"], r["loss"]) for r in data["train"]] == [(3, 2.0), (6, 0.5), (7, 7.0)]
    assert len(data["runs"]) == 2 and [r["value"] for r in data["eval"]] == [0.25]
    assert (
        len(list(csv.DictReader(open(tmp_path / "metrics.csv")))) == 5
    )  # one header, rows appended


@pytest.mark.unit
def test_other_ranks_write_nothing(tmp_path: Path) -> None:
    m = Metrics(tmp_path / "r1", ["csv"], enabled=False)
    m.start(world_size=2)
    m.step(StepRecord(1, 1, 1.0, 0.1, 0.1, 1))
    m.eval(_eval(1, 1, "x", 0.1))
    assert m.close("max_steps") is None and not (tmp_path / "r1").exists()


@pytest.mark.unit
def test_missing_sink_package_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(
        ConfigError,
        match=r"^train.metrics: wandb needs the wandb package \(pip install 'scaleout\[wandb\]'\)$",
    ):
        Metrics(tmp_path, ["wandb"])
    with pytest.raises(ConfigError, match="no metrics file"):
        read_metrics(tmp_path)


@pytest.mark.unit
def test_tensorboard_events_read_back(tmp_path: Path) -> None:
    m = Metrics(tmp_path, ["tensorboard"], log_every=2)
    for s in range(1, 5):
        m.step(StepRecord(s, s, float(s), 0.01, 1.0, 1, breakdown_s={"optimizer": 0.25}))
    m.eval(_eval(4, 4, "top1", 0.5))
    m.close()
    assert _tb_scalars(tmp_path / "tb", "train/loss") == [(2, 1.5), (4, 3.5)]
    assert _tb_scalars(tmp_path / "tb", "time/optimizer_s") == [(2, 0.25), (4, 0.25)]
    assert _tb_scalars(tmp_path / "tb", "eval/top1") == [(4, 0.5)]


@pytest.mark.full_system
def test_tiny_run_leaves_metrics_curves_tensorboard_and_profile(tmp_path: Path) -> None:
    """One 2-rank DataParallel run: metrics.jsonl (+ CSV, TensorBoard), metrics.png, and with
    train.profile a Chrome trace per rank whose traceEvents hold the timeline's ranges next to
    gloo's own collectives."""
    out = tmp_path / "run"
    r = _train(
        out,
        "train.metrics=[csv,tensorboard,png]",  # png: 6 records draw no curves unless asked
        "train.profile.wait=1",
        "train.profile.warmup=1",
        "train.profile.active=2",
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    train = _records(out / "metrics.jsonl", "train")
    assert [t["step"] for t in train] == [1, 2, 3, 4, 5, 6]
    assert all(t["loss"] > 0 and t["samples_per_s"] > 0 for t in train)
    # the learning rate each step used: linear warm-up over optim.warmup_steps=30 from 0 to
    # optim.lr=2e-2
    assert [t["lr"] for t in train] == pytest.approx([2e-2 * s / 30 for s in range(6)])
    # the breakdown of the steps the timers sampled (train.timing_every=50: the first), none for the
    # others
    assert {"data", "forward", "backward", "exposed_comm", "optimizer"} <= set(
        train[0]["breakdown_s"]
    )
    assert all(t["breakdown_s"] == {} for t in train[1:])
    assert [(e["step"], e["metric"]) for e in _records(out / "metrics.jsonl", "eval")] == [
        (3, "mlm_accuracy"),
        (6, "mlm_accuracy"),
    ]
    (run,) = _records(out / "metrics.jsonl", "run")
    assert (run["world_size"], run["launcher"]) == (2, "local")
    assert [s for s, _ in _tb_scalars(out / "tb", "train/loss")] == [1, 2, 3, 4, 5, 6]
    assert (out / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    traces = sorted((out / "profile").glob("rank*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank0", "rank1"]
    for t in traces:
        events = json.loads(t.read_text())["traceEvents"]
        names = {e["name"] for e in events if e.get("ph") == "X"}
        for rng in (
            "scaleout.backward",
            "scaleout.bucket 0",
            "scaleout.wait",
            "scaleout.all_reduce",
            "scaleout.phase.forward",
            "scaleout.phase.optimizer",
        ):
            assert rng in names, (t.name, rng)
        assert any(n.startswith("gloo:") or n.startswith("c10d::") for n in names)
        assert sum(n.startswith("ProfilerStep#") for n in names) == 2  # active=2

    png = tmp_path / "again.png"
    p = subprocess.run(
        [sys.executable, "-m", "scaleout", "plot", str(out), "--out", str(png)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0 and png.is_file(), p.stderr
    assert "6 training records" in p.stdout and "2 evaluations" in p.stdout


@pytest.mark.full_system
@pytest.mark.parametrize("overlap", [False, True])
def test_sharded_lamb_profile_has_its_collectives(tmp_path: Path, overlap: bool) -> None:
    out = tmp_path / "run"
    r = _train(
        out,
        "optim.sharded=true",
        f"optim.overlap_comm={str(overlap).lower()}",
        "train.max_steps=3",
        "train.profile.wait=0",
        "train.profile.warmup=1",
        "train.profile.active=2",
        "train.profile.ranks=[0]",
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (trace,) = (out / "profile").glob(
        "*.pt.trace.json"
    )  # rank 1 is not profiled (train.profile.ranks)
    assert trace.name.startswith("rank0.")
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    spans = {e["name"]: e for e in events}
    assert {"scaleout.reduce_scatter", "scaleout.all_gather", "scaleout.phase.optimizer"} <= set(
        spans
    )
    assert all(e["dur"] >= 0 for e in events if e["name"].startswith("scaleout."))
    # the overlapped sharded LAMB's wait after backward is reported as exposed communication, as
    # DataParallel's
    breakdown = json.loads((out / "report.json").read_text())["breakdown_s"]
    assert ("exposed_comm" in breakdown) == overlap, breakdown


@pytest.mark.full_system
def test_plot_without_metrics_is_one_line(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "scaleout", "plot", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2
    assert p.stderr.strip() == (
        f"scaleout plot: error: {tmp_path / 'metrics.jsonl'}: no metrics file (expected a "
        "run directory written by `scaleout train`)"
    )


@pytest.mark.unit
@pytest.mark.parametrize(
    "records, sinks, drawn", [(9, (), False), (9, ("png",), True), (10, (), True)]
)
def test_curves_are_drawn_for_a_curve_or_when_asked(
    tmp_path: Path, records: int, sinks: tuple[str, ...], drawn: bool
) -> None:
    """A run of fewer than MIN_CURVE_POINTS records draws no metrics.png unless png is listed."""
    assert MIN_CURVE_POINTS == 10
    m = Metrics(tmp_path, sinks=sinks, log_every=1)
    for s in range(1, records + 1):
        m.step(StepRecord(s, s * 8, 10.0 / s, 1e-3, 0.1, 8))
    png = m.close("success")
    assert (png is not None) == drawn == (tmp_path / "metrics.png").exists()


@pytest.mark.unit
def test_plot_run_draws_both_panels(tmp_path: Path) -> None:
    m = Metrics(tmp_path, log_every=1)
    m.start(world_size=4, nodes=2, ranks_per_node=2, launcher="local", config="bert_tiny_cpu")
    for s in range(1, 21):
        m.step(StepRecord(s, s * 8, 10.0 / s, 1e-3 * min(s, 5) / 5, 0.1, 8))
        if s % 5 == 0:
            m.eval(_eval(s, s * 8, "mlm_accuracy", 0.01 * s, target=0.15))
    png = m.close("success")
    assert (
        png == tmp_path / "metrics.png"
        and plot_run(tmp_path, tmp_path / "b.png") == tmp_path / "b.png"
    )
    assert png.stat().st_size > 10_000  # two axes with curves, not an empty figure
