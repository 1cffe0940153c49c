"""scaleout bench ttt: time-to-train head to head, scaleout against the stack a user would pick
instead.

The same model (the config's tiny BERT), the same offline corpus, the same eval set and masked-LM
target, trained to the target on the same cluster, in one invocation:

* **baseline**: a plain torch script (``scaleout.bench._ttt_baseline``) as every rank under the same
  launcher: ``DistributedDataParallel`` (25 MB buckets, its own all-reduce), torch's fused AdamW,
  padded batches, linear warm-up + linear decay. It gets a fair chance: a learning-rate x batch
  sweep on the first seed (a candidate is cut once it is slower than the best so far: it cannot
  become the best), and the best one runs every seed;
* **scaleout**: ``scaleout train`` with packing, LAMB and ``DataParallel`` with the hierarchical
  all-reduce and overlap (1 MB buckets); **scaleout-sharded**: the same with the sharded LAMB
  (sharded within the node, optim.shard=node: the gradients keep the wire dtype; 4x larger
  buckets, as each costs it four collectives where the replicated path makes one). The
  batch is a recipe choice: on this tiny model LAMB needs fewer sequences at 32 packed rows than at
  64-256 (docs/ttt.md);
* **ablation** (the waterfall from the baseline to scaleout, one ingredient switched on per step):
  scaleout's trainer with the baseline's recipe (framework), + packing, + the hierarchical
  all-reduce with overlap, + LAMB at scaleout's batch (= scaleout). Each factor is the median over
  seeds of ttt(before) / ttt(after); their product is checked against the measured ratio and the
  seeds' spread of it.

Every run has the same budget of training sequences (the schedules decay to 0 at its end) and
evaluates every ~``--eval-seqs`` sequences (MLPerf BERT fixes evaluation in samples too).
Time-to-train is MLPerf's ``run_start`` -> ``run_stop`` from each run's ``mlperf.log``; a run that
does not reach the target is "> budget", never a number. Runs are interleaved (all recipes of a
seed, cluster by cluster) so machine noise hits every recipe alike. ``--task resnet`` and ``--task
llama`` race the same way on their own model, data and metric (``_ttt_baseline_resnet``,
``_ttt_baseline_llama`` + ``_ttt_llama``; docs/ttt.md); a metric's direction is its family's
(Llama's log-perplexity: lower is better). Output: a table, JSON (every run with its
accuracy-vs-time curve) and a PNG of accuracy against wall time for every run. ``--netns``
clusters need root.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from scaleout.argtypes import csv_of
from scaleout.bench._harness import bench_config
from scaleout.bench._ttt_llama import LLAMA_RECIPE, QUICK_LLAMA, baseline_recipe, llama_recipes
from scaleout.units import DEFAULT_BUCKET_MB

NAME = "ttt"
HELP = (
    "time-to-train head to head: torch DDP + AdamW (padded, swept) vs scaleout (packing, LAMB, "
    "hierarchical)"
)
DESCRIPTION = (
    __doc__
    + """
scaleout's recipe is a config: --config plus SCALEOUT_RECIPE below plus your key=value overrides
(they win). Its batch, learning rate, precision, wire dtype, all-reduce and buckets are config keys
(train.global_batch, optim.lr, train.precision, comm.compression, comm.algorithm, comm.bucket_mb),
the target is train.target and the cluster shape launch.nnodes x launch.nproc_per_node. The
overrides also reach the baseline (its model, data and target). The keys every run sets from
--budget, --eval-seqs and --seeds (BENCH_KEYS) are refused.

examples:
  scaleout bench ttt                # local + netns 2x2 at 1 Gbit, 3 seeds, ablation on netns
  scaleout bench ttt --clusters netns --seeds 1,2,3,4,5
  scaleout bench ttt --clusters local --no-ablation --baseline-lrs 2e-3 --baseline-batches 64
  scaleout bench ttt train.precision=fp32 comm.bucket_mb=4 optim.lr=1e-2 train.target=0.14
  scaleout bench ttt --quick        # tiny smoke (~1 min): local 1x2, one seed, tiny model
  scaleout bench ttt --task llama --clusters local --seeds 1,2,3   # tiny Llama to log-ppl 5.5
