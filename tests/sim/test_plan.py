"""scaleout plan (scaleout/sim/plan.py, scaleout/cli/plan.py): the Pareto front of predicted
time-to-train against GPU-hours, its knee, restricted grids, the overrides and sbatch line of the
chosen point (read back through the config loader), the GPU-hours arithmetic, bad input."""

from __future__ import annotations

import contextlib
import io
import json
import math
import shlex
from pathlib import Path

import pytest

from scaleout.bench import plan as bench_plan
from scaleout.cli import build_parser
from scaleout.config.load import load_config
from scaleout.errors import ConfigError, UserError
from scaleout.families import FAMILIES, Family, register, unregister
from scaleout.sim import plan as P
from scaleout.sim.cluster import PARAMS

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
LARGE = str(ROOT / "configs" / "bert_large_256x8.yaml")
TINY = str(ROOT / "configs" / "bert_tiny_cpu.yaml")


@pytest.fixture(scope="module")
def large() -> P.Workload:
    # fp32 wire: the sharded LAMB's bf16 all-to-all path prices flat and hierarchical the same,
    # and those ties would put two equal points on the front
    return P.workload(LARGE, ["comm.compression=none"])


@pytest.fixture(scope="module")
def a100_plan(large: P.Workload) -> P.Plan:
    cluster = P.load_cluster("dgx-a100")
    grid = P.default_grid(
        cluster, 8, nodes=[1, 4, 16, 64], batches=[4, 8], algorithms=["flat", "hierarchical"]
    )
    return P.plan(large, cluster, P.curve_of_family("bert", None), grid)


def test_front_is_non_dominated_complete_and_holds_the_knee(a100_plan: P.Plan) -> None:
    pts, front = a100_plan.points, a100_plan.front
    assert len(pts) == 4 * 2 * 2 * 3 * 2  # nodes x batches x algorithms x placements x SHARP
    assert 2 <= len(front) < len(pts)

    def dominates(a: P.Point, b: P.Point) -> bool:
        return (
            a.ttt_s <= b.ttt_s
            and a.gpu_hours <= b.gpu_hours
            and (a.ttt_s < b.ttt_s or a.gpu_hours < b.gpu_hours)
        )

    for f in front:
        assert not any(dominates(p, f) for p in pts), f.candidate.label()
    for p in pts:  # every point off the front is dominated or ties a front point
        if not p.front:
            assert any(
                dominates(f, p) or (f.ttt_s, f.gpu_hours) == (p.ttt_s, p.gpu_hours) for f in front
            ), p.candidate.label()
    assert a100_plan.knee in front and a100_plan.knee.knee
    assert sum(p.knee for p in pts) == 1
    # the knee minimises the scaled sum; the front's ends are never the knee of a >2-point front
    if len(front) > 2:
        ends = {id(min(front, key=lambda p: p.ttt_s)), id(min(front, key=lambda p: p.gpu_hours))}
        assert id(a100_plan.knee) not in ends


def test_knee_of_a_known_front() -> None:
    def pt(ttt: float, gpus: int) -> P.Point:
        c = P.Candidate(gpus, 1, 1, "flat", "replicated", False)
        return P.Point(c, 1.0, 1.0, 1.0, 1, 0, 0.0, ttt, False, [])

    # 30 h x 1 GPU, 10 h x 4 GPUs (the elbow), 9 h x 64 GPUs; 200 h x 4 GPUs is dominated
    pts = [pt(30 * 3600, 1), pt(10 * 3600, 4), pt(9 * 3600, 64), pt(200 * 3600, 4)]
    front = P.front_of(pts)
    assert [p.candidate.nodes for p in front] == [64, 4, 1]
    assert P.knee_of(front).candidate.nodes == 4
    assert P.choose(pts, "fastest").candidate.nodes == 64
    assert P.choose(pts, "cheapest").candidate.nodes == 1


def test_gpu_hours_and_time_to_train_arithmetic(a100_plan: P.Plan) -> None:
    for p in a100_plan.points[:12]:
        c = p.candidate
        # the allocation pays for the untimed start too
        assert p.gpu_hours == pytest.approx((p.start_s + p.ttt_s) * c.gpus / 3600)
        assert p.start_s > 0 and p.wall_s == pytest.approx(p.start_s + p.ttt_s)
        every = p.schedule.eval_every  # MLPerf's BERT rule at this batch, in steps
        assert p.steps % every == 0 and p.evals == p.steps // every
        assert p.steps - every < math.ceil(p.samples / c.global_batch - 1e-9) <= p.steps
        assert p.ttt_s == pytest.approx(p.steps * p.step_s + p.eval_s)
        assert p.throughput == pytest.approx(c.global_batch / p.step_s)
    assert P.gpu_hours(3600.0, 8) == 8.0


