"""scaleout bench agreement: what the straggler/desync attribution adds to the step's agreement."""

from __future__ import annotations

import argparse
import statistics
import tempfile
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

NAME = "agreement"
HELP = (
    "the step's agreement all-reduce with and without the straggler/desync block: step-time ratio"
)
DESCRIPTION = """\
The trainer's step ends with one small SUM all-reduce (scaleout/train/agreement.py agree_on_step).
With attribution on (the default) it also carries every rank's phase times and collective
fingerprint in a world-sized block (scaleout/train/skew.py). This benchmark runs real training
steps of --config with the block off ("old") and on ("extended"), interleaved round by round, each
step timed as the slowest rank's, and prints the median step times and the ratio extended / old
(1.00 = no cost). It also times the agreement alone, and an agreement whose block is sized for
--emulate-ranks ranks (the bytes of that world on these ranks; not its latency).

Runs in the ranks of any launcher (alone: one rank, no all-reduce).

examples:
  scaleout launch --nnodes 2 --nproc-per-node 2 -- scaleout bench agreement --repeats 40
  srun -N 4 --ntasks-per-node 8 scaleout bench agreement model.bert.layers=2
"""

SMOKE_ARGS = [
    *("--repeats", "1", "--warmup", "0", "--emulate-ranks", "8"),
    *("data.max_seq_len=32", "data.max_predictions=5", "model.bert.vocab_size=64"),
    *("model.bert.hidden=16", "model.bert.layers=1", "model.bert.heads=2"),
    *("model.bert.intermediate=32", "model.bert.max_position=32"),
]
DEFAULTS = [  # a tiny model: the agreement's share of the step is as large as it gets
    "data.source=synthetic",
    "data.eval_samples=8",
    "train.global_batch=8",
    "train.target=null",
    "train.progress=false",
    "train.metrics=[]",
    "checkpoint.dir=null",
    "checkpoint.every_steps=0",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p, "bert_tiny_cpu", "the run config whose steps are timed")
    p.add_argument(
        "--emulate-ranks",
        type=int,
        default=2048,
        help="also time an agreement whose block is sized for this many ranks (default 2048)",
    )
    add_standard_arguments(p, NAME, repeats=30, warmup=5)


def run(args: argparse.Namespace) -> int:
    check_counts(args, repeats=1, warmup=0, emulate_ranks=1)
    return _body(args)


def _agreement(world: Any, extended: bool, ranks: int) -> Any:
    """One agreement as the trainer calls it, the block sized for ``ranks`` ranks."""
    import torch
    import torch.distributed as dist

    from scaleout.train.agreement import HEAD, agree_on_step, agreement_size
    from scaleout.train.skew import PHASES, ROWS

    if not extended or ranks == world.world_size:
        return lambda: agree_on_step(
            world,
            False,
            False,
            torch.zeros((), device=world.device),
            phases=[0.001 * (world.rank + 1)] * len(PHASES) if extended else None,
            fingerprint=7,
        )
    buf = torch.zeros(agreement_size(ranks, True), device=world.device)

    def emulated() -> Any:  # the same bytes and device work, this world's latency
        buf[HEAD + world.rank] = 1.0
        if world.world_size > 1:
            dist.all_reduce(buf)
        block = buf[HEAD:].view(ROWS, ranks)
        mx, amx = block[: len(PHASES)].max(dim=1)
        mn, amn = block[: len(PHASES)].min(dim=1)
        med = block[: len(PHASES)].median(dim=1).values
        return torch.cat([buf[:HEAD], mx, amx.float(), mn, amn.float(), med]).tolist()

    return emulated


def _body(args: argparse.Namespace) -> int:
    from scaleout.comm.phasetime import CLOCK  # deferred: torch, and a fast `scaleout --help`
    from scaleout.train.trainer import Trainer  # deferred: a fast `scaleout --help`

    world = init_ranks(1, NAME)
    say, rounds = say0(world), args.repeats + args.warmup
    try:
        with tempfile.TemporaryDirectory() as out:
            cfg = bench_config(
                args,
                # the steps the rounds take, and the synthetic data they need, no more
                [*DEFAULTS, f"train.output_dir={out}", f"train.max_steps={2 * rounds}"],
                bench_keys=("train.output_dir",),
            )
            trainer = Trainer(cfg, world)
            trainer.preemption = _NoPreemption()
            step = [0]

            def train_step(attribution: bool) -> Any:
                def fn() -> Any:
                    trainer.attribution = attribution
                    CLOCK.enabled = attribution  # the row / column phase times (train() sets it)
                    flags = trainer.train_step(step[0])
                    step[0] += 1
                    return flags.loss

                return fn

            say(f"{world.world_size} ranks, {cfg.model.arch}: {args.repeats} interleaved rounds")
            steps = interleave(
                {"old": train_step(False), "extended": train_step(True)},
                args.repeats,
                args.warmup,
                world=world,
            )
            n = args.emulate_ranks
            alone = interleave(
                {
                    "old": _agreement(world, False, world.world_size),
                    "extended": _agreement(world, True, world.world_size),
                    f"extended, block of {n} ranks": _agreement(world, True, n),
                },
                10 * args.repeats,
                args.warmup,
                world=world,
            )
            if trainer.prefetcher is not None:
                trainer.prefetcher.close()
    finally:
        world.close()
    step_rows, alone_rows = compare(steps, "old"), compare(alone, "old")
    ratio = statistics.median(
        e.wall / max(o.wall, 1e-12) for o, e in zip(steps["old"], steps["extended"], strict=True)
    )
    rows = [["training step", r.name, r.median_s * 1e3, 1 / r.paired_speedup] for r in step_rows]
    rows += [
        ["agreement alone", r.name, r.median_s * 1e3, 1 / r.paired_speedup] for r in alone_rows
    ]
    emit(
        args,
        NAME,
        ["what", "variant", "median ms", "ratio to old (paired)"],
        rows,
        {
            "ranks": world.world_size,
            "step_ratio": ratio,
            "steps": [r.to_dict() for r in step_rows],
            "agreement": [r.to_dict() for r in alone_rows],
        },
        notes=[f"step time extended / old: {ratio:.3f} (median of per-round ratios)"],
        world=world,
    )
    return 0


class _NoPreemption:
    """The benchmark's steps run outside train(): no signal handlers, nothing requested."""

    requested = noticed = terminating = False
