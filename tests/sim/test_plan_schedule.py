"""A plan you can run (scaleout/sim/schedule.py, scaleout/sim/startup.py, scaleout plan): every
pick's printed overrides carry the schedule at its batch (steps, warm-up, evaluation cadence,
learning rate by the RCP rules), the step cap covers the predicted steps, the command for more
than one node is an sbatch line, config names resolve as `scaleout train`'s do, MLPerf's batch
ceiling is respected and the untimed start is counted."""

from __future__ import annotations

import contextlib
import io
import json
import math
import shlex
from pathlib import Path

import pytest

from scaleout.cli import build_parser
from scaleout.config.load import load_config
from scaleout.errors import ConfigError
from scaleout.sim import plan as P
from scaleout.sim.schedule import rcp_references

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
LARGE = str(ROOT / "configs" / "bert_large_256x8.yaml")


def _plan(argv: list[str], tmp_path: Path) -> tuple[dict, str]:
    parser = build_parser()
    out = tmp_path / "plan.json"
    args = parser.parse_args(["plan", *argv, "--out", str(out)])
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert args._run(args) == 0
    return json.loads(out.read_text()), printed.getvalue()


def test_cheapest_pick_on_bert_large_prints_a_schedule_that_reaches_its_prediction(
    tmp_path: Path,
) -> None:
    """The issue's case: `plan --pick cheapest` printed train.global_batch=64 with 43,648
    predicted steps and left train.max_steps=560: the job stopped far from the target."""
    data, text = _plan(
        ["bert_large_256x8", "--preset", "dgx-h100", "--max-nodes", "64", "--pick", "cheapest"],
        tmp_path,
    )
    ch = data["chosen"]
    cfg = load_config(LARGE, ch["overrides"])
    steps, every = ch["steps"], cfg.train.eval_every
    assert cfg.train.global_batch == ch["global_batch"]
    assert cfg.train.max_steps >= steps and cfg.optim.total_steps == cfg.train.max_steps
    # the run evaluates at the predicted step, from the start: it stops there at the target
    assert cfg.train.eval_start_step == 0 and steps % every == 0
    # the samples to the target fit in the predicted steps (packed rows x 2 = MLPerf samples)
    assert steps * ch["global_batch"] * 2 >= ch["samples"] * 2 - 1e-6
    assert steps - every < math.ceil(ch["samples"] / ch["global_batch"])
    # warm-up and learning rate come from the RCP nearest the batch, scaled by sqrt(B / B_ref)
    sched = ch["schedule"]
    ref = sched["reference"]
    b = ch["global_batch"] * 2
    assert cfg.optim.lr == pytest.approx(ref["lr"] * math.sqrt(b / ref["batch"]), rel=1e-5)
    assert cfg.optim.warmup_steps == ref["warmup_steps"] < cfg.train.max_steps
    assert f"schedule: {steps} steps predicted" in text


def test_at_an_rcp_batch_the_schedule_is_the_rcps_hyper_parameters() -> None:
    work = P.for_curve(P.workload(LARGE), P.curve_of_family("bert", None))
    cand = P.Candidate(256, 8, 2, "hierarchical", "sharded-node", True)  # 4096 rows = 8192 seqs
    sched = P.schedule_of(work, P.curve_of_family("bert", None), cand)
    ref = next(r for r in rcp_references("bert") if r.batch == 8192)
    assert sched.lr == pytest.approx(ref.lr) == pytest.approx(0.00288293)
    assert (sched.warmup_steps, sched.start_warmup_step) == (287, -76)
    assert sched.total_steps == 600 and sched.betas == (0.88, 0.88)
    # MLPerf's BERT rule at 8192: 225,000 samples between evaluations -> every 27 steps
    assert sched.eval_every == 27 and sched.predicted_steps % 27 == 0


def test_more_than_one_node_prints_sbatch_and_no_local_launch(tmp_path: Path) -> None:
    data, text = _plan(
        [LARGE, "--preset", "dgx-a100", "--nnodes", "4", "--per-gpu-batch", "2"]
        + ["--algorithms", "hierarchical"],
        tmp_path,
    )
    ch = data["chosen"]
    assert ch["nodes"] == 4 and "launch" not in ch and "scaleout launch" not in text
    line = shlex.split(ch["sbatch"])
    i = line.index("sbatch")
    assert line[i + 1 : i + 5] == ["-J", "plan-4x8-b2", "-N", "4"]
    assert "note" not in ch  # the script trains this very config: no "point it at" note
    # one node: the local launcher is a valid way to run it
    data, _ = _plan(
        ["bert_large_256x8", "--preset", "dgx-a100", "--nnodes", "1", "--per-gpu-batch", "2"],
        tmp_path,
    )
    assert data["chosen"]["launch"].startswith("scaleout launch --nnodes 1 --nproc-per-node 8 ")
    assert " scaleout train bert_large_256x8 " in data["chosen"]["launch"]


