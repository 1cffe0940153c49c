"""`scaleout bench ttt --task llama`: the recipes and commands of both sides, the direction of the
metric (log-perplexity: lower is better), and the bench end to end on its --quick settings (real
`scaleout launch` of the torch baseline and of `scaleout train`, 1 x 2 ranks)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scaleout.bench import _ttt_report as rep
from scaleout.bench import ttt
from scaleout.bench._ttt_runs import Plan, Recipe, command


def _args(*argv: str):
    from scaleout.cli import build_parser

    return build_parser().parse_args(["bench", "ttt", "--task", "llama", *argv])


def _ran(cmd: list[str]):
    """The config `scaleout train` resolves from one of the bench's commands."""
    from scaleout.config import load_config

    return load_config(cmd[2], cmd[3:])


@pytest.mark.unit
def test_llama_recipes_and_the_commands_both_sides_run() -> None:
    from scaleout.bench._ttt_baseline_llama import parse_args

    args = _args("--seeds", "1")
    cfg = ttt.scaleout_config(args)
    assert (args.config, args.budget, args.eval_seqs) == ("llama_tiny_cpu", 12800, 800)
    assert (args.baseline_lrs, args.baseline_batches) == ([1e-3, 2e-3, 4e-3], [32])
    assert args.warmup == 40 / 400  # the config's warm-up share (its optim.warmup_steps)
    assert (cfg.optim.name, cfg.train.target, cfg.model.family.metric_goal) == ("adamw", 5.5, "min")
    best = Recipe("baseline", "torch", "adamw", 32, 4e-3, 0.1, precision="bf16")
    rec = ttt.recipes(args, cfg, 4, 1.0, best)
    assert [r.name for r in rec["chain"]] == [
        "abl-framework",
        "abl-docmask",
        "abl-comm",
        "scaleout",
    ]
    plan = Plan("llama_tiny_cpu", 5.5, 12800, 800, 1.0, "none", task="llama", end_lr_ratio=0.1)
    # the baseline: its own module, bf16 autocast, the same rules
    torch_cmd = command(plan, best, 2, Path("o"))
    assert "scaleout.bench._ttt_baseline_llama" in torch_cmd
    a = parse_args(torch_cmd[torch_cmd.index("--config") :])
    assert (a.global_batch, a.max_steps, a.eval_every, a.precision) == (32, 400, 25, "bf16")
    # every step of the chain switches on one thing over the one before
    fw, dm, comm = (_ran(command(plan, r, 2, Path("o"))) for r in rec["chain"][:3])
    assert (fw.model.llama.document_mask, fw.data.order, fw.comm.algorithm) == (
        False,
        "torch",
        "flat",
    )
    assert (fw.optim.lr, fw.train.global_batch, fw.train.precision) == (4e-3, 32, "bf16")
    assert fw.comm.compression == "none" and fw.optim.schedule == "cosine"
    assert fw.optim.end_lr == pytest.approx(4e-4)  # the config's floor, a tenth of the peak
    assert (dm.model.llama.document_mask, dm.data.order, dm.comm.algorithm) == (
        True,
        "torch",
        "flat",
    )
    assert (comm.comm.algorithm, comm.comm.compression, comm.comm.bucket_mb) == (
        "hierarchical",
        "bf16",
        1.0,
    )
    full = _ran(command(plan, rec["scaleout"], 2, Path("o")))
    assert (full.optim.lr, full.data.order, full.optim.end_lr) == (2e-3, "scaleout", 2e-4)
    assert full.model.llama.document_mask and full.optim.clip_grad_norm == 1.0
    sharded = _ran(command(plan, rec["scaleout-sharded"], 2, Path("o")))
    assert (sharded.optim.sharded, sharded.optim.shard, sharded.comm.bucket_mb) == (
        True,
        "node",
        4.0,
    )
    from scaleout.errors import UserError

    with pytest.raises(UserError, match="does not fit --task llama"):
        ttt.scaleout_config(_args("--config", "bert_tiny_cpu"))


@pytest.mark.unit
def test_the_sweep_keeps_the_lower_log_perplexity_when_nothing_reached() -> None:
    """Neither candidate reached the target: the better one is the lower log-perplexity (and the
    higher accuracy for BERT): the direction is the family's."""

    def row(achieved: float | None) -> dict:
        return {"reached": False, "ttt_s": None, "achieved": achieved}

    assert ttt._better(row(6.1), row(6.4), lower=True)
    assert not ttt._better(row(6.4), row(6.1), lower=True)
    assert ttt._better(row(6.1), row(None), lower=True)
    assert ttt._better(row(0.12), row(0.10)) and not ttt._better(row(0.10), row(0.12))
    hit = {"reached": True, "ttt_s": 50.0, "achieved": 5.4}
    assert ttt._better(hit, row(5.0), lower=True)  # a time beats any unreached metric


