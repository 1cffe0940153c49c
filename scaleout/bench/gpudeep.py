"""scaleout bench gpudeep: the one-GPU deep check (scripts/gpu-deep-check.sh), under 8 minutes.

What one GPU can show about the paths the CPU suite only emulates (review gpu-day-two, "A <=
8-minute single-GPU check"): each part runs in a child process with its own time cap, in priority
order, so a run cut short still answers the blocker-class questions first; a part that crashes,
hangs past its cap or measures the wrong thing is a FAIL row, never a silent pass. The parts live in
:mod:`scaleout.bench._deep_parts` (one process each) and :mod:`scaleout.bench._deep_emu` (the
multi-rank part's rank program).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scaleout.argtypes import parse_csv
from scaleout.bench._harness import add_standard_arguments, emit

NAME = "gpudeep"
HELP = "one-GPU deep check: ranks sharing a GPU over gloo, captured NCCL, watchdog, JPEG race, ..."
DESCRIPTION = """\
The one-GPU deep check (< 8 min on one H100/H200): parts in priority order, each in its own process
under its own cap (seconds), a table of part | result | number | seconds at the end, JSON with the
same rows, exit status 1 if any part FAILs. Without CUDA every part is SKIP ("no GPU") and the exit
status is 0, unless nvidia-smi lists a GPU torch cannot see (exit 1).

  facts      (15)  versions, NCCL, the open-file and locked-memory limits
  emu        (95)  4 ranks on cuda:0 over gloo as 2 emulated nodes x 2: the real Trainer with the
                   hierarchical all-reduce, flat and the node-sharded LAMB (weights agree), a
                   comm-stream delay (results unchanged), the autograd hook thread, and a
                   non-contiguous hierarchical all-reduce with the caller allocating meanwhile
  capture    (40)  a CUDA graph of a real NCCL all-reduce issued through scaleout's comm stream,
                   a pin-memory DataLoader thread alive throughout: 50 replays sum right
  watchdog   (40)  a 1-rank NCCL all-reduce queued behind a 30 s kernel with a 5 s timeout: the
                   rank must end with scaleout's verdict (a line naming it, or a verdict file),
                   not a bare SIGABRT
  jpeg       (30)  nvJPEG decode against freed blocks of queued kernels, and the evaluation's
                   pixels equal to a synchronised decode (needs torchvision; FAIL without it)
  group_bn   (25)  group BN's fused kernels (1-rank NCCL group) vs BatchNorm2d, bf16 channels_last
  trainer    (70)  the trainer's capture path with prefetch workers, checkpoints and a resume
  compile    (80)  one-pass LAMB/LARS: the cold compile of the first step, later steps, vs eager
  bert       (80)  the flagship per-GPU BERT-large step (2 packed rows x 512, static shapes, bf16,
                   StepGraphs + LAMB): step time, tokens/s, MFU

examples:
  bash scripts/gpu-deep-check.sh
  scaleout bench gpudeep --only facts,emu --out bench-results/gpudeep.json
"""

# (part, cap in seconds), in the order they run: the caps sum to 475 s (< 8 min)
PARTS = (
    ("facts", 15),
    ("emu", 95),
    ("capture", 40),
    ("watchdog", 40),
    ("jpeg", 30),
    ("group_bn", 25),
    ("trainer", 70),
    ("compile", 80),
    ("bert", 80),
)
SMOKE_ARGS = ["--only", "facts,emu"]  # without CUDA: every part SKIP ("no GPU"), exit 0
HEADERS = ["part", "result", "number", "seconds"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    names = ",".join(n for n, _ in PARTS)
    p.add_argument("--only", default=names, help=f"comma list of parts (default all: {names})")
    add_standard_arguments(p, NAME)


def run_part(name: str, cap: float, workdir: Path) -> list[str]:
    """One part in a child process under ``cap`` seconds: [part, result, number, seconds]."""
    out = workdir / f"{name}.json"
    log = workdir / f"{name}.log"
    argv = [sys.executable, "-m", "scaleout.bench._deep_parts", name, str(out), str(workdir)]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            proc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=cap)
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    seconds = f"{time.perf_counter() - t0:.0f}"
    if rc is None:
        return [name, "FAIL", f"over its {cap:g} s cap (log {log})", seconds]
    if out.exists():
        r = json.loads(out.read_text())
        return [name, r["result"], r["number"], seconds]
    tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return [name, "FAIL", f"exit {rc}: {tail[-1][:160] if tail else 'no output'}", seconds]


def run(args: argparse.Namespace) -> int:
    import torch

    from scaleout.bench.gpucheck import invisible_gpus_reason, listed_gpus

    caps = dict(PARTS)
    only = parse_csv(args.only, "--only", choices=tuple(caps))
    t0 = time.perf_counter()
    gpu = torch.cuda.is_available()
    listed = [] if gpu else listed_gpus()
    rows: list[list[str]] = []
    if not gpu:
        why = invisible_gpus_reason(listed) if listed else "no GPU (torch.cuda.is_available())"
        result = "FAIL" if listed else "SKIP"
        rows = [[name, result, why, "0"] for name, _ in PARTS if name in only]
    else:
        keep = os.environ.get("SCALEOUT_DEEP_DIR")  # the parts' logs and JSON, kept if set
        with tempfile.TemporaryDirectory(prefix="scaleout-gpudeep-") as tmp:
            workdir = Path(keep or tmp)
            workdir.mkdir(parents=True, exist_ok=True)
            for name, cap in PARTS:
                if name in only:
                    rows.append(run_part(name, float(cap), workdir))
                    print(" | ".join(rows[-1]), flush=True)  # progress, as each part ends
    failed = [r[0] for r in rows if r[1] == "FAIL"]
    emit(
        args,
        NAME,
        HEADERS,
        rows,
        {
            "rows": [dict(zip(HEADERS, r, strict=True)) for r in rows],
            "failed": failed,
            "seconds": time.perf_counter() - t0,
        },
        notes=[
            f"\n{len(rows)} parts, {len(failed)} failed ({', '.join(failed) or 'none'}) in "
            f"{time.perf_counter() - t0:.0f} s" + ("" if gpu else ": no GPU, nothing was checked")
        ],
    )
    return 1 if failed else 0