"""
)

SMOKE_ARGS = ["--quick", "train.target=0.01"]  # every code path, ~1-2 min; its own end-to-end test:
SMOKE_TEST = "tests/bench/test_bench_ttt.py::test_quick_bench_end_to_end"
# scaleout's recipe on top of --config (docs/ttt.md: why 32 packed rows at lr 2e-2); overrides win.
# The tiny BERT's masked-LM target: 2.4x the most-frequent-token 0.054, above copy-the-input 0.117,
# on the steep part of the curve (its config's 0.15 sits on a plateau); `bench plan` checks at it
BERT_TARGET = 0.13
SHARDED_BUCKETS = 4  # the sharded row's buckets, in scaleout's (see recipes())
SCALEOUT_RECIPE = [
    f"train.target={BERT_TARGET}",
    # packed rows, ~36 sequences: larger needs more sequences on this model
    "train.global_batch=32",
    "optim.name=lamb",
    "optim.lr=2e-2",
    "train.precision=bf16",  # autocast matmuls, fp32 master weights and LAMB state
    "comm.compression=bf16",  # with bf16/fp16 precision: the gradients all-reduced in that dtype
    "comm.algorithm=hierarchical",
    "comm.overlap=true",
    "comm.bucket_mb=1.0",
    "launch.nnodes=2",  # the clusters' shape (emulated nodes x ranks per node)
    "launch.nproc_per_node=2",
]
# --task resnet (docs/ttt.md, ResNet): ResNet-18 w8 on Fashion-MNIST PNGs (configs/resnet_cpu.yaml,
# target top-1 0.85 on the 10k test set); scaleout: LARS at 2-4x the baseline's batch, label
# smoothing, hierarchical all-reduce + overlap, fp32, plain BN: on this CPU, bf16 autocast + group
# BN over each node's 2 ranks made the step 1.9x slower (539 vs 286 ms on netns 2x2; 1.17x instead
# of 1.47x over the baseline): model.resnet.bn_group=2 train.precision=bf16 comm.compression=bf16
# turn them on (the ablation then has a group-BN and a bf16 step).
RESNET_RECIPE = [
    "train.target=0.85",
    "train.global_batch=256",
    "optim.name=lars",
    "optim.lr=6.0",
    "optim.weight_decay=5e-5",
    "model.resnet.label_smoothing=0.1",
    "model.resnet.eval_bn=batch",
    "model.resnet.bn_group=1",
    "train.precision=fp32",
    "comm.compression=none",
    "comm.algorithm=hierarchical",
    "comm.overlap=true",
    "comm.bucket_mb=1.0",
    "launch.nnodes=2",
    "launch.nproc_per_node=2",
]
# Per task: config, recipe, images/sequences budget, eval interval, baseline sweep (lrs, batches).
TASKS = {
    "bert": ("bert_tiny_cpu", SCALEOUT_RECIPE, 32000, 1024, [1e-3, 2e-3, 3e-3], [32, 64]),
    "resnet": ("resnet_cpu", RESNET_RECIPE, 120000, 15000, [0.05, 0.1, 0.2], [64, 128]),
    # --task llama (docs/ttt.md, Llama): rows of 128 tokens; the config's 400 steps x 32 rows, an
    # evaluation every 25 of them; AdamW lrs around the config's 2e-3 at its batch (_ttt_llama.py)
    "llama": ("llama_tiny_cpu", LLAMA_RECIPE, 12800, 800, [1e-3, 2e-3, 4e-3], [32]),
}

QUICK_RESNET = ["train.global_batch=32", "launch.nnodes=1", "model.resnet.bn_group=1"]
QUICK = [
    "model.bert.layers=1",
    "model.bert.hidden=32",
    "model.bert.heads=1",
    "model.bert.intermediate=64",
    "train.global_batch=16",
    "launch.nnodes=1",
]
# Set for every run from the bench's own rules (the sequence budget, the eval interval, the seeds,
# the run directories): an override of one would be silently replaced, so it is refused.
BENCH_KEYS = (
    "optim.warmup_steps",
    "optim.total_steps",
    "optim.decay_from",
    "optim.power",
    "optim.end_lr",
    "optim.sharded",
    "optim.shard",
    "optim.overlap_comm",
    "train.max_steps",
    "train.eval_every",
    "train.eval_start_step",
    "train.seed",
    "train.output_dir",
    "train.progress",
    "train.grad_accum",
    "checkpoint.dir",
    "checkpoint.every_steps",
)


def _names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in ("local", "netns")]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected clusters among local,netns, got {text!r}")
    return names


_floats = csv_of(float, at_least=0, allow_empty=False)
_ints = csv_of(int, at_least=1, allow_empty=False)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--task",
        choices=tuple(TASKS),
        default="bert",
        help="bert (tiny BERT, masked LM; default), resnet (ResNet-18 w8, Fashion-MNIST, top-1) "
        "or llama (tiny Llama, log-perplexity)",
    )
    p.add_argument(
        "--config",
        default=None,
        help="model + data config for both sides, under scaleout's recipe (default bert_tiny_cpu; "
        "--task resnet: resnet_cpu; llama: llama_tiny_cpu)",
    )
    p.add_argument(
        "--budget",
        type=int,
        default=None,
        help="training sequences (images, rows) every run may use; the schedules decay there "
        "(default 32000, 1.2 epochs; resnet 120000, 2 epochs; llama 12800 rows)",
    )
    p.add_argument(
        "--eval-seqs",
        type=int,
        default=None,
        help="evaluate every ~this many training sequences (images, rows) (default 1024; resnet "
        "15000; llama 800)",
    )
    p.add_argument(
        "--seeds", type=_ints, default=[1, 2, 3], help="model-initialisation seeds (default 1,2,3)"
    )
    p.add_argument(
        "--clusters",
        type=_names,
        default=["local", "netns"],
        help="local (scaleout launch) and/or netns (launch --netns, root) (default local,netns)",
    )
    p.add_argument("--rate", default="1gbit", help="netns link rate (default 1gbit)")
    p.add_argument(
        "--baseline-lrs",
        type=_floats,
        default=None,
        help="AdamW (resnet: SGD) learning rates to sweep (default 1e-3,2e-3,3e-3; resnet "
        "0.05,0.1,0.2; llama 1e-3,2e-3,4e-3)",
    )
    p.add_argument(
        "--baseline-batches",
        type=_ints,
        default=None,
        help="baseline global batches in sequences (images, rows) to sweep (default 32,64; resnet "
        "64,128; llama 32)",
    )
    p.add_argument(
        "--baseline-warmup",
        type=float,
        default=0.1,
        help="baseline warm-up fraction of its steps (default 0.1)",
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="scaleout warm-up fraction of its steps (default: bert 0.1; resnet and llama the "
        "config's optim.warmup_steps / optim.total_steps, 40/705 in resnet_cpu, 40/400 in "
        "llama_tiny_cpu)",
    )
    p.add_argument("--no-ablation", action="store_true", help="skip the ablation runs")
    p.add_argument(
        "--ablation-clusters",
        type=_names,
        default=["netns"],
        help="clusters to run the ablation on (default netns)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny smoke: local 1x2, one seed, a 1-layer 32-wide model, small budget",
    )
    p.add_argument(
        "--runs-dir", default="bench-results/ttt-runs", help="every run's output directory"
    )
    p.add_argument("--out", default="bench-results/ttt.json", help="JSON output")
    p.add_argument(
        "--png",
        default="bench-results/ttt.png",
        help="accuracy vs wall time of every run ('' = none)",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        help="config overrides key=value (after --config and SCALEOUT_RECIPE): scaleout's recipe, "
        "and "
        "the model/data/target of both sides, e.g. optim.lr=1e-2 model.bert.layers=1",
    )


def defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fills what --task decides (config, budget, eval interval, sweep grid) where not given."""
    config, _, budget, every, lrs, batches = TASKS[args.task]
    for key, value in (
        ("config", config),
        ("budget", budget),
        ("eval_seqs", every),
        ("baseline_lrs", lrs),
        ("baseline_batches", batches),
    ):
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def _quick(args: argparse.Namespace) -> None:
    """Tiny settings for a smoke test: every code path, a minute of CPU."""
    defaults(args)  # --task's sweep grid and budget first: cut down below
    quick = {"resnet": QUICK_RESNET, "llama": QUICK_LLAMA}.get(args.task, QUICK)
    args.overrides = [*quick, *args.overrides]
    args.clusters, args.ablation_clusters, args.seeds = ["local"], ["local"], args.seeds[:1]
    args.baseline_lrs, args.baseline_batches = args.baseline_lrs[:1], args.baseline_batches[:1]
    args.budget, args.eval_seqs = min(args.budget, 256), min(args.eval_seqs, 64)