def test_overrides_and_sbatch_line_are_valid_config_overrides(a100_plan: P.Plan) -> None:
    for pick in P.PICKS:
        chosen = P.choose(a100_plan.points, pick)
        assert chosen.overrides is not None
        c = chosen.candidate
        cfg = load_config(LARGE, chosen.overrides)
        assert (cfg.launch.nnodes, cfg.launch.nproc_per_node) == (c.nodes, c.gpus_per_node)
        assert cfg.train.global_batch == c.global_batch
        assert cfg.comm.algorithm == c.algorithm
        assert cfg.optim.sharded == (c.optimizer != "replicated")
        if cfg.optim.sharded:  # the placement the simulator priced is the one the keys set
            assert cfg.optim.shard == ("node" if c.optimizer == "sharded-node" else "world")
        line = shlex.split(P.sbatch_line("bert", c, chosen.overrides))
        i = line.index("sbatch")
        assert line[i + 1] == "-J" and line[i + 3 : i + 5] == ["-N", str(c.nodes)]
        script = next(a for a in line if a.startswith("slurm/"))
        assert (ROOT / script).is_file()
        back = line[line.index(script) + 1 :]
        assert back == chosen.overrides
        load_config(LARGE, back)  # parses back
        assert ("--network=sharp" in line) == c.sharp


def test_restricted_grid_on_a_calibration_with_a_fit(tmp_path: Path) -> None:
    calib = tmp_path / "calib.json"
    calib.write_text(json.dumps({"action": "calibrate", "constants": [1e-4] * 3 + [1e-9] * 4}))
    fit = tmp_path / "lb.json"
    runs = [
        {"optimizer": "lamb", "batch": b, "steps": s, "seed": 1, "max_steps": 9999}
        for b, s in ((8, 900), (64, 150))
    ]
    fit.write_text(json.dumps({"bench": "largebatch", "runs": runs}))
    cluster = P.load_cluster(str(calib))
    assert cluster.constants.vector() == [1e-4] * 3 + [1e-9] * 4
    work = P.workload(TINY)
    grid = P.default_grid(
        cluster,
        16,
        nodes=[1, 2],
        gpus_per_node=[2],
        batches=[8, 16],
        algorithms=["flat"],
        optimizers=["replicated"],
    )
    res = P.plan(
        work, cluster, P.curve_of_family("bert", str(fit)), grid, "fastest", {8: 40.0, 16: 60.0}, 2
    )
    got = sorted((p.candidate.nodes, p.candidate.per_gpu_batch) for p in res.points)
    assert got == [(1, 8), (1, 16), (2, 8), (2, 16)]
    assert {p.candidate.gpus_per_node for p in res.points} == {2}
    assert not any(p.candidate.sharp for p in res.points)  # netns has no SHARP
    # 2 x 2 ranks on 2 cores: half the per-rank rate
    one = next(p for p in res.points if p.candidate.nodes == 1 and p.candidate.per_gpu_batch == 8)
    two = next(p for p in res.points if p.candidate.nodes == 2 and p.candidate.per_gpu_batch == 8)
    assert two.step_s > 1.9 * (8 / 40.0) and one.step_s == pytest.approx(8 / 40.0, rel=0.5)
    load_config(TINY, res.chosen.overrides)


def _err(fn, *a) -> str:
    with pytest.raises(ConfigError) as e:
        fn(*a)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_bad_input_is_one_line_naming_the_value(tmp_path: Path) -> None:
    assert "dgx-z9" in _err(P.load_cluster, "dgx-z9") and "dgx-a100" in _err(
        P.load_cluster, "dgx-z9"
    )
    bad = tmp_path / "c.json"
    bad.write_text("{nope")
    assert "c.json" in _err(P.load_cluster, str(bad))
    bad.write_text(json.dumps({"constants": [1, 2]}))
    assert f"{len(PARAMS)} numbers" in _err(P.load_cluster, str(bad))
    assert "missing.json" in _err(P.load_cluster, str(tmp_path / "missing.json"))
    for text in ("8,x", "0", "-2", "", "1.5"):
        assert "positive integers" in _err(P.positive_ints, text, "--per-gpu-batch")
    assert "'8:0'" in _err(P.compute_rates, "8:0")
    assert "--fit" in _err(P.curve_of_family, "bert", str(tmp_path / "none.json"))


