"""Samples to converge vs global batch (MLCommons' RCPs, fits to bench largebatch runs), MLPerf's
evaluation schedule, the fixed per-step cost, and the speed-up row of ``simulate validate``."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

import pytest

from scaleout.cli import main
from scaleout.errors import ConfigError
from scaleout.families.resnet import IMAGENET_TRAIN_IMAGES
from scaleout.sim.cluster import get_cluster
from scaleout.sim.convergence import (
    fit_curve,
    largebatch_points,
    load_rcps,
    rcp_curve,
)
from scaleout.sim.mlperf import get_run, speedup
from scaleout.sim.overhead import get_overhead
from scaleout.sim.step import (
    H200_RESNET50_ROWS,
    TrainSpec,
    eval_interval,
    get_model,
    step_time,
    with_overhead,
)
from scaleout.sim.validate import Validation, all_validations, mlperf_speedup

pytestmark = pytest.mark.unit


def package_table(bench: str) -> dict[int, list[float]]:
    """The RCP JSON of the installed mlperf-logging, read here independently of the simulator."""
    spec = importlib.util.find_spec("mlperf_logging")
    root = Path(list(spec.submodule_search_locations)[0])
    raw = json.loads((root / "rcp_checker/training_2.0.0" / f"rcps_{bench}.json").read_text())
    return {int(r["BS"]): [float(x) for x in r["Epochs to converge"]] for r in raw.values()}


def olympic(xs: list[float]) -> float:
    return statistics.fmean(sorted(xs)[1:-1])


def test_rcp_curve_is_read_from_the_installed_package_and_rises_with_batch():
    table = package_table("bert")
    recs = load_rcps("bert")
    assert {r.batch: r.runs for r in recs} == table
    # the figures anchors.md quotes (2.55 M at 256, 2.84 M at 4,096, 5.50 M at 16,384) are the
    # package table's means
    quoted = {b: round(statistics.fmean(table[b]) / 1e6, 2) for b in (256, 4096, 16384)}
    assert quoted == {256: 2.55, 4096: 2.84, 16384: 5.50}
    curve = rcp_curve("bert")
    # at the ends the curve is the RCP mean (rcp_checker's olympic mean) of the table
    assert curve.samples(256) == pytest.approx(olympic(table[256]))
    assert curve.samples(16384) == pytest.approx(olympic(table[16384]))
    grid = [256 * 2 ** (k / 4) for k in range(25)]  # 256 .. 16384
    values = [curve.samples(b) for b in grid]
    assert values == sorted(values)
    assert curve.samples(256) < curve.samples(4096) < curve.samples(16384)
    assert curve.samples(16384) > 1.9 * curve.samples(4096)
    assert not curve.extrapolated(16384) and curve.extrapolated(32768)
    # ResNet's table counts epochs of ImageNet-1k
    res = package_table("resnet")
    assert rcp_curve("resnet").samples(1632) == pytest.approx(
        olympic(res[1632]) * IMAGENET_TRAIN_IMAGES
    )


def test_speedup_1024_to_4096_a100_within_15_percent_of_published():
    """NVIDIA's MLPerf v2.0 BERT: 0.4209 min on 1,024 A100, 0.2057 min on 4,096: 2.05x."""
    v = mlperf_speedup()
    measured = get_run("e").ttt_min / get_run("c").ttt_min
    assert v.reference == pytest.approx(measured) and v.reference == pytest.approx(2.05, abs=0.01)
    assert abs(v.predicted / measured - 1) <= 0.15 and v.ok, v


def test_fixed_samples_model_predicts_about_4x():
    """The old model (5.53 M samples at every batch) says ~4x: 4x fewer steps at the same step
    time, outside the row's tolerance."""
    ratio, small, large = speedup("e", "c", None)
    assert 3.7 < ratio < 4.3
    assert small.ttt.samples / small.run.batch_per_gpu == pytest.approx(
        large.ttt.samples / large.run.batch_per_gpu
    )
    assert abs(ratio / mlperf_speedup().reference - 1) > 0.15


def test_validate_has_no_fail_and_no_known_miss():
    vals = all_validations()
    assert {v.status for v in vals} <= {"ok", "compare"}, [(v.key, v.status) for v in vals]
    assert {"b", "c", "e", "f", "g", "h", "s"} <= {v.key for v in vals}
    assert "expected_miss" not in Validation.__dataclass_fields__


def test_mlperf_eval_interval_matches_nvidia_configs():
    """EVAL_ITER_SAMPLES of the submitted configs (and their logs): 325,000 at 16,384; 175,000 at
    4,096 and 3,072; 300,000 at 13,888. ResNet: every 4 epochs."""
    bert = get_model("bert-large")
    got = {b: eval_interval(bert, b) for b in (16384, 4096, 3072, 13888)}
    assert got == {16384: 325000, 4096: 175000, 3072: 175000, 13888: 300000}
    assert eval_interval(get_model("resnet50"), 4096) == 4 * IMAGENET_TRAIN_IMAGES