def scaleout_config(args: argparse.Namespace) -> Any:
    """--config + SCALEOUT_RECIPE + the overrides, validated (a bad key is one line, before any
    launch)."""
    from scaleout.errors import UserError

    defaults(args)
    cfg = bench_config(args, TASKS[args.task][1], BENCH_KEYS)
    if cfg.train.target is None:
        raise UserError("train.target=null: the head to head needs a metric to reach")
    if args.warmup is None:  # scaleout's own recipe: the config's warm-up share (BERT: 0.1)
        o = cfg.optim
        own = args.task in ("resnet", "llama") and o.total_steps
        args.warmup = o.warmup_steps / o.total_steps if own else 0.1
    if cfg.model.arch != args.task:
        raise UserError(
            f"--config {args.config}: model.arch={cfg.model.arch} does not fit --task {args.task}"
        )
    return cfg


def seqs_per_row(cfg: Any) -> tuple[float, str]:
    """Sequences per packed row of the corpus at the config's settings (the packed recipes'
    algorithm): the family's own measurement (``Family.packing_speedup``)."""

    return cfg.model.family.packing_speedup(cfg)


def _clusters(args: argparse.Namespace, cfg: Any) -> list[Any]:
    from scaleout.bench._ttt_runs import LaunchShape

    out = []
    for name in args.clusters:
        if name == "netns" and os.geteuid() != 0:
            print("netns: skipped (the emulated cluster needs root)", flush=True)
            continue
        out.append(
            LaunchShape(
                name,
                cfg.launch.nnodes,
                cfg.launch.nproc_per_node,
                args.rate if name == "netns" else None,
            )
        )
    if not out:
        raise SystemExit("scaleout bench ttt: no cluster to run on")
    return out


