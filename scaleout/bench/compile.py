"""scaleout bench compile: tiny-BERT training step time, torch.compile vs eager, in one run."""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from typing import Any

from scaleout.bench._harness import (
    add_config_arguments,
    add_standard_arguments,
    bench_config,
    check_counts,
    compare,
    emit,
    interleave,
    set_threads,
)

NAME = "compile"
HELP = (
    "tiny BERT forward+backward+optimizer step on CPU: torch.compile (Inductor) vs eager, "
    "compile time apart"
)
DESCRIPTION = """\
Builds two copies of the same BERT (model.bert of --config, default configs/bert_tiny_cpu.yaml:
hidden 128, 2 layers, 2 heads, intermediate 512, vocab 4096; key=value overrides change it),
compiles one in place with scaleout.train.capture.compile_model (what model.compile=true does in the
trainer), and times a full training step (forward, backward, AdamW) on the same packed-shape batch
(--batch rows of data.max_seq_len tokens; train.seed, default 0 here, seeds the weights and the
batch). The first compiled step (tracing + code generation) is reported separately as compile time;
then eager and compiled steps alternate (--repeats each) so machine noise hits both, and the table
gives median wall and thread-CPU time per step and the speed-up compiled / eager, whichever wins.
Also reports the largest loss difference between the two over the timed steps (dropout 0: the same
math) as a correctness check.

examples:
  scaleout bench compile
  scaleout bench compile --batch 32 --repeats 10 --backend inductor \\
      --mode max-autotune-no-cudagraphs
  scaleout bench compile model.bert.hidden=256 model.bert.layers=4 data.max_seq_len=64
"""


SMOKE_ARGS = [
    "--backend",
    "eager",
    "--repeats",
    "1",
    "--batch",
    "1",
    "data.max_seq_len=16",
    "model.bert.hidden=32",
    "model.bert.layers=1",
    "model.bert.intermediate=64",
    "model.bert.vocab_size=128",
]
DEFAULTS = ["train.seed=0"]  # on top of --config; the overrides win
BENCH_KEYS = ("model.bert.dropout",)  # 0: eager and compiled do the same math (the loss check)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=16, help="rows per step (default 16)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument("--mode", default=None, help="torch.compile mode (default: torch's default)")
    add_standard_arguments(p, NAME, repeats=10, threads=1)
    add_config_arguments(p, "bert_tiny_cpu", "the model (model.bert) and data.max_seq_len")


def _steps(args: argparse.Namespace, run: Any) -> dict[str, Callable[[], float]]:
    """A full training step (forward, backward, AdamW) of two copies of one BERT: eager and
    compiled."""

    import numpy as np
    import torch

    from scaleout.families.bert.data.bert_batch import (
        build_batch,
        padded_packs,
        synthetic_sequences,
    )
    from scaleout.families.bert.model import BertForPreTraining
    from scaleout.train.capture import compile_model

    seq_len, seed = run.data.max_seq_len, run.train.seed
    cfg = run.model.bert.model_copy(update={"max_position": seq_len, "dropout": 0.0})
    seqs = synthetic_sequences(np.full(args.batch, seq_len), cfg.vocab_size, seed=seed)
    batch = build_batch(seqs, padded_packs(args.batch), seq_len)
    torch.manual_seed(seed)
    eager = BertForPreTraining(cfg).train()
    models = {
        "eager": eager,
        "compiled": compile_model(copy.deepcopy(eager), backend=args.backend, mode=args.mode),
    }

    def step(m: Any) -> Callable[[], float]:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True)

        def run() -> float:
            opt.zero_grad(set_to_none=True)
            loss = m(batch).loss
            loss.backward()
            opt.step()
            return float(loss.detach())

        return run

    return {k: step(m) for k, m in models.items()}


def run(args: argparse.Namespace) -> int:
    import torch

    check_counts(args, repeats=1, batch=1)
    run = bench_config(args, DEFAULTS, BENCH_KEYS)  # a bad key: one line, before any work
    set_threads(args)
    steps = _steps(args, run)
    print(f"compiling ({args.backend}) ...", file=sys.stderr, flush=True)
    first = interleave(
        {"compiled": steps["compiled"], "eager": steps["eager"]}, 1, alternate=False
    )  # compile apart
    compile_s, eager_first = first["compiled"][0].wall, first["eager"][0].wall
    samples = interleave(
        steps, args.repeats, say=lambda line: print(line, file=sys.stderr, flush=True)
    )
    rows = {r.name: r for r in compare(samples, baseline="eager")}
    diffs = [
        abs(c.value - e.value)
        for c, e in zip(
            samples["compiled"] + first["compiled"], samples["eager"] + first["eager"], strict=True
        )
    ]
    e, c = rows["eager"], rows["compiled"]
    winner = "compiled" if c.median_s < e.median_s else "eager"
    payback = (
        f"; compile took {compile_s:.1f} s, paid back after "
        f"{compile_s / max(e.median_s - c.median_s, 1e-9):.0f} "
        "steps"
        if winner == "compiled"
        else f" (compile took {compile_s:.1f} s)"
    )
    table = [
        [
            k,
            f"{r.median_s * 1e3:.1f}",
            f"{r.cpu_median_s * 1e3:.1f}",
            f"{r.speedup:.2f}x",
            f"{e.cpu_median_s / r.cpu_median_s:.2f}x" if r.cpu_median_s else "-",
            f"{compile_s:.1f}" if k == "compiled" else f"{eager_first:.2f}",
        ]
        for k, r in rows.items()
    ]
    emit(
        args,
        NAME,
        [
            "variant",
            "step ms (median wall)",
            "step ms (thread CPU)",
            "speed-up (wall)",
            "speed-up (CPU)",
            "first step s (compile)",
        ],
        table,
        {
            "args": {
                k: v for k, v in vars(args).items() if not callable(v) and not k.startswith("_")
            },
            "config": {
                "model.bert": run.model.bert.model_dump(mode="json"),
                "data.max_seq_len": run.data.max_seq_len,
                "train.seed": run.train.seed,
            },
            "compile_s": compile_s,
            "eager_first_step_s": eager_first,
            "median_wall_s": {k: r.median_s for k, r in rows.items()},
            "median_thread_cpu_s": {k: r.cpu_median_s for k, r in rows.items()},
            "speedup_wall": c.speedup,
            "max_loss_diff": max(diffs),
            "winner": winner,
            "steps": {k: [(t.wall, t.cpu) for t in ts] for k, ts in samples.items()},
        },
        notes=[
            f"\n{winner} wins: compiled/eager step time {c.median_s / e.median_s:.2f}{payback}",
            f"max |loss compiled - loss eager| over the steps: {max(diffs):.2e}",
            f"torch threads: {torch.get_num_threads()}",
        ],
    )
    return 0
