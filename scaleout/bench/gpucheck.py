"""scaleout bench gpucheck: the GPU half of the flagship path in one command
(scripts/gpu-check.sh)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import scaleout
from scaleout.argtypes import parse_csv
from scaleout.bench._harness import add_standard_arguments, emit
from scaleout.comm import ALGORITHMS

NAME = "gpucheck"
HELP = (
    "GPU acceptance: NCCL world, bf16/fp16 training, CUDA graphs, varlen, optimizers, "
    "BERT-large MFU, ResNet-50 img/s, all-reduce"
)
DESCRIPTION = """\
What the CPU test suite cannot show, checked on the GPUs of this machine in one go (< 8 min on one
H100/H200): a table of check | result | number | expected, JSON with the same rows, and exit status
1 if any check FAILs. Without CUDA every GPU row is SKIP with the reason and the exit status is 0 --
unless `nvidia-smi -L` lists a GPU: then torch cannot see a GPU this machine has (a CPU build, a
CUDA build newer than the driver, CUDA_VISIBLE_DEVICES="") and the check FAILs with that reason,
exit status 1; so does a torch that sees fewer GPUs than nvidia-smi lists (CUDA_VISIBLE_DEVICES
left set). The dependencies row (the project's imports the GPU rows need) runs everywhere. The rows
measure what the shipped flagships run (scaleout/bench/_gpuflagship.py reads their configs).

  1. NCCL world of every GPU (scaleout launch --nproc-per-node <GPUs>: one process per GPU)
  2. tiny BERT (configs/bert_tiny_cpu.yaml) with the BERT flagship's comm settings (2 emulated
     nodes when the GPUs split evenly) and checkpoints, trained to its first evaluation in bf16 and
     in fp16 with dynamic loss scaling; the MLPerf log must name the precision that ran; bf16 then
     resumes from its checkpoint
  3. CUDA-graph capture of the packed BERT training step: loss, every gradient and the weights
     after one LAMB step equal to plain autograd's
  4. varlen (flash) attention equal to the padded masked-attention path on packed bf16 BERT
  5. scaleout LAMB / LARS step time vs torch's fused AdamW / SGD on BERT-large parameter shapes,
     and their DRAM bytes per parameter measured by Nsight Compute (ncu; SKIP without it), both
     within 1.5x
  6. packed BERT-large (24 layers, seq 512) bf16 training step: MFU at the flagship's per-GPU rows
     against the device's bf16 peak, the largest batch that fits beside it
  7. ResNet-50 bf16 channels_last training step from uint8 batches already on the GPU (input
     pipeline out, device normalisation in) at 35 / 64 / 128 images per GPU, eager and as a CUDA
     graph: images/s, >= 2,500 at the best batch on an A100-class part; plus the batched nvJPEG
     decode rate of data.decode=gpu (FAIL without torchvision when the ResNet flagship decodes on
     the GPU, as it does)
  8. with 2+ GPUs (as 2 emulated nodes): hierarchical and torus2d all-reduce bit-equal to NCCL's
     own, and their bus bandwidth next to NCCL's

examples:
  bash scripts/gpu-check.sh
  scaleout bench gpucheck --only nccl,bert_large --out bench-results/gpucheck.json
