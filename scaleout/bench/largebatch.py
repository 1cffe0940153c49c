"""scaleout bench largebatch: why LAMB exists — steps to a target at the base batch vs 8x the batch.

Three single-process trainings of the same config to the same masked-LM accuracy target, in one run:
LAMB at the base batch, LAMB at ``factor`` x the batch, AdamW at ``factor`` x the batch. The large-batch
runs scale the learning rate by sqrt(factor) (You et al. 2019, arXiv 1904.00962, sec. 4: square-root
scaling for LAMB) and keep warm-up constant in samples. Perfect scaling would need 1/factor of the base
steps; the bar for LAMB is <= 1/5, and AdamW at the same batch should need more.
"""

from __future__ import annotations

import argparse
import math
import tempfile

NAME = "largebatch"
HELP = "steps to a target: LAMB at the base batch vs LAMB and AdamW at 8x the batch (one run)"
DESCRIPTION = __doc__ + """
examples:
  scaleout bench largebatch                                  # tiny BERT, base batch 8 rows, target 0.10
  scaleout bench largebatch --base-batch 16 --target 0.12 --adamw-lr 1e-3
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="bert_tiny_cpu", help="config (default bert_tiny_cpu)")
    p.add_argument("--base-batch", type=int, default=8, help="base global batch in rows (default 8)")
    p.add_argument("--factor", type=int, default=8, help="large batch = factor x base (default 8)")
    p.add_argument("--target", type=float, default=0.10, help="eval metric to reach (default 0.10 MLM accuracy)")
    p.add_argument("--lamb-lr", type=float, default=1e-2, help="LAMB learning rate at the base batch")
    p.add_argument("--adamw-lr", type=float, default=1e-3, help="AdamW learning rate at the base batch")
    p.add_argument("--base-steps", type=int, default=2400, help="step budget at the base batch (default 2400)")
    p.add_argument("--base-warmup", type=int, default=80, help="warm-up steps at the base batch")
    p.add_argument("--eval-every", type=int, default=40, help="eval interval at the base batch (divided by factor)")
    p.add_argument("--out", default="bench-results/largebatch.json", help="JSON output")
    p.add_argument("overrides", nargs="*", help="extra config overrides, e.g. model.bert.layers=1")


def _train(args: argparse.Namespace, name: str, batch: int, lr: float, scale: int) -> dict:
    from scaleout.config import load_config
    from scaleout.train import run_training

    steps = max(args.base_steps // scale, 1)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(args.config, [
            *args.overrides, "launch.env=single", f"optim.name={name}", f"optim.lr={lr}",
            f"train.global_batch={batch}", f"train.max_steps={steps}", f"optim.total_steps={steps}",
            f"optim.warmup_steps={max(args.base_warmup // scale, 1)}", f"train.target={args.target}",
            f"train.eval_every={max(args.eval_every // scale, 1)}", f"train.output_dir={tmp}",
            "checkpoint.dir=null", "train.progress=false", "comm.algorithm=flat",
        ])
        result = run_training(cfg, config_file=str(args.config))
    return {"optimizer": name, "batch": batch, "lr": lr, "max_steps": steps, "status": result.status,
            "steps": result.steps if result.status == "success" else None, "final_metric": result.metric}


def run(args: argparse.Namespace) -> int:
    from scaleout.bench.common import format_table, write_json

    f = args.factor
    runs = [("lamb", args.base_batch, args.lamb_lr, 1), ("lamb", args.base_batch * f, args.lamb_lr * math.sqrt(f), f),
            ("adamw", args.base_batch * f, args.adamw_lr * math.sqrt(f), f)]
    rows = []
    for i, (name, batch, lr, scale) in enumerate(runs, 1):
        print(f"[{i}/{len(runs)}] {name} batch {batch} lr {lr:.3g} ...", flush=True)
        rows.append(_train(args, name, batch, lr, scale))
        r = rows[-1]
        print(f"      -> {r['status']}, steps {r['steps']}, metric {r['final_metric']:.4f}", flush=True)
    base = rows[0]["steps"]
    table = []
    for r in rows:
        ratio = (r["steps"] / base) if (r["steps"] and base) else None
        table.append([r["optimizer"], r["batch"], f"{r['lr']:.3g}", r["steps"] or f"not reached ({r['max_steps']})",
                      f"{r['final_metric']:.4f}", f"{ratio:.3f}" if ratio else "-"])
    print(format_table(["optimizer", "global batch", "lr", f"steps to {args.target}", "final metric",
                        "steps / base steps"], table))
    lamb8, adam8 = rows[1]["steps"], rows[2]["steps"]
    verdict = {
        "lamb_large_within_one_fifth": bool(base and lamb8 and lamb8 <= base / 5),
        "adamw_large_worse_than_lamb_large": bool(lamb8 and (adam8 is None or adam8 > lamb8)),
    }
    print(f"LAMB at {f}x batch needs <= 1/5 of the base steps: {verdict['lamb_large_within_one_fifth']}; "
          f"AdamW at {f}x does worse than LAMB at {f}x: {verdict['adamw_large_worse_than_lamb_large']}")
    path = write_json(args.out, {"runs": rows, "verdict": verdict, "target": args.target, "factor": f})
    if path:
        print(f"wrote {path}")
    return 0