def recipes(
    args: argparse.Namespace, cfg: Any, world: int, spr: float, best: Any
) -> dict[str, Any]:
    """scaleout's recipe (read from ``cfg``: :func:`scaleout_config`) and the ablation chain,
    given the best baseline recipe ``best``."""
    from scaleout.bench._ttt_runs import Recipe

    if args.task == "resnet":
        return resnet_recipes(args, cfg, best)
    if args.task == "llama":
        return llama_recipes(args, cfg, best, SHARDED_BUCKETS)
    rows = max(
        world, round(best.batch / spr / world) * world
    )  # packed rows carrying ~the baseline's sequences
    full = Recipe.from_config("scaleout", cfg, args.warmup)
    full = replace(full, label=_low_label(full))
    # the baseline's DistributedSampler batches: the factor is the framework's
    framework = Recipe.framework(best, "adamw", order="torch")
    # packed rows are other units than the baseline's sequences: scaleout's own order from here
    packing = replace(
        framework, name="abl-packing", packing=True, batch=rows, order="scaleout", label="packing"
    )
    comm = replace(
        packing,
        name="abl-comm",
        comm=full.comm,
        bucket_mb=full.bucket_mb,
        label=f"{full.comm} all-reduce + overlap",
    )
    lamb = replace(
        full,
        name="abl-lamb",
        precision="fp32",
        compression="none",
        label=f"{full.optimizer.upper()} lr {full.lr:g} at {full.batch} packed rows",
    )
    low = full.precision != "fp32"
    chain = [framework, packing, comm] + ([lamb] if low else []) + [full]
    if not low:
        chain[-1] = replace(full, label=lamb.label)
    return {
        "scaleout": full,
        # sharded within the node (NVIDIA's DistributedFusedLAMB: reduce-scatter in the node,
        # the slice all-reduced across the nodes, norms summed in the node), so the gradients keep
        # scaleout's wire dtype (a world shard's compressed reduce-scatter needs comm=flat).
        # Buckets SHARDED_BUCKETS x larger: each costs the sharded path four collectives (all-to-all
        # in the node, all-to-all + all-gather across, the parameters' all-gather) where the
        # replicated path makes one all-reduce, so the same collectives per MB (docs/ttt.md:
        # 1 vs 4 MB on netns 2x2, 128.7 / 134.0 against 114.0 / 120.0 ms a step)
        "scaleout-sharded": replace(
            full,
            name="scaleout-sharded",
            sharded=True,
            shard="node",
            bucket_mb=full.bucket_mb * SHARDED_BUCKETS,
            label=f"sharded {full.optimizer.upper()} (within the node)",
        ),
        "chain": chain,
    }


