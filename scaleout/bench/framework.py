"""scaleout bench framework: what scaleout's trainer costs against a plain DDP loop, same recipe."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from types import SimpleNamespace
from typing import Any

from scaleout.bench._harness import (
    add_config_arguments,
    add_standard_arguments,
    bench_config,
    check_counts,
    compare,
    emit,
    init_ranks,
    interleave,
    say0,
)
from scaleout.units import DEFAULT_BUCKET_MB, DEFAULT_FIRST_BUCKET_MB

NAME = "framework"
HELP = "scaleout's trainer vs a plain torch DDP loop on the same recipe: ms/step and their ratio"
DESCRIPTION = """\
The first factor of `scaleout bench ttt`'s ablation is "scaleout's trainer with the baseline's
recipe": it should cost nothing. This benchmark holds everything else equal and times the steps
alone, in the same processes, interleaved round by round (each call --steps steps, a barrier
before it, the slowest rank's time):

* ddp: the baseline's own step function (scaleout/bench/_ttt_baseline.py ddp_step: DDP with
  torch's default buckets -- 25 MiB after a 1 MiB first one --, torch's fused AdamW, linear
  warm-up/decay, padded rows from DistributedSampler + DataLoader);
* scaleout: Trainer.run_step, the training loop's body (data, forward/backward with the reducer,
  the step's agreement, optimizer, schedule, observers), under the config below: AdamW, padded,
  flat all-reduce, comm.bucket_mb 25 with comm.first_bucket_mb 1, fp32, data.order=torch (the
  DistributedSampler's batches).

Both start from the same weights (train.seed) and read the same batches, so their losses agree
to float rounding: the table's last column checks that the two run the same recipe. ratio = ddp
ms / scaleout ms (>= 1.00: scaleout as fast or faster). Runs in the ranks of any launcher
(alone: one rank, no communication: the host-side costs only).

examples:
  scaleout launch --nnodes 2 --nproc-per-node 2 -- scaleout bench framework
  scaleout launch --nnodes 2 --nproc-per-node 2 --netns -- scaleout bench framework --repeats 30
  scaleout launch --nnodes 1 --nproc-per-node 2 -- scaleout bench framework train.global_batch=64
"""

SMOKE_ARGS = [
    *("--repeats", "1", "--warmup", "0", "--steps", "2"),
    *("data.source=synthetic", "data.max_seq_len=32", "data.max_predictions=5"),
    *("model.bert.vocab_size=64", "model.bert.hidden=16", "model.bert.layers=1"),
    *("model.bert.heads=2", "model.bert.intermediate=32", "model.bert.max_position=32"),
    "train.global_batch=4",
]
# The best baseline of docs/ttt.md as scaleout config keys (the ablation's framework step).
DEFAULTS = [
    "optim.name=adamw",
    "optim.lr=2e-3",
    "optim.weight_decay=0.01",
    "optim.decay_from=warmup",
    "optim.power=1.0",
    "optim.end_lr=0.0",
    "data.packing=none",
    "data.order=torch",
    "train.global_batch=32",
    "train.precision=fp32",
    "comm.compression=none",
    "comm.algorithm=flat",
    "comm.overlap=true",
    f"comm.bucket_mb={DEFAULT_BUCKET_MB}",
    f"comm.first_bucket_mb={DEFAULT_FIRST_BUCKET_MB}",
    "train.target=null",
    "train.progress=false",
    "checkpoint.dir=null",
    "checkpoint.every_steps=0",
]
# set from the rounds (the step budget and its schedule) and per rank
BENCH_KEYS = (
    "train.max_steps",
    "train.eval_every",
    "optim.warmup_steps",
    "optim.total_steps",
    "train.output_dir",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p, "bert_tiny_cpu", "the model and data of both sides")
    p.add_argument("--steps", type=int, default=5, help="training steps per timed call (default 5)")
    add_standard_arguments(p, NAME, repeats=20, warmup=2)


def run(args: argparse.Namespace) -> int:
    check_counts(args, repeats=1, warmup=0, steps=1)
    bench_config(args, DEFAULTS, BENCH_KEYS)  # a bad override: one line, before any launch
    return _body(args)


def _baseline_args(cfg: Any, total: int) -> SimpleNamespace:
    """The plain loop's flags for ``cfg``'s recipe (scaleout/bench/_ttt_baseline.py)."""
    o, c = cfg.optim, cfg.comm
    # torch's own buckets: leave them unset
    default = c.bucket_mb == DEFAULT_BUCKET_MB and c.first_bucket_mb == DEFAULT_FIRST_BUCKET_MB
    return SimpleNamespace(
        seed=cfg.train.seed,
        lr=o.lr,
        weight_decay=o.weight_decay,
        global_batch=cfg.train.global_batch,
        warmup_steps=o.warmup_steps,
        max_steps=total,
        bucket_mb=None if default else c.bucket_mb,
    )


def reduce_sum(world: Any, values: list[float]) -> list[float]:
    """Every rank's ``values`` summed (one all-reduce)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    if world.world_size > 1:
        dist.all_reduce(t)
    return t.tolist()


def _body(args: argparse.Namespace) -> int:
    import torch  # deferred: a fast `scaleout --help`
    import torch.distributed as dist

    from scaleout.bench._ttt_baseline import _build, bucket_sizes, ddp_step
    from scaleout.train.trainer import Trainer

    world = init_ranks(1, NAME)
    say = say0(world)
    calls = args.repeats + args.warmup
    total = calls * args.steps + 2  # never reached: no evaluation at the end
    try:
        with tempfile.TemporaryDirectory() as out:
            keys = [
                f"train.max_steps={total}",
                f"train.eval_every={total}",
                f"optim.warmup_steps={max(1, total // 10)}",
                f"optim.total_steps={total}",
                f"train.output_dir={out}",
            ]
            cfg = bench_config(args, [*DEFAULTS, *keys])
            if cfg.model.arch != "bert":
                raise SystemExit(f"scaleout bench framework: a BERT config, got {cfg.model.arch}")
            trainer = Trainer(cfg, world)
            trainer.preemption = _NoPreemption()  # steps outside train(): no signal handlers
            base = _build(_baseline_args(cfg, total), cfg, world.rank, world.world_size)
            trainer._start_clock()
            state: dict[str, Any] = {"epoch": 0, "it": None}
            ddp_losses: list[Any] = []
            exposed: list[float] = []

            def next_batch() -> Any:
                while True:
                    if state["it"] is None:
                        base.sampler.set_epoch(state["epoch"])
                        state["epoch"] += 1
                        state["it"] = iter(base.loader)
                    try:
                        return next(state["it"])
                    except StopIteration:
                        state["it"] = None

            cpu: dict[str, list[float]] = {"ddp": [], "scaleout": []}  # every thread's

            def ddp() -> None:
                c = time.process_time()
                for _ in range(args.steps):
                    ddp_losses.append(ddp_step(base, next_batch()))
                cpu["ddp"].append(time.process_time() - c)

            def scaleout() -> None:
                c = time.process_time()
                for _ in range(args.steps):
                    if trainer.run_step(trainer.step) is not None:
                        raise RuntimeError(f"the run ended at step {trainer.step}")
                    exposed.append(float(trainer.sync.last_stats.get("exposed_s") or 0.0))
                cpu["scaleout"].append(time.process_time() - c)

            say(
                f"{world.world_size} ranks: {args.repeats} interleaved rounds of {args.steps} "
                f"steps each (+{args.warmup} warm-up)"
            )
            samples = interleave(
                {"ddp": ddp, "scaleout": scaleout}, args.repeats, args.warmup, world=world, say=say
            )
            # the process CPU per step (all threads: gloo's, autograd's), summed over the ranks
            proc = reduce_sum(world, [statistics.median(cpu[k][args.warmup :]) for k in cpu])
            mine = torch.stack(ddp_losses)
            if world.world_size > 1:
                dist.all_reduce(mine)
            theirs = (mine / world.world_size).tolist()
            ours = [float(x) for x in trainer.losses]
            layouts = {
                "scaleout": [b.nbytes for b in trainer.model.reducer.buckets],
                "ddp": bucket_sizes(base.ddp),
            }
            trainer.mlperf_log.close()
            if trainer.prefetcher is not None:
                trainer.prefetcher.close()
    finally:
        world.close()
    rows = compare(samples, "ddp")
    k = args.steps
    by = {r.name: r for r in rows}
    ratio = by["scaleout"].paired_speedup  # median over rounds of ddp / scaleout
    diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, theirs, strict=True))
    proc_ms = dict(zip(("ddp", "scaleout"), (x / k * 1e3 for x in proc), strict=True))
    table = [
        [
            r.name,
            r.median_s / k * 1e3,
            r.min_s / k * 1e3,
            r.paired_speedup,
            proc_ms[r.name],
            ", ".join(f"{n / 2**20:.2f}" for n in layouts[r.name] or []) or "?",
        ]
        for r in rows
    ]
    exp = statistics.median(exposed[args.warmup * k :] or exposed) * 1e3
    emit(
        args,
        NAME,
        [
            "side",
            "median ms/step",
            "min ms/step",
            "ddp / this (paired)",
            "CPU ms/step (all ranks)",
            "buckets (MiB)",
        ],
        table,
        {
            "ranks": world.world_size,
            "steps_per_call": k,
            "ratio": ratio,
            "rows": [r.to_dict() for r in rows],
            "buckets_bytes": layouts,
            "losses": {"scaleout": ours, "ddp": theirs},
            "max_rel_loss_diff": diff,
            "scaleout_exposed_ms": exp,
            "process_cpu_ms_per_step": proc_ms,
        },
        notes=[
            f"ratio ddp / scaleout: {ratio:.3f} (median of per-round ratios; >= 1.00: scaleout "
            "as fast or faster)",
            f"same recipe: the {len(ours)} mean losses differ by at most {diff:.1e} (relative); "
            f"scaleout's exposed communication {exp:.1f} ms/step",
        ],
        world=world,
    )
    return 0


class _NoPreemption:
    """The benchmark's steps run outside train(): no signal handlers, nothing requested."""

    requested = noticed = terminating = False