def test_plan_takes_a_packaged_config_name_as_train_does(tmp_path: Path) -> None:
    data, text = _plan(
        ["bert_tiny_cpu", "--preset", "dgx-a100", "--nnodes", "1", "--per-gpu-batch", "8"],
        tmp_path,
    )
    assert data["config"] == "bert_tiny_cpu" and text.startswith("bert_tiny_cpu on dgx-a100")
    with pytest.raises(ConfigError) as e:
        _plan(["no_such_config", "--preset", "dgx-a100"], tmp_path)
    assert "no_such_config" in str(e.value) and "bert_large_256x8" in str(e.value)


def test_batches_above_the_largest_rcp_are_priced_never_chosen() -> None:
    work = P.workload(LARGE)
    cluster = P.load_cluster("dgx-a100")
    curve = P.curve_of_family("bert", None)
    grid = P.default_grid(
        cluster,
        2,
        nodes=[256, 512],
        batches=[2, 8],
        algorithms=["hierarchical"],
        optimizers=["sharded-node"],
        sharp=[True],
    )
    res = P.plan(work, cluster, curve, grid, "fastest")
    over = [p for p in res.points if p.candidate.global_batch * 2 > 16384]
    assert over and all(p.refused and "16384" in p.refused for p in over)
    assert res.chosen.refused is None and res.chosen.candidate.global_batch * 2 <= 16384
    only_over = P.default_grid(
        cluster, 8, nodes=[512], batches=[8], algorithms=["flat"], optimizers=["replicated"]
    )
    with pytest.raises(ConfigError) as e:
        P.plan(work, cluster, curve, only_over)
    assert "Missing RCP" in str(e.value) and "\n" not in str(e.value)


def test_untimed_start_is_counted_and_dominates_at_record_scale() -> None:
    """NVIDIA's BERT record (3,472 H100): init_start -> run_start 94 s against 7.1 s timed, 13x;
    the ResNet record 17x. The plan's record-scale point: the same order, and its timed part
    within 2x of the record's 7.1 s. (Known gap: since the sharded LAMB's step is priced as the
    trainer now runs it, captured with its reduce-scatters overlapped, as NVIDIA's record ran it,
    the model is about 1.8x optimistic at this scale; it was inside 1.5x while that step was
    priced eager and launch-bound, which hid it.)"""
    work = P.workload(LARGE)
    cluster = P.load_cluster("dgx-h100")
    grid = P.default_grid(
        cluster,
        2,
        nodes=[1, 434],
        batches=[2],
        algorithms=["hierarchical"],
        optimizers=["sharded-node"],
        sharp=[True],
    )
    res = P.plan(work, cluster, P.curve_of_family("bert", None), grid)
    one, record = sorted(res.points, key=lambda p: p.candidate.nodes)
    assert record.start_s / record.ttt_s >= 10
    assert 7.1 / 2 <= record.ttt_s <= 7.1 * 2, record.ttt_s
    assert record.start_s == pytest.approx(94.0, rel=0.01)
    assert one.start_s < record.start_s and one.start_s / one.ttt_s < 0.1
    assert record.gpu_hours == pytest.approx(record.wall_s * 3472 / 3600)


def test_a_lars_config_is_planned_replicated_with_a_linearly_scaled_lr(tmp_path: Path) -> None:
    """ResNet-50 (LARS has no sharded form): `plan` refused it outright before."""
    data, _ = _plan(
        ["resnet50_128x8", "--preset", "dgx-a100", "--nnodes", "4,16"]
        + ["--algorithms", "hierarchical"],
        tmp_path,
    )
    assert {p["optimizer"] for p in data["points"]} == {"replicated"}
    ch = data["chosen"]
    cfg = load_config("resnet50_128x8", ch["overrides"])
    assert cfg.optim.lr == pytest.approx(21.9 * ch["global_batch"] / 35840, rel=1e-4)
    assert cfg.train.max_steps >= ch["steps"] and ch["steps"] % cfg.train.eval_every == 0
    assert ch["global_batch"] <= 67840  # rcps_resnet's largest batch