def test_fit_recovers_the_critical_batch_and_reads_bench_largebatch(tmp_path, capsys):
    e_min, b_crit = 3000.0, 40.0
    pts = [(b, e_min * (1 + b / b_crit)) for b in (2, 4, 8, 16)]
    f = fit_curve(pts)
    assert f.e_min == pytest.approx(e_min) and f.b_crit == pytest.approx(b_crit)
    with pytest.raises(ConfigError, match="two or more batch sizes") as exc:
        fit_curve([(2, 100), (2, 120)])
    assert "\n" not in str(exc.value)
    # the bench's JSON: median over seeds of steps x batch; runs short of the target left out
    runs = [
        {"optimizer": "lamb", "batch": 2, "steps": 1600, "max_steps": 3200, "seed": 0},
        {"optimizer": "lamb", "batch": 2, "steps": 1400, "max_steps": 3200, "seed": 1},
        {"optimizer": "lamb", "batch": 16, "steps": 250, "max_steps": 400, "seed": 0},
        {"optimizer": "lamb", "batch": 16, "steps": None, "max_steps": 400, "seed": 1},
        {"optimizer": "adamw", "batch": 16, "steps": 100, "max_steps": 400, "seed": 0},
    ]
    path = tmp_path / "largebatch.json"
    path.write_text(json.dumps({"bench": "largebatch", "runs": runs}))
    points, notes = largebatch_points(path)
    assert points == [(2.0, 3000.0), (16.0, 4000.0)] and len(notes) == 1
    assert main(["simulate", "convergence", str(path), "--batches", "2,16"]) == 0
    out = capsys.readouterr().out
    assert "B / " in out and "3000" in out and "4000" in out
    args = ["simulate", "scale", f"sim.convergence={path}", "sim.local_batch=2", "--out", ""]
    assert main([*args, "--max-gpus", "8", "--algorithms", "tree"]) == 0
    assert f"samples to converge: {fit_curve(points, f'fit to {path}').describe()}" in (
        capsys.readouterr().out
    )


def test_a_target_on_a_plateau_is_named_in_the_fit_notes(tmp_path):
    """The curves of `scaleout bench plan`'s check at the tiny BERT's 0.15 (2026-12-05): LAMB at
    16 rows reached 0.148 at step 600 and crossed 0.15 at 1,600; at 64 rows it rose steadily. The
    fit then said samples fall with the batch; the note names the plateau run, not the other."""
    flat = [[200, 0, 0.0969], [400, 0, 0.1345], [600, 0, 0.1481], [800, 0, 0.1446],
            [1000, 0, 0.1474], [1200, 0, 0.1488], [1400, 0, 0.1436], [1600, 0, 0.1575]]  # fmt: skip
    steep = [[50, 0, 0.054], [150, 0, 0.112], [250, 0, 0.1446], [300, 0, 0.1537]]
    runs = [
        {"optimizer": "lamb", "batch": 16, "steps": 1600, "seed": 1, "curve": flat},
        {"optimizer": "lamb", "batch": 64, "steps": 300, "seed": 1, "curve": steep},
    ]
    path = tmp_path / "largebatch.json"
    path.write_text(json.dumps({"bench": "largebatch", "target": 0.15, "runs": runs}))
    points, notes = largebatch_points(path)
    assert points == [(16.0, 25600.0), (64.0, 19200.0)]
    (note,) = notes
    assert "batch 16 seed 1" in note and "at step 600, crossed at step 1600" in note, note
    runs[0]["curve"] = flat[:2] + [[600, 0, 0.1575]]  # crossed when it got near: no note
    runs[0]["steps"] = 600
    path.write_text(json.dumps({"bench": "largebatch", "target": 0.15, "runs": runs}))
    assert largebatch_points(path)[1] == []


def test_fixed_per_step_cost_with_and_without_cuda_graphs():
    """scaleout-h200: the graphed rows are a line in the batch whose intercept is the host cost;
    eager, the step cannot be shorter than the measured launch-bound step."""
    h200 = get_overhead("scaleout-h200")
    assert 3e-3 < h200.graphed_host_s < 5e-3 and 32e-3 < h200.eager_launch_s < 36e-3
    per_image = (128 / 4299 - 35 / 3180) / (128 - 35)
    for b, _, graphed in H200_RESNET50_ROWS:  # the line reproduces each graphed row within 5 %
        assert h200.graphed_host_s + b * per_image == pytest.approx(b / graphed, rel=0.05)
    model, cluster = get_model("bert-large"), get_cluster("dgx-a100")
    base = TrainSpec(local_batch=2, algorithm="tree")
    bare = step_time(model, base, cluster, 1).step
    graphed = step_time(model, with_overhead(base, h200), cluster, 1)
    eager = step_time(model, with_overhead(replace_graphs(base), h200), cluster, 1)
    assert graphed.step == pytest.approx(bare + h200.graphed_host_s)
    assert eager.step == pytest.approx(max(bare, h200.eager_launch_s))
    assert get_overhead("nvidia-bert").graphed_host_s > 5e-3


def replace_graphs(train: TrainSpec) -> TrainSpec:
    return TrainSpec(**{**train.__dict__, "cuda_graphs": False})
