"""scaleout plot: a training run's loss and eval curves (from its metrics.jsonl) to a PNG."""

from __future__ import annotations

import argparse

NAME = "plot"
ORDER = 40
HELP = "draw a run's loss, learning-rate and eval curves (RUN_DIR/metrics.jsonl) to a PNG"
DESCRIPTION = """\
scaleout plot RUN_DIR [--out PNG]

Reads the metrics file every `scaleout train` writes on rank 0 (<train.output_dir>/metrics.jsonl:
one record per train.log_every steps and one per evaluation; a resumed run's repeated steps count
once, the latest) and draws the training loss with the learning rate, and the eval metric against
its target. The end of a run draws the same picture to RUN_DIR/metrics.png when matplotlib is
installed.

examples:
  scaleout plot runs/bert_tiny_cpu
  scaleout plot runs/bert_tiny_cpu --out loss.png
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "run_dir", help="a run's output directory (train.output_dir), holding metrics.jsonl"
    )
    p.add_argument("--out", default=None, help="PNG path (default RUN_DIR/metrics.png)")


def run(args: argparse.Namespace) -> int:
    from scaleout.telemetry.metrics import plot_run, read_metrics

    data = read_metrics(args.run_dir)  # one-line error when there is no metrics file
    train, evals = data["train"], data["eval"]
    if train:
        print(
            f"{len(train)} training records, steps {train[0]['step']}..{train[-1]['step']}, "
            f"loss {train[0]['loss']:.4f} -> {train[-1]['loss']:.4f}"
        )
    if evals:
        best = max(evals, key=lambda r: r["value"])
        print(
            f"{len(evals)} evaluations, best {best['metric']} {best['value']:.4f} at step "
            f"{best['step']}"
        )
    path = plot_run(args.run_dir, args.out)
    if path is None:
        return 1
    print(f"wrote {path}")
    return 0
