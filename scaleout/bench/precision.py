"""scaleout bench precision: the same training run in fp32, bf16 and fp16: loss curves and step time."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from scaleout.argtypes import parse_csv
from scaleout.bench._harness import add_standard_arguments, emit

if TYPE_CHECKING:
    from scaleout.config.schema import Config
    from scaleout.world import World

NAME = "precision"
HELP = "train.precision fp32 vs bf16 vs fp16 on one config: loss curve agreement, step time, what the CPU supports"
DESCRIPTION = """\
Runs the real trainer (scaleout.train.trainer.Trainer, one process) on CONFIG once per precision, from the
same initial weights and the same data order, and compares each run with the fp32 baseline of the same
invocation: step time (median wall and thread-CPU time over the steps after --warmup; the speed-up is
taken on CPU time, which other jobs on the machine do not inflate; --threads 1 by default), the loss curve (moving
mean over --window steps; the largest relative gap to fp32 and the final one), the final masked-LM /
top-1 evaluation, and for fp16 the loss scale and the steps it skipped. The verdict: every low-precision
curve stays within --tolerance (relative) of fp32 after the first --window steps. Also prints which
low-precision instructions this CPU reports (/proc/cpuinfo: avx512_bf16, amx_bf16, avx512_fp16, ...)
and torch's CPU capability. JSON with the curves, and a PNG of them.

examples:
  scaleout bench precision
  scaleout bench precision bert_tiny_cpu --steps 300 --precisions fp32,bf16 --tolerance 0.03
