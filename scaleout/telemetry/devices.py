"""Peak FLOP/s of the device a rank trains on: identified, measured, or honestly unknown.

MFU is only as good as its denominator. A GPU is identified from its device properties, not from a
substring of its name alone: an "H100" may be the SXM5 part (132 SMs, 989 TFLOP/s bf16), the PCIe
card (114 SMs, 756 TFLOP/s) or the NVL card (132 SMs, 94 GB, 835 TFLOP/s). A part is matched when
its name tokens, its SM count and its memory size all agree; anything else is *unknown*, and the
report then says so (MFU "unknown") instead of guessing or failing after training.

A CPU has no data-sheet number that means anything for a process that shares the machine's cores
with other ranks, so its peak is *measured*: the best matmul FLOP/s of this process in the run's
precision, cached per (CPU model, threads, dtype, torch version) under ``~/.cache/scaleout``
(``SCALEOUT_CACHE``) and scaled down when the ranks of this host ask for more threads than the
machine has cores.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scaleout.fsutil import atomic_write


@dataclass(frozen=True)
class Part:
    """One GPU part and its dense (no structured sparsity) tensor-core peaks, from its data
    sheet."""

    name: str
    tokens: tuple[str, ...]  # every one must appear in torch.cuda.get_device_name()
    sms: int  # multiprocessors (torch: multi_processor_count)
    mem_gib: tuple[float, float]  # total memory seen by CUDA, inclusive range in GiB
    bf16: float | None  # FLOP/s; None where the part has no bf16 tensor cores
    fp16: float
    tf32: float | None
    fp32: float  # non-tensor-core FP32
    source: str
    excludes: tuple[str, ...] = ()  # tokens that must NOT appear (e.g. "NVL" for the SXM part)


# Data-sheet numbers are halved where the sheet quotes "with sparsity".
PARTS: tuple[Part, ...] = (
    Part(
        "V100 SXM2",
        ("V100", "SXM2"),
        80,
        (15, 33),
        None,
        125e12,
        None,
        15.7e12,
        "NVIDIA V100 data sheet (SXM2: 125 TFLOPS tensor, 15.7 FP32)",
    ),
    Part(
        "V100 PCIe",
        ("V100", "PCIE"),
        80,
        (15, 33),
        None,
        112e12,
        None,
        14e12,
        "NVIDIA V100 data sheet (PCIe: 112 TFLOPS tensor, 14 FP32)",
    ),
    Part(
        "A100 SXM4",
        ("A100", "SXM4"),
        108,
        (38, 82),
        312e12,
        312e12,
        156e12,
        19.5e12,
        "NVIDIA A100 data sheet (BF16 312, TF32 156, FP32 19.5 TFLOPS)",
    ),
    Part(
        "A100 PCIe",
        ("A100", "PCIE"),
        108,
        (38, 82),
        312e12,
        312e12,
        156e12,
        19.5e12,
        "NVIDIA A100 data sheet (PCIe column: BF16 312, TF32 156, FP32 19.5 TFLOPS)",
    ),
    Part(
        "A10",
        ("A10",),
        72,
        (22, 24),
        125e12,
        125e12,
        62.5e12,
        31.2e12,
        "NVIDIA A10 data sheet (BF16 250 / TF32 125 TFLOPS with sparsity)",
        ("A100",),
    ),
    Part(
        "L4",
        ("L4",),
        58,
        (21, 24),
        121e12,
        121e12,
        60e12,
        30.3e12,
        "NVIDIA L4 data sheet (BF16 242 / TF32 120 TFLOPS with sparsity)",
        ("L40",),
    ),
    Part(
        "L40S",
        ("L40S",),
        142,
        (43, 48),
        362e12,
        362e12,
        183e12,
        91.6e12,
        "NVIDIA L40S data sheet (BF16 733 / TF32 366 TFLOPS with sparsity)",
    ),
    Part(
        "H100 SXM5",
        ("H100",),
        132,
        (75, 82),
        989e12,
        989e12,
        494e12,
        67e12,
        "NVIDIA H100 data sheet, SXM5 (BF16 1979 / TF32 989 TFLOPS with sparsity, FP32 67)",
        ("PCIE", "NVL"),
    ),
    Part(
        "H100 PCIe",
        ("H100", "PCIE"),
        114,
        (75, 82),
        756e12,
        756e12,
        378e12,
        51e12,
        "NVIDIA H100 data sheet, PCIe (BF16 1513 / TF32 756 TFLOPS with sparsity, FP32 51)",
    ),
    Part(
        "H100 NVL",
        ("H100", "NVL"),
        132,
        (88, 96),
        835e12,
        835e12,
        417e12,
        60e12,
        "NVIDIA H100 NVL data sheet (BF16 1671 / TF32 835 TFLOPS with sparsity, FP32 60)",
    ),
    Part(
        "H200 SXM",
        ("H200",),
        132,
        (125, 145),
        989e12,
        989e12,
        494e12,
        67e12,
        "NVIDIA H200 data sheet, SXM (BF16 1979 / TF32 989 TFLOPS with sparsity, FP32 67)",
        ("NVL", "GH200"),
    ),
    Part(
        "H200 NVL",
        ("H200", "NVL"),
        132,
        (125, 145),
        835e12,
        835e12,
        417e12,
        60e12,
        "NVIDIA H200 data sheet, NVL (BF16 1671 / TF32 835 TFLOPS with sparsity, FP32 60)",
        ("GH200",),
    ),
    Part(
        "GH200",
        ("GH200",),
        132,
        (94, 145),
        989e12,
        989e12,
        494e12,
        67e12,
        "NVIDIA GH200 data sheet (H100-class GPU: BF16 1979 TFLOPS with sparsity)",
    ),
)


@dataclass(frozen=True)
class Peak:
    """What the report needs: a name to print, the peak (None = unknown) and where it came from."""

    name: str
    flops: float | None
    source: str


def identify_gpu(name: str, sms: int, mem_bytes: int) -> Part | None:
    """The part whose name tokens, SM count and memory size all match; None when none (or
    several) do."""
    upper = name.upper()
    gib = mem_bytes / 2**30
    hits = [
        p
        for p in PARTS
        if all(t.upper() in upper for t in p.tokens)
        and not any(x.upper() in upper for x in p.excludes)
        and p.sms == sms
        and p.mem_gib[0] <= gib <= p.mem_gib[1]
    ]
    return hits[0] if len(hits) == 1 else None


def part_peak(part: Part, precision: str, allow_tf32: bool) -> float | None:
    """The part's peak for the precision the run's matmuls use."""
    if precision == "bf16":
        return part.bf16
    if precision == "fp16":
        return part.fp16
    return part.tf32 if allow_tf32 and part.tf32 else part.fp32


def gpu_peak(device: Any, precision: str) -> Peak:
    import torch

    props = torch.cuda.get_device_properties(device)
    part = identify_gpu(props.name, props.multi_processor_count, props.total_memory)
    desc = f"{props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB)"
    if part is None:
        return Peak(
            desc, None, "not in scaleout.telemetry.devices.PARTS: set train.peak_flops for an MFU"
        )
    flops = part_peak(part, precision, bool(torch.backends.cuda.matmul.allow_tf32))
    if flops is None:
        return Peak(
            part.name, None, f"{part.name} has no {precision} tensor cores in its data sheet"
        )
    return Peak(part.name, flops, part.source)


# -- CPU: measured
# ------------------------------------------------------------------------------------
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass

    return platform.processor() or platform.machine()


def measure_matmul_flops(dtype: Any, threads: int = 1, seconds: float = 0.2) -> float:
    """Peak matmul FLOP/s of ``threads`` threads: one thread's best over a few square sizes (the
    fastest size depends on the caches and the kernel, so it is found rather than assumed) times
    ``threads``.

    Timed by the measuring thread's own CPU time (``time.thread_time``), not the wall clock: on a
    shared or oversubscribed host the wall clock also counts the time other processes held the
    core, which would make the peak too low (and every MFU against it too high). Linear in
    threads: a peak, an upper bound."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = 0.0
        for n in (256, 512, 1024):
            a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
            a @ b  # warm-up: kernel selection, page faults
            reps, t0 = 0, time.thread_time()
            while time.thread_time() - t0 < seconds:
                a @ b
                reps += 1
            best = max(best, 2.0 * n**3 * reps / (time.thread_time() - t0))
        return best * max(1, threads)
    finally:
        torch.set_num_threads(before)


