"""scaleout bench largebatch: why LAMB exists — steps to a target at the base batch vs 8x the batch.

Single-process trainings of the same config to the same masked-LM accuracy target, in one run: LAMB
at the base batch, LAMB at ``factor`` x the batch, and AdamW at ``factor`` x the batch for each of a
few learning rates (the best one is compared, so AdamW is not judged on one unlucky rate). Every run
sees the same data stream (data order is a function of the sample position) and the same eval set.

One recipe rule, applied to both optimizers, is the LAMB paper's BERT rule (You et al. 2019, arXiv
1904.00962, sec. 4 and the appendix's batch-size table):

* learning rate x sqrt(factor) (square-root scaling);
* linear-epoch warm-up (LEGW, You et al. 2019, arXiv 1901.08256): the warm-up *fraction* of the run
  grows with the batch while the epochs stay fixed, i.e. the same number of warm-up *steps* at every
  batch;
* the same sample budget (base steps / factor at the large batch), linear decay to 0 at its end.

Evaluation happens at the same sample interval in every run (every ``eval_every`` large-batch steps,
every ``factor x eval_every`` base steps), so step counts are equally quantised. A run that never
reaches the target is reported as "> budget", not as a number. Perfect scaling would need 1/factor
of the base steps; the bar for LAMB is <= 1/5, and AdamW at the same batch should need more.

The ``--out`` JSON is a samples-to-converge curve for the simulator: ``scaleout simulate
convergence FILE`` fits samples(B) = E_min (1 + B / B_crit) to its LAMB runs and shows the fit, and
``scaleout simulate scale sim.convergence=FILE`` predicts time to train with it.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

from scaleout.argtypes import csv_of
from scaleout.bench._harness import (
    add_config_arguments,
    add_standard_arguments,
    bench_config,
    emit,
)
from scaleout.errors import UserError

NAME = "largebatch"
HELP = "steps to a target: LAMB at the base batch vs LAMB and AdamW at 8x the batch (one run)"
DESCRIPTION = (
    __doc__
    + """
examples:
  scaleout bench largebatch          # tiny BERT: LAMB b2, LAMB b16, AdamW b16 x 3 LRs, target 0.12
  scaleout bench largebatch --lamb-lr 5e-3      # another base LAMB rate (scaled the same way at 8x)
  scaleout bench largebatch --adamw-lrs 1e-3,2e-3 train.target=0.10 --png ''
  scaleout bench largebatch --adamw-lrs '' train.seed=1     # LAMB only, another initialisation