def resnet_recipes(args: argparse.Namespace, cfg: Any, best: Any) -> dict[str, Any]:
    """--task resnet: scaleout's recipe and the ablation chain from the best SGD baseline:
    scaleout's trainer with the baseline's recipe (SGD, its batch and lr, no smoothing, flat
    all-reduce, plain BN, fp32, running-statistics eval), + LARS with label smoothing at
    scaleout's batch (and its eval_bn), + group BN,
    + the hierarchical all-reduce with overlap, + bf16 (= scaleout)."""
    from scaleout.bench._ttt_runs import Recipe

    full = Recipe.from_config("scaleout", cfg, args.warmup)
    full = replace(full, label=_low_label(full))
    framework = Recipe.framework(best, "sgd", label_smoothing=0.0)
    lars = replace(
        full,
        name="abl-lars",
        comm="flat",
        bucket_mb=DEFAULT_BUCKET_MB,
        bn_group=1,
        precision="fp32",
        compression="none",
        label=f"{full.optimizer.upper()} lr {full.lr:g} at {full.batch} + smoothing"
        + (" + batch-stat eval" if full.eval_bn == "batch" else ""),
    )
    gbn = replace(lars, name="abl-groupbn", bn_group=full.bn_group, label="group BN")
    comm = replace(
        gbn,
        name="abl-comm",
        comm=full.comm,
        bucket_mb=full.bucket_mb,
        overlap=full.overlap,
        label=f"{full.comm} all-reduce + overlap",
    )
    chain = [framework, lars] + ([gbn] if full.bn_group > 1 else [])
    if full.precision == "fp32":  # the last step (the scaleout row itself) switches comm on
        full = replace(full, label=comm.label)
        return {"scaleout": full, "chain": [*chain, full]}
    return {"scaleout": full, "chain": [*chain, comm, full]}


def _low_label(r: Any) -> str:
    if r.precision == "fp32":
        return r.optimizer.upper()
    wire = f" + {r.compression} all-reduce" if r.compression != "none" else ""
    return f"{r.precision} autocast{wire}"


def baseline_precision(cfg: Any) -> str:
    """--task llama's baseline precision: bf16 autocast (the 2026 GPT loop), unless the overrides
    make scaleout's run fp32 (train.precision=fp32: then both sides are, e.g. on a CPU without
    bf16 instructions, where autocast is emulated)."""
    return "fp32" if cfg.train.precision == "fp32" else "bf16"