@pytest.mark.unit
def test_fp32_reaches_the_baseline_and_an_emulated_bf16_is_said(monkeypatch) -> None:
    """train.precision=fp32 makes both sides fp32 (the baseline's --precision too); bf16 on a CPU
    without native bf16 instructions earns one warning line with the slowdown measured here."""
    from scaleout.bench import precision as prec
    from scaleout.bench._ttt_baseline_llama import parse_args
    from scaleout.bench._ttt_llama import baseline_recipe

    plan = Plan("llama_tiny_cpu", 5.5, 12800, 800, 1.0, "none", task="llama", end_lr_ratio=0.1)
    for over, want in (([], "bf16"), (["train.precision=fp32"], "fp32")):
        cfg = ttt.scaleout_config(_args("--seeds", "1", *over))
        assert ttt.baseline_precision(cfg) == want
        cmd = command(plan, baseline_recipe("b", 32, 1e-3, 0.05, want), 2, Path("o"))
        assert parse_args(cmd[cmd.index("--config") :]).precision == want
    cpu = {"model": "AVX2 box", "torch_cpu_capability": "AVX2"}
    monkeypatch.setattr(prec, "cpu_support", lambda: {**cpu, "flags": ["avx512f"]})
    line = prec.bf16_warning({"fp32", "bf16"})
    assert line and line.startswith("warning: this CPU (AVX2 box) has no native bf16"), line
    assert re.search(r"a matmul \d+\.\dx slower than in fp32 here", line), line
    assert prec.bf16_warning({"fp32"}) is None
    monkeypatch.setattr(prec, "cpu_support", lambda: {**cpu, "flags": ["amx_bf16"]})
    assert prec.bf16_warning({"bf16"}) is None
    assert prec.bf16_slowdown(rows=64, repeats=3) > 0


def _bench(tmp_path: Path, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "ttt.json"
    cmd = [sys.executable, "-m", "scaleout", "bench", "ttt", *SMOKE, "--out", str(out)]
    cmd += ["--runs-dir", str(tmp_path / "runs"), "--png", str(tmp_path / "ttt.png"), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(out.read_text()), p.stdout


# A 1-layer 32-wide Llama, 256 rows, from ln(4096) = 8.32 (measured): the scaleout recipe (lr 2e-3,
# 16 rows a step) is at 8.17 after 128 rows, 8.04 at its end; the baseline's first grid point (lr
# 1e-3 at 32 rows) ends at 8.29. A direction mix-up reads 8.3 as "reached" at the first evaluation.
SMOKE = ["--task", "llama", "--quick", "--no-ablation", "train.target=8.2"]


@pytest.mark.full_system
@pytest.mark.extended  # ~3 min on 2 cores: python3 -m pytest -m extended (docs/testing.md)
def test_quick_llama_bench_end_to_end(tmp_path: Path) -> None:
    res, stdout = _bench(tmp_path)
    assert (res["task"], res["metric"], res["goal"]) == ("llama", "log-perplexity", "min")
    runs = {r["recipe"]: r for r in res["runs"] if not r.get("sweep")}
    assert set(runs) == {"baseline", "scaleout", "scaleout-sharded"}
    for r in res["runs"]:
        assert r["reached"] == (r["ttt_s"] is not None) == (r["mlperf_status"] == "success")
        # the first evaluation at or below the target stops a run: lower is better
        assert r["curve"] and (r["curve"][-1][2] <= 8.2) == r["reached"], r["curve"]
        assert all(c[2] > 8.2 for c in r["curve"][:-1])
    assert not runs["baseline"]["reached"] and runs["scaleout"]["reached"]
    base = json.loads((Path(runs["baseline"]["dir"]) / "report.json").read_text())
    assert (base["optimizer"], base["fused"], base["precision"]) == ("AdamW", True, "bf16")
    assert base["document_mask"] is False and base["clip_grad_norm"] == 1.0
    table = stdout[stdout.index("time-to-train to log-perplexity 8.2") :]
    baseline_row = next(line for line in table.splitlines() if "| baseline " in line)
    assert "> budget (" in baseline_row and "rows, concatenated" in baseline_row
    assert "rows, documents masked" in table and "bar (>= 1x" in stdout
    assert (tmp_path / "ttt.png").stat().st_size > 0


@pytest.mark.unit
def test_the_report_names_the_llama_chain() -> None:
    """The ablation's rows and first step for --task llama, from hand-made rows."""

    def row(recipe: str, seed: int, t: float, label: str = "", packing: bool = True) -> dict:
        return {
            "cluster": "local",
            "recipe": recipe,
            "seed": seed,
            "ttt_s": t,
            "run_s": t,
            "reached": True,
            "steps": 10,
            "samples": 320,
            "steps_budget": 40,
            "status": "success",
            "time_budget_s": None,
            "optimizer": "adamw",
            "packing": packing,
            "batch": 32,
            "lr": 2e-3,
            "comm": "flat",
            "label": label,
        }

    times = {"baseline": 100, "abl-framework": 98, "abl-docmask": 80, "abl-comm": 70}
    times |= {"scaleout": 60, "scaleout-sharded": 62}
    rows = [row(n, 1, t, n, n not in ("baseline", "abl-framework")) for n, t in times.items()]

    class Shape:
        name, nnodes, nproc_per_node, rate = "local", 1, 2, None

    best = {"local": (rows[0], Recipe("baseline-b32-lr0.002", "torch", "adamw", 32, 2e-3, 0.1))}
    results, table = rep._results([Shape()], best, rows, "llama")
    ab = results["local"]["ablation"]
    assert [s["recipe"] for s in ab["steps"]] == [
        "abl-framework",
        "abl-docmask",
        "abl-comm",
        "scaleout",
    ]
    assert ab["product"] == pytest.approx(100 / 60) and ab["adds_up"] is True
    assert [t[3] for t in table] == [
        "rows, concatenated",
        "rows, documents masked",
        "rows, documents masked",
    ]
    assert results["local"]["bar"]["passes"] is True  # 1.67x >= 1.0x, every seed
    h, t = rep.ablation_table(ab)
    assert t[1][1] == "abl-docmask" and t[-1][-1] == f"{100 / 60:.3f}x"