"""
)


# On top of --config; the overrides win. The warm-up steps are the same at every batch (LEGW).
DEFAULTS = [
    "train.target=0.12",  # above copy-the-input 0.117 and 2.2x the most-frequent-token 0.054
    "optim.warmup_steps=80",
]
# Set for every run by the plan (optimizer, lr, batch, budget, eval interval, output): refused as
# overrides.
BENCH_KEYS = (
    "launch.env",
    "optim.name",
    "optim.lr",
    "train.global_batch",
    "train.max_steps",
    "optim.total_steps",
    "train.eval_every",
    "train.output_dir",
    "checkpoint.dir",
    "checkpoint.every_steps",
    "train.progress",
    "comm.algorithm",
)

SMOKE_ARGS = [
    "--base-batch",
    "1",
    "--factor",
    "2",
    "--base-steps",
    "4",
    "--eval-every",
    "1",
    "--adamw-lrs",
    "1e-3",
    "optim.warmup_steps=1",  # the overrides together: argparse takes one run of positionals
    "model.bert.layers=1",
    "data.eval_samples=16",
    "data.source=synthetic",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--base-batch", type=int, default=2, help="base global batch in packed rows (default 2)"
    )
    p.add_argument("--factor", type=int, default=8, help="large batch = factor x base (default 8)")
    p.add_argument(
        "--lamb-lr",
        type=float,
        default=1e-2,
        help="LAMB learning rate at the base batch (default 1e-2)",
    )
    p.add_argument(
        "--adamw-lrs",
        type=csv_of(float),
        default=[2.5e-4, 5e-4, 1e-3],
        help="AdamW learning rates at the base batch, comma-separated, each scaled like LAMB's "
        "(default 2.5e-4,5e-4,1e-3)",
    )
    p.add_argument(
        "--base-steps", type=int, default=3200, help="step budget at the base batch (default 3200)"
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=2,
        help="eval interval in large-batch steps; the base run evaluates every factor x this "
        "(default 2)",
    )
    p.add_argument(
        "--seeds",
        type=csv_of(int),
        default=None,
        help="comma-separated train.seed values: repeat the whole comparison per initialisation "
        "(default: the config's seed once)",
    )
    add_standard_arguments(p, NAME, png=True)
    add_config_arguments(p, "bert_tiny_cpu", "config every run trains, under DEFAULTS")


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """The config's target and warm-up steps (--config + DEFAULTS + overrides; a bad key is one
    line before any run) as ``args.target`` and ``args.warmup_steps``: the plan and the report
    use them."""
    cfg = bench_config(args, DEFAULTS, BENCH_KEYS)
    if cfg.train.target is None:
        raise UserError("train.target=null: the benchmark counts steps to a masked-LM accuracy")
    args.target, args.warmup_steps = cfg.train.target, cfg.optim.warmup_steps
    return args


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The runs: one recipe rule (sqrt LR scaling, same warm-up steps, same sample budget) for
    every one."""
    f, scale = args.factor, math.sqrt(args.factor)
    large = {
        "batch": args.base_batch * f,
        "max_steps": max(args.base_steps // f, 1),
        "eval_every": args.eval_every,
    }
    runs = [
        {
            "optimizer": "lamb",
            "base_lr": args.lamb_lr,
            "lr": args.lamb_lr,
            "batch": args.base_batch,
            "max_steps": args.base_steps,
            "eval_every": args.eval_every * f,
        },
        {"optimizer": "lamb", "base_lr": args.lamb_lr, "lr": args.lamb_lr * scale, **large},
    ]
    runs += [
        {"optimizer": "adamw", "base_lr": lr, "lr": lr * scale, **large} for lr in args.adamw_lrs
    ]
    for r in runs:
        if r["max_steps"] <= args.warmup_steps:
            raise SystemExit(
                f"--base-steps {args.base_steps} / --factor {f} = {r['max_steps']} steps must "
                "exceed "
                f"optim.warmup_steps={args.warmup_steps}"
            )
    return runs


def _curve(mlperf_log: Path, eval_every: int, max_steps: int) -> list[list[float]]:
    """[(step, samples, accuracy)] from the MLPerf log; the loop evaluates every eval_every steps
    and at the end."""
    evals = []
    for line in mlperf_log.read_text().splitlines():
        if ":::MLLOG" in line and '"eval_accuracy"' in line:
            rec = json.loads(line.split(":::MLLOG", 1)[1])
            evals.append((rec["metadata"]["samples_count"], float(rec["value"])))
    return [[min((i + 1) * eval_every, max_steps), s, a] for i, (s, a) in enumerate(evals)]


def _train(
    args: argparse.Namespace, run: dict[str, Any], seed: int | None = None
) -> dict[str, Any]:
    from scaleout.config import load_config
    from scaleout.train import run_training

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            args.config,
            [
                *DEFAULTS,
                *args.overrides,
                "launch.env=single",
                f"optim.name={run['optimizer']}",
                f"optim.lr={run['lr']}",
                f"train.global_batch={run['batch']}",
                f"train.max_steps={run['max_steps']}",
                f"optim.total_steps={run['max_steps']}",
                f"train.eval_every={run['eval_every']}",
                f"train.output_dir={tmp}",
                "checkpoint.dir=null",
                "checkpoint.every_steps=0",
                "train.progress=false",
                "comm.algorithm=flat",
                *([] if seed is None else [f"train.seed={seed}"]),
            ],
        )
        result = run_training(cfg, config_file=str(args.config))
        if result.status not in (
            "success",
            "max_steps",
        ):  # SIGTERM/SIGUSR2 or a failure: no partial verdict
            raise SystemExit(
                f"{run['optimizer']} batch {run['batch']} ended {result.status!r}; bench stopped"
            )
        curve = _curve(Path(tmp) / "mlperf.log", run["eval_every"], run["max_steps"])
    reached = result.status == "success"
    return {
        **run,
        "seed": cfg.train.seed,
        "status": result.status,
        "steps": result.steps if reached else None,
        "final_metric": result.metric,
        "wall_s": round(time.perf_counter() - t0, 1),
        "curve": curve,
    }


def steps_cell(r: dict[str, Any]) -> str:
    return str(r["steps"]) if r["steps"] is not None else f"> budget ({r['max_steps']})"


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """LAMB at the large batch within 1/5 of the base steps; the best AdamW at the large batch
    worse than it."""
    base, lamb8 = rows[0]["steps"], rows[1]["steps"]
    adamw = [r["steps"] for r in rows[2:]]
    best_adamw = min((s for s in adamw if s is not None), default=None)
    return {
        "lamb_large_steps_over_base": (lamb8 / base) if (base and lamb8) else None,
        "lamb_large_within_one_fifth": bool(base and lamb8 and lamb8 <= base / 5),
        "best_adamw_large_steps": best_adamw,
        "adamw_large_worse_than_lamb_large": (
            bool(lamb8 and (best_adamw is None or best_adamw > lamb8)) if adamw else None
        ),
    }


