"""nccl-tests habits for ``scaleout bench allreduce``: ``-b/-e/-f`` size ranges, a rank-dependent
fill checked after the in-place all-reduce (``#wrong``), and output laid out as nccl-tests'
all_reduce_perf prints it (size in bytes, count, type, redop, root, time in microseconds, algbw,
busbw, #wrong, and an ``# Avg bus bandwidth`` line), so a line of this bench sits next to a line of
a cluster's nccl-tests log.

Differences, on purpose: scaleout's all-reduce works in place only, so there are no out-of-place
columns; the time is the median of ``-n`` runs, each the slowest rank's (nccl-tests: the mean of
``-n`` back-to-back runs); one block per algorithm.
"""

from __future__ import annotations

from typing import Any

# nccl-tests' names for the element types (src/common.cu: test_typenames)
TYPE_NAMES = {"float32": "float", "float16": "half", "bfloat16": "bfloat16"}
CHECK_CHUNK = 1 << 20  # elements compared at a time: no full-size float64 copy of a 256 MiB message


def size_range(minbytes: int, maxbytes: int, factor: int) -> list[int]:
    """nccl-tests' -b MIN -e MAX -f FACTOR: MIN, MIN*F, ... up to MAX."""
    from scaleout.errors import UserError

    if minbytes < 1 or maxbytes < minbytes:
        raise UserError(f"-b {minbytes} -e {maxbytes}: expected 1 <= minbytes <= maxbytes")
    if factor < 2:
        raise UserError(f"-f {factor}: expected a step factor >= 2")
    out, size = [], minbytes
    while size <= maxbytes:
        out.append(size)
        size *= factor
    return out


def fill(n: int, rank: int, dtype: Any, device: Any) -> Any:
    """Rank-dependent small integers (exact in every dtype the bench takes): i % 7 + rank % 3."""
    import torch

    return (torch.arange(n, device=device).remainder_(7) + rank % 3).to(dtype)


def count_wrong(result: Any, world_size: int) -> int:
    """Elements of an in-place sum all-reduce of :func:`fill` that differ from the exact sum.
    Tolerance 0 in fp32 (the sums are integers below 2^24); half and bfloat16 round the sums, so
    p ulps there."""
    import torch

    p = world_size
    offset = sum(r % 3 for r in range(p))
    eps = 0.0 if result.dtype == torch.float32 else torch.finfo(result.dtype).eps * p
    flat = result.reshape(-1)
    wrong = 0
    for start in range(0, flat.numel(), CHECK_CHUNK):
        got = flat[start : start + CHECK_CHUNK].double()
        idx = torch.arange(start, start + got.numel(), device=got.device, dtype=torch.float64)
        want = torch.remainder(idx, 7) * p + offset
        wrong += int(((got - want).abs() > eps * want.abs()).sum())
    return wrong


def format_block(rows: list[dict[str, Any]], label: str, world: str) -> str:
    """One algorithm's rows as nccl-tests prints them, with its average bus bandwidth."""
    lines = [
        f"# algorithm: {label} ({world})",
        "#" + " " * 62 + "in-place",
        f"#{'size':>11} {'count':>13} {'type':>9} {'redop':>7} {'root':>7} {'time':>8} "
        f"{'algbw':>7} {'busbw':>7} "
        f"{'#wrong':>6}",
        f"#{'(B)':>11} {'(elements)':>13} {'':>9} {'':>7} {'':>7} {'(us)':>8} {'(GB/s)':>7} "
        f"{'(GB/s)':>7} {'':>6}",
    ]
    for r in rows:
        lines.append(
            f"{r['nbytes']:>12} {r['count']:>13} {TYPE_NAMES.get(r['torch_dtype'], r['dtype']):>9} "
            f"{'sum':>7} "
            f"{-1:>7} {r['time_s'] * 1e6:>8.1f} {r['algbw'] / 1e9:>7.2f} {r['busbw'] / 1e9:>7.2f} "
            f"{r['wrong']:>6}"
        )
    avg = sum(r["busbw"] for r in rows) / max(len(rows), 1) / 1e9
    wrong = sum(r["wrong"] for r in rows)
    lines.append(f"# Wrong elements       : {wrong} {'OK' if not wrong else 'FAILED'}")
    lines.append(f"# Avg bus bandwidth    : {avg:.4g}")
    return "\n".join(lines)