"""

CHECKS = (
    "nccl",
    "train",
    "capture",
    "varlen",
    "optimizers",
    "bert_large",
    "resnet50",
    "allreduce",
)
SMOKE_ARGS = ["--only", "nccl,capture"]  # without CUDA (nor nvidia-smi): GPU rows SKIP, exit 0
Row = tuple[str, str, str, str]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--only",
        default=",".join(CHECKS),
        help=f"comma list of checks (default all: {','.join(CHECKS)})",
    )
    p.add_argument(
        "--train-steps",
        type=int,
        default=50,
        help="tiny BERT steps before its evaluation (default 50)",
    )
    p.add_argument(
        "--timeout", type=float, default=150.0, help="seconds per launched sub-run (default 150)"
    )
    add_standard_arguments(p, NAME)
    p.add_argument(
        "--rank-part", choices=("world", "allreduce"), default=None, help=argparse.SUPPRESS
    )
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)


def _launch(nnodes: int, nproc: int, cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    argv = [
        sys.executable,
        "-m",
        "scaleout",
        "launch",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc),
        "--timeout",
        str(timeout),
        "--",
        *cmd,
    ]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 60)


def _tail(proc: subprocess.CompletedProcess) -> str:
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return lines[-1][:160] if lines else f"exit {proc.returncode}"


def _rank_json(
    nnodes: int, nproc: int, part: str, timeout: float
) -> tuple[dict[str, Any] | None, str]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "result.json"
        proc = _launch(
            nnodes,
            nproc,
            ["scaleout", "bench", "gpucheck", "--rank-part", part, "--result", str(path)],
            timeout,
        )
        if proc.returncode != 0 or not path.exists():
            return None, _tail(proc)
        return json.loads(path.read_text()), ""


def check_nccl(gpus: int, args: argparse.Namespace) -> list[Row]:
    r, err = _rank_json(1, gpus, "world", args.timeout)
    ok = r is not None and r["world_size"] == gpus and r["backend"] == "nccl" and r["sum"] == gpus
    number = (
        f"world {r['world_size']} x {r['device'].split(':')[0]}, {r['backend']}, sum {r['sum']:g}"
        if r
        else err
    )
    return [
        (
            "NCCL world of every GPU",
            "PASS" if ok else "FAIL",
            number,
            f"world size {gpus}, nccl, sum {gpus}",
        )
    ]


def _topology(gpus: int) -> tuple[int, int]:
    """(nodes, GPUs per node) the launched rows emulate: 2 nodes when the GPUs split evenly, so a
    hierarchical or torus all-reduce runs both its intra- and its inter-node phase."""
    return (2, gpus // 2) if gpus >= 2 and gpus % 2 == 0 else (1, gpus)


def check_train(gpus: int, args: argparse.Namespace) -> list[Row]:
    """Tiny BERT in bf16 and fp16 to its first evaluation with the BERT flagship's communication
    settings (``_gpuflagship.train_overrides``) and checkpoints; bf16 then resumes from its last
    checkpoint for two more steps."""
    from scaleout.bench import _gpuflagship as fl

    rows: list[Row] = []
    names = {"bf16": "bfloat16", "fp16": "fp16"}
    nodes, per_node = _topology(gpus)
    flagship = " ".join(fl.train_overrides())
    for prec in ("bf16", "fp16"):
        with fl.run_tmp() as tmp:
            t0 = time.perf_counter()
            steps = args.train_steps
            cmd = ["scaleout", "train", *fl.train_row_args(tmp, prec, steps)]
            proc = _launch(nodes, per_node, cmd, args.timeout)
            seconds = time.perf_counter() - t0
            log = Path(tmp, "out", "mlperf.log")
            report = Path(tmp, "out", "report.json")
            logged = (
                log.exists()
                and f'"lowest_numerical_precision_in_linear", "value": "{names[prec]}"'
                in log.read_text()
            )
            data = json.loads(report.read_text()) if report.exists() else {}
            saved = fl.checkpoints_in(Path(tmp, "ckpt"))
            ok = proc.returncode == 0 and logged and data.get("achieved") is not None
            resumed = "-"
            if ok and prec == "bf16":
                more = [
                    a if not a.startswith("train.max_steps=") else f"train.max_steps={steps + 2}"
                    for a in cmd
                ]
                again = _launch(nodes, per_node, more, args.timeout)
                after = json.loads(report.read_text()) if report.exists() else {}
                resumed = str(after.get("resumed_from_step"))
                ok = again.returncode == 0 and resumed == str(steps)
            ok = ok and len(saved) >= 1
            number = (
                f"mlm acc {data['achieved']:.4f} after {steps} steps, "
                f"{data.get('skipped_steps', 0)} skipped, {len(saved)} checkpoint(s), resumed "
                f"from {resumed}, {seconds:.0f} s"
                if data.get("achieved") is not None
                else (_tail(proc) if proc.returncode else "log/report missing the precision")
            )
            rows.append(
                (
                    f"tiny BERT {prec} train -> first eval ({nodes} x {per_node} GPU; {flagship})",
                    "PASS" if ok else "FAIL",
                    number,
                    f"exit 0, eval logged, MLPerf log says {names[prec]}, checkpoints"
                    + (f", resumes at step {steps}" if prec == "bf16" else ""),
                )
            )
    return rows


def check_allreduce(gpus: int, args: argparse.Namespace) -> list[Row]:
    if gpus < 2 or gpus % 2:
        return [
            (
                "hierarchical/torus2d all-reduce = NCCL",
                "SKIP",
                f"{gpus} GPU(s)",
                "needs an even number >= 2",
            )
        ]
    from scaleout.bench._gpuchecks import BUSBW_FRACTION_MIN

    r, err = _rank_json(2, gpus // 2, "allreduce", args.timeout)
    if r is None:
        return [("hierarchical/torus2d all-reduce = NCCL", "FAIL", err, "equal, busbw")]
    flat = r["flat"]["busbw_gbs"]
    rows = []
    for alg in [name for name in ALGORITHMS if name != "flat"]:
        a = r[alg]
        ok = a["equal"] and a["busbw_gbs"] >= BUSBW_FRACTION_MIN * flat
        rows.append(
            (
                f"{alg} all-reduce = NCCL (2 x {gpus // 2} GPUs, 256 MiB)",
                "PASS" if ok else "FAIL",
                f"{'equal' if a['equal'] else 'DIFFERENT'}; busbw {a['busbw_gbs']:.0f} GB/s vs "
                f"NCCL {flat:.0f} GB/s",
                f"bit-equal, busbw >= {BUSBW_FRACTION_MIN:.0%} of NCCL's",
            )
        )
    return rows


# What the GPU rows import beyond torch and numpy (the config schema, the YAML configs, the MLPerf
# log): present after scripts/setup.sh; a CPU run of the SKIP rows alone would never notice them
# missing.
DEPENDENCIES = ("yaml", "pydantic", "mlperf_logging")


def check_dependencies() -> Row:
    missing = [m for m in DEPENDENCIES if importlib.util.find_spec(m) is None]
    number = f"missing {', '.join(missing)}: run scripts/setup.sh" if missing else "all importable"
    return ("dependencies", "FAIL" if missing else "PASS", number, ", ".join(DEPENDENCIES))


def listed_gpus(timeout: float = 30.0) -> list[str]:
    """The GPUs `nvidia-smi -L` lists (its "GPU n: ..." lines); [] without nvidia-smi or when it
    fails (no driver: nothing that torch could use either)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip().startswith("GPU ")]