def _cache_file() -> Path:
    root = os.environ.get("SCALEOUT_CACHE") or Path.home() / ".cache" / "scaleout"
    return Path(root) / "cpu_peak.json"


def cpu_peak(precision: str, threads: int, ranks_on_host: int = 1, cache: bool = True) -> Peak:
    """Measured matmul peak of one rank: this process with ``threads`` threads, scaled by
    cores / (ranks_on_host x threads) when the host's ranks oversubscribe its cores."""
    import torch

    dtype = getattr(torch, _DTYPES[precision])
    key = f"{_cpu_model()}|one thread, CPU time|{_DTYPES[precision]}|torch={torch.__version__}"
    path = _cache_file()
    table: dict[str, float] = {}
    if cache:
        try:
            table = json.loads(path.read_text())
        except (OSError, ValueError):
            table = {}
    per_thread = table.get(key)
    if not isinstance(per_thread, (int, float)) or per_thread <= 0:
        per_thread = measure_matmul_flops(dtype, 1)
        if cache:
            table[key] = per_thread
            try:
                atomic_write(path, json.dumps(table, indent=1))
            except OSError:
                pass  # a read-only home only costs a re-measurement next time
    cores = os.cpu_count() or 1
    share = min(1.0, cores / max(ranks_on_host * threads, 1))
    note = f"measured {precision} matmul, {threads} thread(s)"
    if share < 1.0:
        note += f", x{share:.2f} for {ranks_on_host} ranks on {cores} cores"
    return Peak(f"cpu ({_cpu_model()})", per_thread * threads * share, note)


def device_peak(
    device: Any,
    precision: str = "fp32",
    override: float | None = None,
    threads: int | None = None,
    ranks_on_host: int = 1,
) -> Peak:
    """Peak FLOP/s per device for the report: ``override`` (train.peak_flops), a known GPU part,
    or a measured CPU peak. Never raises for an unknown device: the peak is then None."""
    import torch

    if override is not None:
        return Peak("configured", float(override), "train.peak_flops")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        return gpu_peak(dev, precision)
    if dev.type == "cpu":
        return cpu_peak(precision, threads or torch.get_num_threads(), ranks_on_host)
    return Peak(str(dev), None, f"no peak known for device type {dev.type!r}: set train.peak_flops")