def test_a_family_without_rcps_needs_a_fit() -> None:
    class NoCurve(Family):
        name = "nocurve_plan"

    register(NoCurve())
    try:
        msg = _err(P.curve_of_family, "nocurve_plan", None)
        assert "model.arch=nocurve_plan" in msg and "--fit" in msg
    finally:
        unregister("nocurve_plan")
    assert "nocurve_plan" not in FAMILIES


def test_cli_help_explains_and_the_command_runs(tmp_path: Path) -> None:
    parser = build_parser()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parser.parse_args(["plan", "--help"])
    text = out.getvalue()
    for word in ("Pareto", "knee", "GPU-hours", "--fit", "--per-gpu-batch", "sbatch", "SHARP"):
        assert word in text, word
    args = parser.parse_args(
        ["plan", LARGE, "--preset", "dgx-a100", "--nnodes", "1,8", "--per-gpu-batch", "8"]
        + ["--algorithms", "flat", "--out", str(tmp_path / "p.json")]
    )
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert args._run(args) == 0
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["chosen"]["sbatch"].startswith(("sbatch -J", "NCCL_COLLNET_ENABLE=1 sbatch -J"))
    assert len(data["points"]) == 2 * 3 * 2 and "chosen (knee)" in printed.getvalue()


def test_bench_plan_smoke_args_parse_and_bad_batches_fail_first() -> None:
    """`scaleout bench plan` end to end needs root, the netns cluster and minutes of CPU (run by
    hand with --quick); here its command line, and bad input refused before any run."""
    parser = build_parser()
    args = parser.parse_args(["bench", "plan", *bench_plan.SMOKE_ARGS])
    assert args.quick and args.per_rank_batch == [4, 8]
    args = parser.parse_args(["bench", "plan", "--per-rank-batch", "8"])
    with pytest.raises(UserError, match=r"--per-rank-batch \[8\]: expected two"):
        args._run(args)


def test_bench_plan_target_is_off_the_plateau_and_the_users_wins() -> None:
    """The tiny BERT's check targets 0.13 (its config's 0.15 sits on a plateau: the crossing step is
    noise), --quick its own, another config its own; a train.target override wins."""
    from scaleout.config import load_config

    parser = build_parser()

    def target(*argv: str) -> float | None:
        args = parser.parse_args(["bench", "plan", *argv])
        overrides = bench_plan.with_target(args)
        return load_config(args.config, overrides).train.target

    assert target() == 0.13 and target("--quick") == bench_plan.QUICK_TARGET
    assert target("train.target=0.14") == 0.14 and target("--quick", "train.target=0.1") == 0.1
    assert target("--config", "resnet_cpu") == load_config("resnet_cpu").train.target


def test_sbatch_note_names_the_scripts_config_when_another_is_planned() -> None:
    assert P.sbatch_note("bert", LARGE) is None
    assert "configs/bert_large_256x8.yaml" in P.sbatch_note("bert", TINY)


def test_bench_plan_rate_is_rows_over_the_mean_step_after_warm_up(tmp_path: Path) -> None:
    m = tmp_path / "metrics.jsonl"
    recs = [{"type": "run"}] + [
        {"type": "train", "step": i, "step_s": s}
        for i, s in enumerate([9.0, 5.0, 0.2, 0.1, 0.3], 1)
    ]
    m.write_text("\n".join(json.dumps(r) for r in recs))
    assert bench_plan.step_time(m) == pytest.approx(0.2)  # steps 1-2 (warm-up) left out


def test_bench_plan_rate_copies_run_together_and_a_failure_names_its_log(tmp_path: Path) -> None:
    """The rate is measured with one single-process run per core at once (their contention is
    the checked shapes'): every copy runs, and one that fails stops the bench naming its log."""
    logs = [tmp_path / "ok.log", tmp_path / "bad.log"]
    with pytest.raises(SystemExit, match="bad.log"):
        bench_plan._scaleout_together([["--help"], ["train", "no-such-config"]], {}, logs)
    assert "usage" in logs[0].read_text() and "no-such-config" in logs[1].read_text()