def sweep(
    args: argparse.Namespace, plan: Any, clusters: list[Any], root: Path, rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """The baseline's lr x batch sweep on the first seed, candidates interleaved over the
    clusters; a candidate is cut once it is slower than the best so far on its cluster. Returns
    the best per cluster."""
    from scaleout.bench._ttt_runs import Recipe, execute

    lower = plan.goal == "min"
    bs, lrs = args.baseline_batches, args.baseline_lrs
    first = (
        bs[(len(bs) - 1) // 2],
        lrs[(len(lrs) - 1) // 2],
    )  # the grid's middle first: an early good best
    grid = [first] + [
        (b, lr) for b in bs for lr in lrs if (b, lr) != first
    ]  # cuts the others sooner
    best: dict[str, tuple[dict[str, Any], Any]] = {}
    seed = args.seeds[0]
    for b, lr in grid:
        resnet, name = args.task == "resnet", f"baseline-b{b}-lr{lr:g}"
        r = Recipe(
            name,
            "torch",
            "sgd" if resnet else "adamw",
            b,
            lr,
            args.baseline_warmup,
            label="torch DDP + SGD" if resnet else "torch DDP + AdamW",
        )
        if args.task == "llama":  # bf16 autocast, concatenated rows
            r = baseline_recipe(name, b, lr, args.baseline_warmup, args.baseline_precision)
        for c in clusters:
            cut = (
                best[c.name][0]["ttt_s"]
                if c.name in best and best[c.name][0]["ttt_s"] is not None
                else None
            )
            _say(rows, c, r, seed)
            row = execute(plan, c, r, seed, root, time_budget=cut)
            row["sweep"] = True
            rows.append(row)
            _done(row, root)
            if c.name not in best or _better(row, best[c.name][0], lower):
                best[c.name] = (row, r)
    return best


def _better(a: dict[str, Any], b: dict[str, Any], lower: bool = False) -> bool:
    """Whether run ``a`` beats run ``b``: reached first, then the faster; neither reached, the
    better last metric in its direction (``lower``: log-perplexity)."""
    if a["reached"] != b["reached"]:
        return a["reached"]
    if a["reached"]:
        return a["ttt_s"] < b["ttt_s"]
    worst = math.inf if lower else -math.inf
    x, y = (worst if r["achieved"] is None else r["achieved"] for r in (a, b))
    return x < y if lower else x > y


def _say(rows: list[dict[str, Any]], c: Any, r: Any, seed: int) -> None:
    print(
        f"[{len(rows) + 1}] {c.name} {r.name} seed {seed} ({r.kind}, {r.optimizer}, batch "
        f"{r.batch}, lr {r.lr:g}) ...",
        flush=True,
    )


def _done(row: dict[str, Any], root: Path) -> None:
    """One line per run; every finished run is also appended to runs.jsonl (a long bench keeps
    what it did)."""

    from scaleout.bench._ttt_report import cell

    with open(root / "runs.jsonl", "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
    ttt = cell(row) + (" s" if row["ttt_s"] is not None else "")
    print(
        f"     -> ttt {ttt}, {row['steps']} steps, {row['samples']} samples, last metric "
        f"{row['achieved'] if row['achieved'] is None else round(row['achieved'], 4)}, wall "
        f"{row['wall_s']:.0f} s",
        flush=True,
    )


def run(args: argparse.Namespace) -> int:
    from scaleout.bench._ttt_runs import Plan, execute

    if args.quick:
        _quick(args)
    cfg = scaleout_config(args)  # bad overrides: one line, before anything runs
    clusters = _clusters(args, cfg)
    t0 = time.perf_counter()
    resnet = args.task == "resnet"
    spr, algo = (1.0, "none") if args.task != "bert" else seqs_per_row(cfg)
    target = cfg.train.target
    plan = Plan(
        args.config,
        target,
        args.budget,
        args.eval_seqs,
        spr,
        algo,
        list(args.overrides),
        task=args.task,
        power=2.0 if resnet else 1.0,
        # llama: the cosine's floor is the config's (end_lr / lr, a tenth); BERT, ResNet: 0
        end_lr_ratio=cfg.optim.end_lr / cfg.optim.lr if args.task == "llama" else 0.0,
        goal=cfg.model.family.metric_goal,  # log-perplexity: lower is better
    )
    unit = {"resnet": "images", "llama": "rows"}.get(args.task, "sequences")
    packing = "" if args.task != "bert" else f"{algo} packing {spr:.4f} sequences/row; "
    print(
        f"{args.config}: target {target}, budget {args.budget} {unit}, eval every "
        f"~{args.eval_seqs}, {packing}clusters {', '.join(c.name for c in clusters)}; seeds "
        f"{args.seeds}",
        flush=True,
    )
    from scaleout.bench.precision import bf16_warning

    args.baseline_precision = baseline_precision(cfg)
    llama = {args.baseline_precision} if args.task == "llama" else set()
    said = bf16_warning({cfg.train.precision} | llama)
    if said:
        print(said, flush=True)
    root, rows = Path(args.runs_dir), []
    root.mkdir(parents=True, exist_ok=True)
    (root / "runs.jsonl").unlink(missing_ok=True)
    best = sweep(args, plan, clusters, root, rows)
    for c in clusters:  # the sweep's winner is the baseline of the first seed
        rows.append(
            {
                **best[c.name][0],
                "recipe": "baseline",
                "sweep": False,
                "from_sweep": best[c.name][1].name,
            }
        )
    for i, seed in enumerate(args.seeds):
        for c in clusters:
            base = replace(best[c.name][1], name="baseline")
            rec = recipes(args, cfg, c.world, spr, base)
            todo = ([base] if i else []) + [rec["scaleout"]]
            todo += [rec["scaleout-sharded"]] if "scaleout-sharded" in rec else []
            if not args.no_ablation and c.name in args.ablation_clusters:
                todo += rec["chain"][:-1]
            for r in todo[i % len(todo) :] + todo[: i % len(todo)]:  # rotate the order per seed
                _say(rows, c, r, seed)
                rows.append(execute(plan, c, r, seed, root))
                _done(rows[-1], root)
    from scaleout.bench._ttt_report import finish

    return finish(args, plan, clusters, best, rows, time.perf_counter() - t0)
