"""The reduce-scatter / all-gather runtimes the algorithms call (torch): on the world group, or in
two phases over a row x column grid (:mod:`scaleout.comm.grid`). The entry points that resolve an
algorithm and check the tensors are :mod:`scaleout.comm.shard`; this module sits below the
algorithm declarations (which import it when they run) and imports none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from scaleout.comm.grid import Grid, all_gather_tensor, reduce_scatter_tensor
from scaleout.comm.phasetime import CLOCK, COL, ROW

if TYPE_CHECKING:
    from scaleout.world import World

_reduce_scatter = reduce_scatter_tensor
_all_gather = all_gather_tensor


def world_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, world: World) -> None:
    """torch.distributed's reduce-scatter on the world group (rank r owns slice r)."""
    if world.world_size == 1:
        out.copy_(inp)
    else:
        _reduce_scatter(out, inp, group=world.group)


def world_all_gather(out: torch.Tensor, inp: torch.Tensor, world: World) -> None:
    """torch.distributed's all-gather on the world group (rank r's input is slice r)."""
    if world.world_size == 1:
        out.copy_(inp)
    else:
        _all_gather(out, inp, group=world.group)


def grid_shard_index(grid: Grid) -> int:
    """The slice a rank of a row x column grid owns: row index * column size + column index."""
    col = dist.get_rank(grid.col) if grid.col_size > 1 else 0
    return grid.index * grid.col_size + col


def grid_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, grid: Grid) -> None:
    _phases(out, inp, grid, _reduce_scatter, row_first=True)


def grid_all_gather(out: torch.Tensor, inp: torch.Tensor, grid: Grid) -> None:
    _phases(out, inp, grid, _all_gather, row_first=False)


def _phases(out: torch.Tensor, inp: torch.Tensor, grid: Grid, op: Any, row_first: bool) -> None:
    """``op`` along the row and the column group (reduce-scatter: row first; all-gather: column
    first), through one buffer of n/g elements; size-1 groups are skipped. Each phase is async and
    waited for: on NCCL (on the comm stream) that is a stream wait, on gloo a host wait. While
    the phase clock is on, each phase's time counts as row or column (scaleout/comm/phasetime.py).
    """
    g, k = len(grid.row_ranks), grid.col_size
    groups = [
        (kind, grp) for kind, size, grp in ((ROW, g, grid.row), (COL, k, grid.col)) if size > 1
    ]
    if not row_first:
        groups.reverse()
    if not groups:
        out.copy_(inp)
        return
    mid = (
        torch.empty(max(out.numel(), inp.numel()) // g, dtype=inp.dtype, device=inp.device)
        if len(groups) == 2
        else out
    )
    for (kind, group), (dst, src) in zip(groups, ((mid, inp), (out, mid)), strict=False):
        _timed_phase(kind, op, dst, src, group)


def _timed_phase(kind: int, op: Any, dst: torch.Tensor, src: torch.Tensor, group: Any) -> None:
    """One phase, ``op(dst, src)`` on ``group`` waited for, timed as ``kind`` while the phase
    clock is on: host time on gloo, timing events on the comm stream on CUDA (read a step
    later)."""
    if not CLOCK.enabled:
        op(dst, src, group=group, async_op=True).wait()
    elif dst.is_cuda:
        start = CLOCK.mark(dst.device)
        op(dst, src, group=group, async_op=True).wait()
        CLOCK.span(kind, start, CLOCK.mark(dst.device))
    else:
        with CLOCK.timed(kind):
            op(dst, src, group=group, async_op=True).wait()
