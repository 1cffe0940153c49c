"""scaleout bench precision: the same training run in fp32, bf16 and fp16: loss curves and step
time."""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
import time
from typing import TYPE_CHECKING, Any

import scaleout
from scaleout.argtypes import parse_csv
from scaleout.bench._harness import (
    add_config_arguments,
    add_standard_arguments,
    bench_config,
    emit,
)

if TYPE_CHECKING:
    from scaleout.config.schema import Config
    from scaleout.world import World

NAME = "precision"
HELP = (
    "train.precision fp32 vs bf16 vs fp16 on one config: loss curve agreement, step time, what "
    "the CPU supports"
)
DESCRIPTION = """\
Runs the real trainer (scaleout.train.trainer.Trainer, one process) on --config once per precision,
from the same initial weights and the same data order, and compares each run with the fp32 baseline
of the same invocation: step time (median wall and thread-CPU time over the steps after
train.timing_skip_steps; the speed-up is taken on CPU time, which other jobs on the machine do not
inflate; --threads 1 by default), the loss curve (moving mean over --window steps; the largest
relative gap to fp32 and the final one), the final masked-LM / top-1 evaluation, and for fp16 the
loss scale and the steps it skipped. The verdict: every low-precision curve stays within --tolerance
(relative) of fp32 after the first --window steps. Also prints which low-precision instructions this
CPU reports (/proc/cpuinfo: avx512_bf16, amx_bf16, avx512_fp16, ...) and torch's CPU capability.
JSON with the curves, and a PNG of them.

examples:
  scaleout bench precision
  scaleout bench precision --precisions fp32,bf16 --tolerance 0.03 train.max_steps=300
Config keys are overrides (key=value, over DEFAULTS: train.max_steps=200, train.global_batch=32,
train.timing_skip_steps=3); the keys every run sets itself (train.precision, eval, output) are
refused.
"""

SMOKE_ARGS = [
    "--window",
    "2",
    "--precisions",
    "fp32,bf16",
    "data.source=synthetic",
    "data.eval_samples=8",
    "train.max_steps=4",
    "train.timing_skip_steps=1",
    "train.global_batch=4",
]
# On top of --config; the overrides win. Steps per run, global batch, steps left out of the timing.
DEFAULTS = ["train.max_steps=200", "train.global_batch=32", "train.timing_skip_steps=3"]
# Set for every run by the benchmark (one process, an eval at the end only, no target, no
# checkpoints, the precision under test): refused as overrides.
BENCH_KEYS = (
    "launch.env",
    "train.grad_accum",
    "train.eval_every",
    "train.target",
    "checkpoint.dir",
    "checkpoint.every_steps",
    "train.progress",
    "train.output_dir",
    "train.precision",
)
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
        "--precisions", default="fp32,bf16,fp16", help="comma list; fp32 is always run first"
    )
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
    add_config_arguments(p, "bert_tiny_cpu", "run config, under DEFAULTS")


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


NATIVE_BF16 = ("avx512_bf16", "amx_bf16")


def bf16_slowdown(rows: int = 1024, width: int = 128, repeats: int = 20) -> float:
    """Measured here: the time of a ``rows x width`` by ``width x 3*width`` matmul under CPU
    bf16 autocast over the same in fp32, one thread, best of ``repeats`` (a transformer layer's
    shape at the tiny configs' width). Without native bf16 instructions (:data:`NATIVE_BF16`)
    torch converts and multiplies in software, an order of magnitude slower than fp32 (13.7x on
    an AVX2-only EPYC)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, w = torch.randn(rows, width), torch.randn(3 * width, width)

        def best() -> float:
            out = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                a @ w.t()
                out = min(out, time.perf_counter() - t)
            return out

        best()
        fp32 = best()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            best()
            bf16 = best()
    finally:
        torch.set_num_threads(threads)
    return bf16 / max(fp32, 1e-9)


def bf16_warning(precisions: set[str]) -> str | None:
    """One warning line when a run of ``precisions`` uses bf16 on a CPU without
    :data:`NATIVE_BF16`, with the slowdown measured here; None otherwise."""
    if "bf16" not in precisions:
        return None
    support = cpu_support()
    if any(f in support["flags"] for f in NATIVE_BF16):
        return None
    return (
        f"warning: this CPU ({support['model'] or 'unknown'}) has no native bf16 "
        f"({' or '.join(NATIVE_BF16)}): bf16 autocast is emulated, a matmul {bf16_slowdown():.1f}x "
        "slower than in fp32 here; the times measure that emulation (train.precision=fp32 for "
        "both sides, or a CPU with bf16)"
    )


def smooth(xs: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x - (xs[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def _train(cfg: Config, world: World) -> dict[str, Any]:
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
    t = bench_config(args, DEFAULTS, BENCH_KEYS).train  # a bad key: one line, before any run
    if t.max_steps <= t.timing_skip_steps or args.window < 1:
        raise UserError(
            f"train.max_steps={t.max_steps} must exceed train.timing_skip_steps="
            f"{t.timing_skip_steps}; --window={args.window} >= 1"
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
            f"\n{'PASS' if ok else 'FAIL'}: every curve within {args.tolerance:.0%} of fp32 after "
            f"step {args.window}"
        ],
        plot=lambda plt: _plot(plt, runs, args),
    )
    return 0 if ok else 1


def _runs(args: argparse.Namespace, names: list[str]) -> dict[str, dict[str, Any]]:
    """The same run of the config in each precision, from the same weights and data order."""

    from scaleout.config import load_config

    tmp = tempfile.mkdtemp(prefix="bench-precision-")
    cfg = bench_config(args, DEFAULTS, BENCH_KEYS)
    base = [
        *DEFAULTS,
        *args.overrides,
        "launch.env=single",
        "train.grad_accum=1",
        f"train.eval_every={cfg.train.max_steps}",
        "train.target=null",
        "checkpoint.dir=null",
        "checkpoint.every_steps=0",
        "train.progress=false",
        f"train.output_dir={tmp}",
    ]
    world = scaleout.init(load_config(args.config, base))
    runs: dict[str, dict[str, Any]] = {}
    try:
        for name in names:
            print(f"  training {cfg.train.max_steps} steps in {name} ...", flush=True)
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
