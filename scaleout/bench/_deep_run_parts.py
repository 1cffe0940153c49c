"""Parts of ``scaleout bench gpudeep`` that run scaleout as a user does (the facts, the trainer's
capture path, the optimizers' compile): :mod:`scaleout.bench._deep_parts` runs them, one process
each."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

Result = tuple[str, str]


def _scaleout(args: list[str], timeout: float, env: dict[str, str] | None = None) -> Any:
    return subprocess.run(
        [sys.executable, "-m", "scaleout", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def part_facts(workdir: Path) -> Result:
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "PASS", (
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, "
        f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}; nofile {nofile}, "
        f"memlock {memlock}"
    )


def part_trainer(workdir: Path) -> Result:
    """The trainer's own capture path, prefetch workers, checkpoints and a resume (world of 1)."""
    run = workdir / "trainer"
    base = [
        "train",
        "bert_tiny_cpu",
        "model.cuda_graphs=true",
        "data.num_workers=2",
        "comm.algorithm=flat",
        "train.target=null",
        f"train.output_dir={run}",
        f"checkpoint.dir={run}/ck",
        "checkpoint.every_steps=6",
        "train.progress=false",
    ]
    first = _scaleout([*base, "train.max_steps=12", "train.eval_every=12"], timeout=40)
    second = _scaleout([*base, "train.max_steps=14", "train.eval_every=14"], timeout=28)
    text = first.stdout + first.stderr + second.stdout + second.stderr
    report = run / "report.json"
    resumed = json.loads(report.read_text()).get("resumed_from_step") if report.exists() else None
    failed_capture = "capturing the step failed" in text
    ok = first.returncode == 0 and second.returncode == 0 and resumed == 12 and not failed_capture
    return ("PASS" if ok else "FAIL"), (
        f"exits {first.returncode}/{second.returncode}; resumed from {resumed} (expected 12); "
        f"capture {'FAILED' if failed_capture else 'kept'}"
    )


def part_compile(workdir: Path) -> Result:
    """The one-pass LAMB / LARS on BERT-large shapes with an empty inductor cache: the first step
    (its cold compile), later steps, and the difference from the eager chain after 3 steps."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(workdir / "inductor")  # cold
    from scaleout.bench._gpuchecks import BERT_LARGE, _bert, _timed
    from scaleout.config.schema import OptimConfig
    from scaleout.optim import build_optimizer

    cells, ok = [], True
    for name in ("lamb", "lars"):
        finals = []
        first = later = 0.0
        for onepass in (True, False):
            model = _bert(BERT_LARGE, "cuda")
            gen = torch.Generator(device="cuda").manual_seed(0)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, device="cuda", generator=gen) * 1e-3
            opt = build_optimizer(model, OptimConfig(name=name, lr=1e-3))
            for group in getattr(opt, "optimizers", [opt]):
                if hasattr(group, "onepass"):
                    group.onepass = onepass
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.step()
            torch.cuda.synchronize()
            if onepass:
                first = time.perf_counter() - t0
            for _ in range(2):
                opt.step()
            finals.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
            if onepass:
                later = _timed(opt.step, 10)
            del model, opt
        diff = float((finals[0] - finals[1]).abs().max() / finals[1].abs().max())
        ok = ok and diff < 1e-4
        cells.append(
            f"{name.upper()} first step {first:.1f} s, then {later * 1e3:.1f} ms, "
            f"vs eager {diff:.1e}"
        )
    return ("PASS" if ok else "FAIL"), "; ".join(cells)
