"""`scaleout bench ttt`: the plan holds the rules equal, unreached targets are "> budget", the
ablation adds up.

The measurement itself (tens of minutes on the emulated cluster) is the bench; here: the run plan,
the report's arithmetic on hand-made rows, the baseline script's arguments, and the whole bench end
to end on its --quick settings (real `scaleout launch` of the torch baseline and of `scaleout
train`, 1 x 2 ranks).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from scaleout.bench import _ttt_report as rep
from scaleout.bench import ttt
from scaleout.bench._ttt_runs import Plan, Recipe, command, read_mlperf


def _plan(**kw) -> Plan:
    return Plan(
        **{
            "config": "bert_tiny_cpu",
            "target": 0.14,
            "budget": 6000,
            "eval_seqs": 600,
            "seqs_per_row": 1.2,
            **kw,
        }
    )


@pytest.mark.unit
def test_plan_gives_every_recipe_the_same_sequences_and_eval_interval() -> None:
    plan = _plan()
    padded = Recipe("b", "torch", "adamw", 60, 1e-3, 0.1)
    packed = Recipe("s", "scaleout", "lamb", 50, 2e-2, 0.1, packing=True, comm="hierarchical")
    assert (
        plan.steps(padded) == 100 and plan.steps(packed) == 100
    )  # 50 rows x 1.2 = 60 sequences per step
    assert plan.eval_every(padded) == plan.eval_every(packed) == 10
    assert plan.warmup_steps(padded) == 10
    torch_cmd = command(plan, padded, 3, __import__("pathlib").Path("o"))
    assert "scaleout.bench._ttt_baseline" in torch_cmd and "--time-budget" not in torch_cmd
    assert (
        torch_cmd[torch_cmd.index("--max-steps") + 1] == "100"
        and torch_cmd[torch_cmd.index("--seed") + 1] == "3"
    )
    sc = command(plan, packed, 3, __import__("pathlib").Path("o"))
    for kv in (
        "data.packing=lpfhp",
        "optim.name=lamb",
        "comm.algorithm=hierarchical",
        "train.max_steps=100",
        "optim.total_steps=100",
        "train.eval_every=10",
        "train.seed=3",
        "optim.sharded=false",
    ):
        assert kv in sc
    assert "data.packing=none" in command(
        plan,
        Recipe("f", "scaleout", "adamw", 60, 1e-3, 0.1, comm="flat"),
        1,
        __import__("pathlib").Path("o"),
    )


def _ttt_args(*argv: str):
    from scaleout.cli import build_parser

    return build_parser().parse_args(["bench", "ttt", *argv])


@pytest.mark.unit
def test_scaleout_recipe_is_the_config_and_command_writes_it_back() -> None:
    """The recipe's settings are config keys (no --batch/--lr/--precision/--bucket-mb flags): the
    Recipe read from the resolved config and the `scaleout train` overrides command() writes for
    it agree, key by key."""
    from scaleout.config import load_config

    args = _ttt_args("optim.lr=1e-2", "comm.bucket_mb=4", "train.precision=fp32", "--warmup", "0.2")
    cfg = ttt.scaleout_config(args)
    r = Recipe.from_config("scaleout", cfg, args.warmup)
    assert (r.optimizer, r.batch, r.lr, r.bucket_mb) == ("lamb", 32, 1e-2, 4.0)
    assert (r.precision, r.compression, r.comm) == ("fp32", "none", "hierarchical")
    sc = command(_plan(), r, 1, __import__("pathlib").Path("o"))
    ran = load_config(sc[2], sc[3:])  # what `scaleout train` would run
    for key in (
        "optim.name",
        "optim.lr",
        "train.global_batch",
        "train.precision",
        "comm.algorithm",
    ):
        section, name = key.split(".")
        assert getattr(getattr(ran, section), name) == getattr(getattr(cfg, section), name), key
    assert (ran.comm.bucket_mb, ran.comm.overlap, ran.comm.compression) == (4.0, True, "none")
    default = ttt.scaleout_config(_ttt_args())  # SCALEOUT_RECIPE over bert_tiny_cpu
    assert (default.train.global_batch, default.train.target, default.comm.bucket_mb) == (
        32,
        0.13,
        1.0,
    )
    rec = ttt.recipes(args, cfg, 4, 1.2, Recipe("baseline", "torch", "adamw", 64, 2e-3, 0.1))
    assert [c.name for c in rec["chain"]] == [
        "abl-framework",
        "abl-packing",
        "abl-comm",
        "scaleout",
    ]
    sharded = rec["scaleout-sharded"]
    assert rec["chain"][2].bucket_mb == 4.0 and sharded.sharded and sharded.shard == "node"
    assert sharded.compression == rec["scaleout"].compression  # the same wire dtype
    # four collectives a bucket where the replicated path makes one: 4x larger buckets
    assert sharded.bucket_mb == 4 * rec["scaleout"].bucket_mb
    # the framework step reads the baseline's DistributedSampler batches; packed rows, scaleout's
    fw, packed = rec["chain"][0], rec["chain"][1]
    assert (fw.order, packed.order, rec["scaleout"].order) == ("torch", "scaleout", "scaleout")
    out = __import__("pathlib").Path("o")
    assert "data.order=torch" in command(_plan(), fw, 1, out)
    # DDP keeps its own default buckets (a 1 MiB first one); another size is passed
    base = Recipe("baseline", "torch", "adamw", 64, 2e-3, 0.1)
    assert "--bucket-mb" not in command(_plan(), base, 1, out)
    four = command(_plan(), Recipe("b", "torch", "adamw", 64, 2e-3, 0.1, bucket_mb=4.0), 1, out)
    assert four[four.index("--bucket-mb") + 1] == "4.0"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("model.bert.layerz=1", "unknown key model.bert.layerz"),
        ("train.max_steps=5", "override train.max_steps: the benchmark sets it for every run"),
        ("train.target=null", "train.target=null"),
    ],
)
def test_bad_override_is_one_line_before_anything_runs(override: str, says: str) -> None:
    from scaleout.errors import UserError

    with pytest.raises(UserError, match=says.replace(".", "[.]")) as e:
        ttt.scaleout_config(_ttt_args(override))
    assert "\n" not in str(e.value)


def _row(
    recipe: str, seed: int, ttt: float | None, steps: int = 10, cluster: str = "netns"
) -> dict:
    return {
        "cluster": cluster,
        "recipe": recipe,
        "seed": seed,
        "ttt_s": ttt,
        "run_s": ttt or 99.0,
        "reached": ttt is not None,
        "steps": steps,
        "samples": steps * 64,
        "steps_budget": 50,
        "status": "success" if ttt else "max_steps",
        "time_budget_s": None,
    }


CHAIN = [
    ("baseline", "torch"),
    ("abl-framework", "f"),
    ("abl-packing", "p"),
    ("abl-comm", "c"),
    ("scaleout", "l"),
]


@pytest.mark.unit
def test_ablation_factors_multiply_to_the_measured_ratio() -> None:
    times = {
        "baseline": [100, 120, 90],
        "abl-framework": [98, 118, 92],
        "abl-packing": [88, 100, 80],
        "abl-comm": [70, 80, 66],
        "scaleout": [40, 50, 45],
    }
    rows = [_row(name, s + 1, t) for name, ts in times.items() for s, t in enumerate(ts)]
    ab = rep.ablation(rows, "netns", CHAIN)
    assert [st["recipe"] for st in ab["steps"]] == [
        "abl-framework",
        "abl-packing",
        "abl-comm",
        "scaleout",
    ]
    assert ab["steps"][0]["factor_per_seed"] == [
        pytest.approx(100 / 98, abs=1e-4),
        pytest.approx(120 / 118, abs=1e-4),
        pytest.approx(90 / 92, abs=1e-4),
    ]
    assert ab["measured_ratio"] == pytest.approx(100 / 45)
    assert ab["ratio_per_seed"] == [2.5, 2.4, 2.0]
    assert ab["product"] == pytest.approx(math.prod(st["factor"] for st in ab["steps"]))
    assert ab["adds_up"] is True  # product of medians within the seeds' spread [2.0, 2.5]
    h, t = rep.ablation_table(ab)
    assert len(t) == 4 and t[-1][-1] == f"{ab['product']:.3f}x"


@pytest.mark.unit
def test_unreached_is_budget_never_a_number() -> None:
    rows = [
        _row("baseline", 1, None),
        _row("baseline", 2, None),
        _row("baseline", 3, 100.0),
        _row("scaleout", 1, 40.0),
        _row("scaleout", 2, 50.0),
        _row("scaleout", 3, None),
    ]
    assert rep.cell(rows[0]) == "> budget (50 steps)"
    cut = {**rows[0], "status": "time_budget", "time_budget_s": 61.2}
    assert rep.cell(cut) == "> budget (61 s, cut)"
    base, sc = rep.summarize(rows, "netns", "baseline"), rep.summarize(rows, "netns", "scaleout")
    assert (
        base["median_ttt_s"] is None and base["reached"] == 1
    )  # 2 of 3 unreached: the median is "> budget"
    assert sc["median_ttt_s"] == 50.0 and sc["median_steps"] == 10 and sc["reached"] == 2
    assert rep.ratio(base["median_ttt_s"], sc["median_ttt_s"]) is None
    assert rep.fmt(None) == "> budget" and rep.fmt(math.inf) == "> budget"
    chain_rows = rows + [_row(n, s, 10.0) for n, _ in CHAIN[1:4] for s in (1, 2, 3)]
    ab = rep.ablation(chain_rows, "netns", CHAIN)
    assert ab["steps"][0]["factor"] is None and ab["product"] is None and ab["adds_up"] is None


@pytest.mark.unit
def test_read_mlperf_takes_the_last_attempt(tmp_path) -> None:
    def line(key, t, value=None, **meta):
        return ":::MLLOG " + json.dumps(
            {"key": key, "time_ms": t, "value": value, "metadata": meta}
        )

    log = tmp_path / "mlperf.log"
    log.write_text(
        "\n".join(
            [
                line("run_start", 1000),
                line("eval_accuracy", 2000, 0.1, samples_count=64),
                line("run_stop", 2500, status="aborted"),
                line("run_start", 10_000),
                line("eval_accuracy", 11_000, 0.12, samples_count=64),
                line("eval_accuracy", 12_500, 0.15, samples_count=128),
                line("run_stop", 12_600, status="success"),
            ]
        )
    )
    got = read_mlperf(log)
    assert got == {
        "ttt_s": 2.6,
        "mlperf_status": "success",
        "curve": [[1.0, 64, 0.12], [2.5, 128, 0.15]],
    }


@pytest.mark.unit
def test_baseline_script_refuses_bad_arguments(capsys) -> None:
    from scaleout.bench import _ttt_baseline as ttt_baseline

    base = [
        "--lr",
        "1e-3",
        "--global-batch",
        "8",
        "--max-steps",
        "10",
        "--eval-every",
        "2",
        "--target",
        "0.1",
        "--out",
        "x",
    ]
    with pytest.raises(SystemExit) as e:
        ttt_baseline.parse_args([*base, "--warmup-steps", "10"])
    assert (
        e.value.code == 2
        and "--warmup-steps 10 must be below --max-steps 10" in capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        ttt_baseline.parse_args([*base, "--warmup-steps", "1", "--lr", "0"])


def _bench(tmp_path, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "ttt.json"
    cmd = [
        sys.executable,
        "-m",
        "scaleout",
        "bench",
        "ttt",
        *ttt.SMOKE_ARGS,
        "--runs-dir",
        str(tmp_path / "runs"),
        "--out",
        str(out),
        "--png",
        str(tmp_path / "ttt.png"),
        *extra,
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(out.read_text()), p.stdout


@pytest.mark.full_system
@pytest.mark.slow
def test_quick_bench_end_to_end(tmp_path) -> None:
    """Real launches (1 node x 2 ranks, a 1-layer model, 256 sequences): the sweep, baseline,
    scaleout, sharded and the ablation chain. At SMOKE_ARGS' target 0.01 the LAMB runs reach it
    (~0.02 at the budget) and the AdamW ones cannot (~0.003): both a time-to-train and a ">
    budget" go through the tables."""
    res, stdout = _bench(tmp_path)
    names = [r["recipe"] for r in res["runs"]]
    assert names[0].startswith("baseline-b") and names.count("baseline") == 1
    assert {
        "scaleout",
        "scaleout-sharded",
        "abl-framework",
        "abl-packing",
        "abl-comm",
        "abl-lamb",
    } <= set(names)
    for r in res["runs"]:
        assert r["reached"] == (r["ttt_s"] is not None) == (r["mlperf_status"] == "success")
        assert r["curve"] and r["run_s"] >= r["curve"][-1][0] >= 0
        assert (r["curve"][-1][2] >= 0.01) == r[
            "reached"
        ]  # a run stops at its first eval at the target
        assert r["reached"] == (r["optimizer"] == "lamb"), (r["recipe"], r["curve"][-1])
    local = res["results"]["local"]
    assert set(local["summary"]) == {"baseline", "scaleout", "scaleout-sharded"}
    assert (
        local["summary"]["baseline"]["median_ttt_s"] is None
        and local["summary"]["scaleout"]["median_ttt_s"] > 0
    )
    assert (
        local["summary"]["scaleout"]["ratio_vs_baseline"] is None
        and local["bar"]["passes"] is False
    )
    steps = local["ablation"]["steps"]
    assert [s["recipe"] for s in steps] == [
        "abl-framework",
        "abl-packing",
        "abl-comm",
        "abl-lamb",
        "scaleout",
    ]
    assert (
        steps[3]["factor"] is None and steps[4]["factor"] > 0
    )  # from "> budget" to a time: no factor
    precision = {r["recipe"]: r["precision"] for r in res["runs"]}
    assert (
        precision["abl-lamb"] == "fp32"
        and precision["scaleout"] == precision["scaleout-sharded"] == "bf16"
    )
    ran = {
        r["recipe"]: _numerics(r["dir"]) for r in res["runs"]
    }  # what the trainer says it ran, not the recipe
    assert ran["scaleout"] == {"linear": "bfloat16", "attn": "bfloat16", "comm": "bfloat16"}
    assert ran["abl-lamb"] == {"linear": "fp32", "attn": "fp32", "comm": "fp32"}
    assert ran["scaleout-sharded"] == ran["scaleout"]  # within the node: bf16 on the wire too
    # model.bert.attention=auto: bf16 on the CPU measures both kernels and runs the faster one,
    # fp32 keeps SDPA without a measurement (report.json, task.attention)
    attention = {
        r["recipe"]: json.loads((Path(r["dir"]) / "report.json").read_text())["task"]["attention"]
        for r in res["runs"]
        if r["recipe"] in ("scaleout", "abl-lamb")
    }
    times = attention["scaleout"]["probe_ms"]
    assert attention["scaleout"]["kernel"] == min(times, key=times.get)
    assert attention["abl-lamb"]["kernel"] == "sdpa" and attention["abl-lamb"]["probe_ms"] is None
    table = stdout[stdout.index("time-to-train to masked-LM accuracy 0.01") :]
    assert (
        "> budget (" in table.splitlines()[3] and "ablation on local" in stdout
    )  # the baseline row
    assert res["bench"] == "ttt" and res["machine"]["cpus"] >= 1 and "|---" in stdout
    assert (tmp_path / "ttt.png").stat().st_size > 0  # matplotlib is in the test extra


def _numerics(run_dir: str) -> dict[str, str]:
    """lowest_numerical_precision_in_{linear,attn,comm} from a run's MLPerf log."""
    out = {}
    for line in (__import__("pathlib").Path(run_dir) / "mlperf.log").read_text().splitlines():
        if ":::MLLOG" in line:
            rec = json.loads(line.split(":::MLLOG", 1)[1])
            if rec["key"].startswith("lowest_numerical_precision_in_"):
                out[rec["key"].rsplit("_", 1)[1]] = rec["value"]
    return out