"""

SMOKE_ARGS = [
    "bert_tiny_cpu",
    "data.source=synthetic",
    "data.eval_samples=8",
    "--steps",
    "4",
    "--warmup",
    "1",
    "--window",
    "2",
    "--batch",
    "4",
    "--precisions",
    "fp32,bf16",
]
PRECISIONS = ("fp32", "bf16", "fp16")
CPU_FLAGS = (
    "avx512_bf16",
    "amx_bf16",
    "amx_tile",
    "avx512_fp16",
    "amx_fp16",
    "avx512_vnni",
    "avx512f",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "config", nargs="?", default="bert_tiny_cpu", help="run config (default bert_tiny_cpu)"
    )
    p.add_argument("overrides", nargs="*", help="config overrides key=value")
    p.add_argument(
        "--precisions", default="fp32,bf16,fp16", help="comma list; fp32 is always run first"
    )
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per run (default 200)")
    p.add_argument("--batch", type=int, default=32, help="global batch (default 32)")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the timing (default 3)")
    p.add_argument(
        "--window", type=int, default=20, help="moving-mean window of the loss curves (default 20)"
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.05,
        help="max relative gap of a curve to fp32 (default 0.05)",
    )
    add_standard_arguments(p, NAME, threads=1, png=True)


def cpu_support() -> dict[str, Any]:
    """The low-precision instructions this CPU reports, and what torch dispatches to."""
    import torch

    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        flags = []
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), ""
            )
    except OSError:
        pass
    return {
        "model": model,
        "flags": [f for f in CPU_FLAGS if f in flags],
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def smooth(xs: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x - (xs[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def _train(cfg: Config, world: World) -> dict[str, Any]:
    import contextlib
    import io
    import statistics
    import time

    from scaleout.train.trainer import Trainer

    trainer = Trainer(cfg, world)
    times: list[tuple[float, float]] = []
    step = trainer.train_step

    def timed(i: int) -> Any:
        t, c = time.perf_counter(), time.thread_time()
        try:
            return step(i)
        finally:
            times.append((time.perf_counter() - t, time.thread_time() - c))

    trainer.train_step = timed  # type: ignore[method-assign]
    with contextlib.redirect_stdout(io.StringIO()):
        result = trainer.train()
    kept = times[cfg.train.timing_skip_steps :] or times
    return {
        "losses": [float(x) for x in trainer.losses],
        "step_s": statistics.median(w for w, _ in kept),
        "step_cpu_s": statistics.median(c for _, c in kept),
        "metric": result.metric,
        "skipped": trainer.skipped,
        "loss_scale": trainer.task.precision.scale,
    }


def run(args: argparse.Namespace) -> int:
    import torch

    from scaleout.errors import UserError

    names = ["fp32"] + [
        p for p in parse_csv(args.precisions, "--precisions", choices=PRECISIONS) if p != "fp32"
    ]
    if args.steps <= args.warmup or args.window < 1:
        raise UserError(
            f"--steps={args.steps} must exceed --warmup={args.warmup}; --window={args.window} >= 1"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    support = cpu_support()
    print(
        f"CPU: {support['model']}; low-precision flags: {', '.join(support['flags']) or 'none'}; "
        f"torch CPU capability: {support['torch_cpu_capability']}",
        flush=True,
    )
    runs = _runs(args, names)
    ref = smooth(runs["fp32"]["losses"], args.window)
    rows, ok = [], True
    for name, r in runs.items():
        curve = smooth(r["losses"], args.window)
        gaps = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(curve, ref, strict=True)][
            args.window :
        ]
        r["max_rel_gap"], r["final_rel_gap"] = max(gaps, default=0.0), gaps[-1] if gaps else 0.0
        ok &= r["max_rel_gap"] <= args.tolerance
        rows.append(
            [
                name,
                f"{r['step_s'] * 1e3:.1f}",
                f"{r['step_cpu_s'] * 1e3:.1f}",
                f"{runs['fp32']['step_cpu_s'] / r['step_cpu_s']:.2f}x",
                f"{curve[-1]:.4f}",
                f"{r['max_rel_gap']:.2%}",
                f"{r['final_rel_gap']:.2%}",
                f"{r['metric']:.4f}" if r["metric"] is not None else "-",
                r["skipped"],
                f"{r['loss_scale']:g}" if name == "fp16" else "-",
            ]
        )
    emit(
        args,
        NAME,
        [
            "precision",
            "step ms (median wall)",
            "step ms (thread CPU)",
            "speed-up vs fp32 (CPU)",
            f"final loss (mean of {args.window})",
            "max gap to fp32",
            "final gap",
            "eval metric",
            "skipped steps",
            "loss scale",
        ],
        rows,
        {
            "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
            "cpu": support,
            "runs": runs,
            "within_tolerance": ok,
        },
        notes=[
            f"\n{'PASS' if ok else 'FAIL'}: every curve within {args.tolerance:.0%} of fp32 after step {args.window}"
        ],
        plot=lambda plt: _plot(plt, runs, args),
    )
    return 0 if ok else 1


def _runs(args: argparse.Namespace, names: list[str]) -> dict[str, dict[str, Any]]:
    """The same run of CONFIG in each precision, from the same weights and data order."""
    import tempfile

    import scaleout
    from scaleout.config import load_config

    tmp = tempfile.mkdtemp(prefix="bench-precision-")
    base = [
        *args.overrides,
        "launch.env=single",
        f"train.global_batch={args.batch}",
        "train.grad_accum=1",
        f"train.max_steps={args.steps}",
        f"train.eval_every={args.steps}",
        "train.target=null",
        "checkpoint.dir=null",
        "checkpoint.every_steps=0",
        "train.progress=false",
        f"train.timing_skip_steps={args.warmup}",
        f"train.output_dir={tmp}",
    ]
    world = scaleout.init(load_config(args.config, base))
    runs: dict[str, dict[str, Any]] = {}
    try:
        for name in names:
            print(f"  training {args.steps} steps in {name} ...", flush=True)
            runs[name] = _train(load_config(args.config, [*base, f"train.precision={name}"]), world)
    finally:
        world.close()
    return runs


def _plot(plt: Any, runs: dict[str, dict[str, Any]], args: argparse.Namespace) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in runs.items():
        ax.plot(
            smooth(r["losses"], args.window),
            label=f"{name} ({r['step_cpu_s'] * 1e3:.0f} ms CPU/step)",
        )
    ax.set(
        xlabel="step",
        ylabel=f"training loss (mean of {args.window})",
        title=f"{args.config}: precision",
    )
    ax.legend()
    return fig
