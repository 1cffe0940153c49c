"""scaleout bench save: training steps while a checkpoint is written in the background vs without,
and the stall a save costs the training thread, asynchronous vs synchronous."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from scaleout.bench._harness import (
    add_config_arguments,
    add_standard_arguments,
    bench_config,
    check_counts,
    emit,
    set_threads,
)

NAME = "save"
HELP = "step time while an asynchronous checkpoint is written vs without; save stall async vs sync"
DESCRIPTION = """\
The trainer of --config (default configs/bert_tiny_cpu.yaml) in this one process. Each round runs
--steps training steps with no save in flight ("idle"), then starts an asynchronous save
(checkpoint.async: the state copied to host memory, a background thread writes, hashes and
commits it) and runs training steps for as long as that write is in flight ("saving"), then
waits for it. The test-only slow writer (SCALEOUT_TEST_SLOW_SAVE_S) makes every write take
--write-s seconds more, as a slow file system would (the issue's drill: 10 s). Rounds alternate so
machine noise hits both kinds of step. Reports the median step time of each and their ratio (the
bar: saving / idle within 1.10), the stall each asynchronous save cost the training thread, and,
once, the stall of a synchronous save (checkpoint.async=false) of the same state under the same
writer.

examples:
  scaleout bench save
  scaleout bench save --write-s 10 --steps 20 --repeats 3
"""

SMOKE_ARGS = [
    "--write-s",
    "0.2",
    "--steps",
    "2",
    "--repeats",
    "1",
    "data.source=synthetic",
    "data.max_seq_len=32",
    "data.max_predictions=5",
    "model.bert.vocab_size=64",
    "model.bert.hidden=16",
    "model.bert.layers=1",
    "model.bert.intermediate=32",
    "model.bert.max_position=32",
    "data.eval_samples=8",
    "train.global_batch=8",
]
DEFAULTS = ["train.global_batch=16", "train.progress=false", "train.peak_flops=1e12"]
BENCH_KEYS = ("checkpoint.dir", "checkpoint.async", "checkpoint.every_steps", "train.output_dir")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--write-s", type=float, default=10.0, help="extra seconds per write (default 10)"
    )
    p.add_argument("--steps", type=int, default=10, help="idle steps per round (default 10)")
    add_standard_arguments(p, NAME, repeats=3, threads=0)
    add_config_arguments(p, "bert_tiny_cpu", "the model and data")


def _trainer(run: Any, world: Any, directory: str, steps: int) -> Any:
    from scaleout.goodput import preempt  # deferred: torch, only when the benchmark runs
    from scaleout.train.trainer import Trainer  # deferred: as above

    cfg = run.model_copy(deep=True)
    cfg.checkpoint.dir = f"{directory}/ckpt"
    cfg.checkpoint.async_ = True
    cfg.train.output_dir = f"{directory}/out"
    # the loop here drives the steps (past max_steps too: the data wraps around by epochs);
    # max_steps sizes data.source=synthetic's sample set
    cfg.train.max_steps = steps
    cfg.optim.total_steps = 10**6
    return Trainer(cfg, world, preemption=preempt.install())


def _step(trainer: Any) -> float:
    t0 = time.perf_counter()
    trainer.train_step(trainer.step)
    trainer.step += 1
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    import scaleout  # deferred: torch, only when the benchmark runs
    import scaleout.checkpoint as ckpt  # deferred: as above

    check_counts(args, repeats=1, steps=1)
    if args.write_s < 0:
        raise ckpt.UserError(f"--write-s {args.write_s}: expected seconds >= 0")
    run_cfg = bench_config(args, DEFAULTS, BENCH_KEYS)
    set_threads(args)
    idle: list[float] = []
    saving: list[float] = []
    stalls: list[float] = []
    os.environ[ckpt.SLOW_SAVE_VARIABLE] = str(args.write_s)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            world = scaleout.init()
            trainer = _trainer(run_cfg, world, tmp, 2 + 2 * args.repeats * args.steps)
            for _ in range(2):  # warm-up: allocator, first-step work
                _step(trainer)
            for r in range(args.repeats):
                idle += [_step(trainer) for _ in range(args.steps)]
                t0 = time.perf_counter()
                trainer.save_checkpoint()
                stalls.append(time.perf_counter() - t0)
                during = []
                while trainer.checkpointer.in_flight:
                    during.append(_step(trainer))
                saving += during[:-1] or during  # the last step ended after the write did
                error = trainer.checkpointer.wait()
                if error is not None:
                    raise error
                print(
                    f"round {r + 1}/{args.repeats}: {len(during)} steps during the write",
                    file=sys.stderr,
                    flush=True,
                )
            error = trainer.checkpointer.close()
            if error is not None:
                raise error
            trainer.checkpointer.asynchronous = False  # the synchronous path, same state
            t0 = time.perf_counter()
            trainer.save_checkpoint()
            sync_stall = time.perf_counter() - t0
            trainer.preemption.uninstall()
    finally:
        del os.environ[ckpt.SLOW_SAVE_VARIABLE]
    if not saving:
        raise ckpt.UserError(
            "no training step ran while a write was in flight: raise --write-s or --steps"
        )
    med_idle, med_saving = statistics.median(idle), statistics.median(saving)
    ratio = med_saving / med_idle
    rows = [
        ["idle (no save in flight)", len(idle), f"{med_idle * 1e3:.1f}", "1.00"],
        ["saving (write in flight)", len(saving), f"{med_saving * 1e3:.1f}", f"{ratio:.2f}"],
    ]
    emit(
        args,
        NAME,
        ["steps", "n", "median step ms", "ratio"],
        rows,
        {
            "args": {
                k: v for k, v in vars(args).items() if not callable(v) and not k.startswith("_")
            },
            "idle_s": idle,
            "saving_s": saving,
            "ratio_saving_over_idle": ratio,
            "async_stall_s": stalls,
            "sync_stall_s": sync_stall,
            "write_extra_s": args.write_s,
        },
        notes=[
            f"\nsteps during the write / without: {ratio:.3f} (bar: <= 1.10)",
            f"stall per save: async median {statistics.median(stalls) * 1e3:.1f} ms, "
            f"sync {sync_stall * 1e3:.0f} ms (writer +{args.write_s:g} s)",
        ],
    )
    return 0