def invisible_gpus_reason(listed: list[str]) -> str:
    """One line: nvidia-smi lists GPUs and torch sees none (why the acceptance check must not
    pass)."""
    import torch

    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    why = (
        f"CUDA_VISIBLE_DEVICES={hidden!r}"
        if hidden is not None
        else "install a CUDA torch the driver supports (scripts/setup.sh keeps one)"
        if not torch.version.cuda
        else "is the driver older than that CUDA?"
    )
    return (
        f"nvidia-smi lists {len(listed)} GPU(s) ({listed[0].split(' (UUID')[0]}) but torch "
        f"{torch.__version__} ({build}) sees none: {why}"
    )


def _in_process(fn: Callable[..., list[Row]], name: str, *a: Any) -> list[Row]:
    try:
        return fn(*a)
    except Exception as exc:  # noqa: BLE001 -- a crashing check is a FAIL row, the others still run
        return [
            (
                name,
                "FAIL",
                f"{type(exc).__name__}: {str(exc).splitlines()[0][:140] if str(exc) else ''}",
                "no error",
            )
        ]


def _rank_part(args: argparse.Namespace) -> int:
    from scaleout.bench import _gpuchecks

    world = scaleout.init()
    try:
        out = (
            _gpuchecks.rank_world(world)
            if args.rank_part == "world"
            else _gpuchecks.rank_allreduce(world)
        )
        if world.rank == 0 and args.result:
            Path(args.result).write_text(json.dumps(out))
    finally:
        world.close()
    return 0


def run(args: argparse.Namespace) -> int:
    import torch

    if args.rank_part:
        return _rank_part(args)
    only = parse_csv(args.only, "--only", choices=CHECKS)
    t0 = time.perf_counter()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    env = (
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, {gpus} x "
        f"{torch.cuda.get_device_name(0)}"
        if gpus
        else f"torch {torch.__version__}, no CUDA device"
    )
    from scaleout.bench._gpuflagship import environment_row

    listed = listed_gpus()  # the machine's GPUs: torch must see every one (review §7)
    invisible = invisible_gpus_reason(listed) if listed and not gpus else ""
    rows: list[Row] = [environment_row(gpus, listed, env, invisible), check_dependencies()]
    rows += (
        _run_checks(only, gpus, args)
        if gpus
        else [
            (name, "SKIP", "no CUDA device (torch.cuda.is_available() is False)", "a GPU")
            for name in only
        ]
    )
    failed = [r[0] for r in rows if r[1] == "FAIL"]
    headers = ["check", "result", "number", "expected"]
    emit(
        args,
        NAME,
        headers,
        [list(r) for r in rows],
        {
            "rows": [dict(zip(headers, r, strict=True)) for r in rows],
            "failed": failed,
            "seconds": time.perf_counter() - t0,
        },
        notes=[
            f"\n{len(rows)} rows, {len(failed)} failed ({', '.join(failed) or 'none'}) in "
            f"{time.perf_counter() - t0:.0f} s"
        ],
    )
    if invisible:  # the one line that says why, after the table
        print(f"scaleout bench gpucheck: FAIL: {invisible}", file=sys.stderr)
    return 1 if failed else 0


def _run_checks(only: list[str], gpus: int, args: argparse.Namespace) -> list[Row]:
    from scaleout.bench import _gpuchecks as g
    from scaleout.bench import _gpuflagship as fl

    rows: list[Row] = []
    if "nccl" in only:
        rows += _in_process(check_nccl, "NCCL world of every GPU", gpus, args)
    if "train" in only:
        rows += _in_process(check_train, "tiny BERT train", gpus, args)
    local = [c for c in ("capture", "varlen", "optimizers", "bert_large", "resnet50") if c in only]
    if local:  # in this process, on cuda:0, as a world of one
        world = scaleout.init(environment="single")
        try:
            for c in local:
                fn = {
                    "capture": lambda: fl.check_capture(world),
                    "varlen": g.check_varlen,
                    "optimizers": lambda: g.check_optimizers() + fl.bytes_rows(g.OPT_RATIO_MAX),
                    "bert_large": lambda: g.check_bert_large(rows=fl.per_gpu_rows()),
                    "resnet50": lambda: (
                        g.check_resnet50(world) + g.check_gpu_decode(required=fl.needs_gpu_decode())
                    ),
                }[c]
                rows += _in_process(fn, c)
        finally:
            world.close()
    if "allreduce" in only:
        rows += _in_process(check_allreduce, "hierarchical/torus2d all-reduce", gpus, args)
    return rows