def _plot(plt: Any, rows: list[dict[str, Any]], args: argparse.Namespace) -> Any:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4), sharey=True)
    for r in rows:
        n = (
            f"{r['steps']} steps"
            if r["steps"] is not None
            else f"> budget ({r['max_steps']} steps)"
        )
        label = f"{r['optimizer']} batch {r['batch']} lr {r['lr']:.3g}: {n}"
        for ax, x in zip(axes, (0, 1), strict=True):
            ax.plot([p[x] for p in r["curve"]], [p[2] for p in r["curve"]], label=label, lw=1.2)
    for ax in axes:
        ax.axhline(args.target, color="k", ls="--", lw=0.8, label=f"target {args.target}")
        ax.axhline(0.054, color="grey", ls=":", lw=0.8, label="most-frequent token 0.054")
    axes[0].set_xscale("log")
    axes[0].set_xlabel("optimizer steps (log)")
    axes[1].set_xlabel("training sequences seen")
    axes[0].set_ylabel("eval masked-LM accuracy")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"{args.config}: same data order, same target, {args.factor}x batch")
    fig.tight_layout()
    return fig


def summary(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """The verdict over all seeds: each bar must hold for every seed."""
    adamw = [v["adamw_large_worse_than_lamb_large"] for v in per_seed]
    return {
        "lamb_large_steps_over_base": [v["lamb_large_steps_over_base"] for v in per_seed],
        "lamb_large_within_one_fifth": all(v["lamb_large_within_one_fifth"] for v in per_seed),
        "adamw_large_worse_than_lamb_large": all(adamw) if None not in adamw else None,
        "per_seed": per_seed,
    }


def run(args: argparse.Namespace) -> int:
    runs, t0 = plan(resolve(args)), time.perf_counter()
    seeds = args.seeds or [None]  # None: the config's train.seed
    rows: list[dict[str, Any]] = []
    per_seed = []
    for seed in seeds:
        mine = [
            _announced(args, r, seed, len(rows) + i + 1, len(runs) * len(seeds))
            for i, r in enumerate(runs)
        ]
        rows += mine
        per_seed.append({"seed": mine[0]["seed"], **verdict(mine)})
    table = []
    for r in rows:
        base = next(b["steps"] for b in rows if b["seed"] == r["seed"])
        table.append(
            [
                r["seed"],
                r["optimizer"],
                r["batch"],
                f"{r['lr']:.3g}",
                steps_cell(r),
                f"{r['final_metric']:.4f}",
                f"{r['steps'] / base:.3f}" if (r["steps"] and base) else "-",
            ]
        )
    v, f = summary(per_seed), args.factor
    wall = time.perf_counter() - t0
    emit(
        args,
        NAME,
        [
            "seed",
            "optimizer",
            "global batch",
            "lr",
            f"steps to {args.target}",
            "last metric",
            "steps / base steps",
        ],
        table,
        {
            "config": args.config,
            "target": args.target,
            "factor": f,
            "warmup_steps": args.warmup_steps,
            "overrides": args.overrides,
            "runs": rows,
            "verdict": v,
            "wall_s": round(wall, 1),
        },
        notes=[
            f"LAMB at {f}x batch needs <= 1/5 of the base steps: "
            f"{v['lamb_large_within_one_fifth']}; best AdamW "
            f"at {f}x does worse than LAMB at {f}x: {v['adamw_large_worse_than_lamb_large']}"
            f"{' (every seed)' if len(seeds) > 1 else ''}; wall {wall:.0f} s"
        ],
        plot=lambda plt: _plot(plt, [r for r in rows if r["seed"] == rows[0]["seed"]], args),
    )
    return 0


def _announced(
    args: argparse.Namespace, r: dict[str, Any], seed: int | None, i: int, n: int
) -> dict[str, Any]:
    """One training of the plan, with a line before and after."""
    print(
        f"[{i}/{n}] {r['optimizer']} batch {r['batch']} lr {r['lr']:.3g} (budget {r['max_steps']} "
        "steps, warm-up "
        f"{args.warmup_steps}, eval every "
        f"{r['eval_every']}{'' if seed is None else f', seed {seed}'}) ...",
        flush=True,
    )
    out = _train(args, r, seed)
    print(
        f"      -> steps to {args.target}: {steps_cell(out)}, last metric "
        f"{out['final_metric']:.4f}, "
        f"{out['wall_s']:.0f} s",
        flush=True,
    )
    return out
