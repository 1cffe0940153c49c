"""The composition hierarchical and 2D-torus all-reduce share: reduce-scatter along a *row* group,
all-reduce of each shard along a *column* group, all-gather along the row.

* hierarchical: rows = the ranks of one node, columns = same-local-rank peers on every node
  (Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE, NVIDIA's DistributedFusedLAMB pattern).
* torus2d: rows and columns of an X x Y grid (Sony, arXiv 1811.05233).

Every rank of a row carries 1/g of the inter-row traffic, so a node's link carries 2(k-1)/k * n
bytes each way instead of the flat ring's 2(p-1)/p * n (k nodes, p ranks).

Two phase compositions, chosen by backend (see docs/collectives.md for the measurements):

* gloo (CPU): gloo's own reduce_scatter is an all-reduce plus a copy and its all_gather copies
  through staging buffers, both slow on CPU. So the row phases are written with point-to-point
  isend/irecv (zero-copy in gloo: the tensor's memory is the send buffer), the column phase is
  gloo's ring all_reduce on one shard, and the message is cut into chunks that are *pipelined*:
  while chunk c is on the inter-node link, chunk c+1 is being reduce-scattered and chunk c-D
  all-gathered over loopback, and D column all-reduces are in flight at once so the link never idles
  between chunks.
* nccl (GPU): reduce-scatter / all_reduce / all-gather tensor collectives, which NCCL implements
  well, one chunk. They run in the caller's thread on the comm stream (scaleout.comm.handles: the
  stream/thread rule): every phase is ``async_op=True`` and its ``work.wait()`` makes the comm
  stream wait for it, so the phases are ordered on the device, the host never blocks and the
  compute stream carries none of them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from scaleout.comm import handles
from scaleout.comm.chunking import DEFAULT_CHUNK_BYTES, MAX_CHUNKS
from scaleout.comm.phasetime import CLOCK, COL, ROW

# How many reduce-scatters run ahead of the column phase, and how many column all-reduces are in
# flight at once (gloo runs 2 collectives of one group concurrently: ProcessGroupGloo's 2 worker
# threads).
RS_AHEAD = 2
AR_DEPTH = 2

LOW_PRECISION = (torch.float16, torch.bfloat16)
# Point-to-point tags of this module: away from 0 (torch's default tag) so that other code's
# isend/irecv on the same groups cannot be matched with ours. Chunk c uses TAG_BASE + 2c
# (reduce-scatter), + 2c + 1.
TAG_BASE = 0x5C0000

# torch 2.13 renamed the tensor collectives (*_single); older builds only have the *_tensor names.
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Grid:
    """This rank's view of a row x column decomposition."""

    rank: int
    row_ranks: tuple[
        int, ...
    ]  # global ranks of this rank's row, in order (shard j belongs to row_ranks[j])
    row: Any  # process group of row_ranks
    col: Any  # process group of this rank's column
    col_size: int
    # NCCL: a second communicator over row_ranks for the all-gather (made on first use), so that
    # bucket b+1's reduce-scatter is not queued behind bucket b's all-gather (_reduce_nccl)
    row_gather: Callable[[], Any] | None = None

    @property
    def index(self) -> int:
        return self.row_ranks.index(self.rank)


def split_bounds(n: int, parts: int) -> list[int]:
    """Offsets of ``parts`` nearly equal pieces of n elements (the first n % parts get one more)."""
    q, r = divmod(n, parts)
    out = [0]
    for j in range(parts):
        out.append(out[-1] + q + (1 if j < r else 0))
    return out


def reduce_grid(
    buf: torch.Tensor, grid: Grid, chunk_bytes: int | None = None, composition: str = "sharded"
) -> None:
    """Sum ``buf`` (1-D, contiguous) over all ranks of the grid, in place.

    ``composition`` (gloo only): ``sharded`` = reduce-scatter -> all-reduce of every shard ->
    all-gather (every row member carries 1/g of the column traffic); ``leader`` = reduce to the
    row's first rank -> all-reduce among those leaders -> broadcast (the composition of
    ../shared/notes/netns-cluster.md), kept for side-by-side measurement: it is the same schedule
    with shard 0 = the whole chunk.
    """
    if buf.numel() == 0:
        return
    if buf.is_cuda:
        _reduce_nccl(buf, grid)
    else:
        _GlooSchedule(buf, grid, chunk_bytes or DEFAULT_CHUNK_BYTES, composition == "leader").run()


class _GlooSchedule:
    def __init__(self, buf: torch.Tensor, grid: Grid, chunk_bytes: int, leader: bool = False):
        self.buf, self.grid, self.leader = buf, grid, leader
        self.g, self.i = len(grid.row_ranks), grid.index
        n = buf.numel()
        chunks = min(n, MAX_CHUNKS, max(1, math.ceil(n * buf.element_size() / chunk_bytes)))
        self.chunks = split_bounds(n, chunks)
        self.n_chunks = chunks

    def shards(self, c: int) -> list[tuple[int, int]]:
        lo, hi = self.chunks[c], self.chunks[c + 1]
        if self.leader:  # row member 0 owns the whole chunk, the others own nothing
            return [(lo, hi)] + [(hi, hi)] * (self.g - 1)
        b = split_bounds(hi - lo, self.g)
        return [(lo + b[j], lo + b[j + 1]) for j in range(self.g)]

    def mine(self, c: int) -> torch.Tensor:
        lo, hi = self.shards(c)[self.i]
        return self.buf[lo:hi]

    # -- phases -----------------------------------------------------------------------------------
    def post_rs(self, c: int) -> tuple[list[Any], list[torch.Tensor]]:
        """Send shard j of chunk c to row member j; receive the others' copies of my shard."""
        works, tmps = [], []
        shards, mine = self.shards(c), self.mine(c)
        for j, peer in enumerate(self.grid.row_ranks):
            if j == self.i:
                continue
            lo, hi = shards[j]
            if hi > lo:
                works.append(
                    dist.isend(self.buf[lo:hi], dst=peer, group=self.grid.row, tag=TAG_BASE + 2 * c)
                )
            if mine.numel():
                tmp = torch.empty_like(mine)
                works.append(dist.irecv(tmp, src=peer, group=self.grid.row, tag=TAG_BASE + 2 * c))
                tmps.append(tmp)
        return works, tmps

    def finish_rs(self, c: int, posted: tuple[list[Any], list[torch.Tensor]]) -> None:
        works, tmps = posted
        for w in works:  # also the sends: the all-gather will overwrite what they read
            w.wait()
        mine = self.mine(c)
        if not tmps:
            return
        if mine.dtype in LOW_PRECISION:  # accumulate in fp32, round once (no loss beyond the dtype)
            acc = mine.float()
            for t in tmps:
                acc.add_(t.float())
            mine.copy_(acc)
        else:
            for t in tmps:
                mine.add_(t)

    def post_ar(self, c: int) -> Any:
        mine = self.mine(c)
        if self.grid.col_size == 1 or mine.numel() == 0:
            return None
        return dist.all_reduce(mine, group=self.grid.col, async_op=True)

    def post_ag(self, c: int) -> list[Any]:
        works = []
        shards, mine = self.shards(c), self.mine(c)
        for j, peer in enumerate(self.grid.row_ranks):
            if j == self.i:
                continue
            if mine.numel():
                works.append(
                    dist.isend(mine, dst=peer, group=self.grid.row, tag=TAG_BASE + 2 * c + 1)
                )
            lo, hi = shards[j]
            if hi > lo:
                works.append(
                    dist.irecv(
                        self.buf[lo:hi], src=peer, group=self.grid.row, tag=TAG_BASE + 2 * c + 1
                    )
                )
        return works

    # -- the pipeline -----------------------------------------------------------------------------
    def run(self) -> None:
        """The chunk pipeline. While the phase clock is on (scaleout/comm/phasetime.py), the
        waits for column all-reduces count as the column phase and the rest of the schedule as
        the row phases."""
        C = self.n_chunks
        rs: dict[int, Any] = {}
        ar: dict[int, Any] = {}
        ag: list[Any] = []
        row = self.g > 1
        clock = CLOCK if CLOCK.enabled else None
        start, col_s = time.perf_counter(), 0.0

        def drain_one() -> None:
            nonlocal col_s
            c = min(ar)
            w = ar.pop(c)
            if w is not None:
                if clock is None:
                    w.wait()
                else:
                    t = time.perf_counter()
                    w.wait()
                    col_s += time.perf_counter() - t
            if row:
                ag.extend(self.post_ag(c))

        for c in range(min(RS_AHEAD, C) if row else 0):
            rs[c] = self.post_rs(c)
        for c in range(C):
            if row:
                self.finish_rs(c, rs.pop(c))
                if c + RS_AHEAD < C:
                    rs[c + RS_AHEAD] = self.post_rs(c + RS_AHEAD)
            ar[c] = self.post_ar(c)
            while len(ar) > AR_DEPTH:
                drain_one()
        while ar:
            drain_one()
        for w in ag:
            w.wait()
        if clock is not None:
            clock.add(COL, col_s)
            clock.add(ROW, time.perf_counter() - start - col_s)


def _reduce_nccl(buf: torch.Tensor, grid: Grid) -> None:
    """RS -> AR -> AG with NCCL's native collectives (padding to a multiple of the row size).

    Runs on the comm stream (scaleout.comm.handles.on_comm_stream): each phase is async and its
    ``wait()`` orders the current stream after it, never the host or the compute stream. The
    phases are pipelined across buckets: the reduce-scatter runs on the comm stream, the column
    all-reduce and the all-gather on the device's column stream (``handles.comm_stream(dev,
    "col")``), which waits for the reduce-scatter and is where the bucket ends
    (``handles.finish_on``). The comm stream never waits for the column stream, and the
    all-gather goes through its own communicator (``grid.row_gather``): NCCL runs a
    communicator's operations in issue order, so sharing the row's would queue bucket b+1's
    reduce-scatter behind bucket b's all-gather, and so behind its all-reduce. So bucket b+1's
    NVLink phase overlaps bucket b's network phase. While the phase clock is on, timing events
    between the phases (read a step later: scaleout/comm/phasetime.py) time each."""
    clock = CLOCK if CLOCK.enabled else None
    g = len(grid.row_ranks)
    n = buf.numel()
    padded = math.ceil(n / g) * g
    marks = [clock.mark(buf.device)] if clock is not None else []
    x = buf
    if padded != n:
        x = torch.zeros(padded, dtype=buf.dtype, device=buf.device)
        x[:n].copy_(buf)
    shard = x.narrow(0, grid.index * (padded // g), padded // g)
    if g > 1:
        out = torch.empty_like(shard)
        reduce_scatter_tensor(out, x, group=grid.row, async_op=True).wait()
        shard.copy_(out)
    col = handles.comm_stream(buf.device, "col")
    col.wait_stream(torch.cuda.current_stream(buf.device))
    if x is not buf:  # made on the comm stream, used on the column stream after this returns
        x.record_stream(col)
    handles.finish_on(col)
    with torch.cuda.stream(col):
        if clock is not None:
            marks.append(clock.mark(buf.device))
        if grid.col_size > 1:
            dist.all_reduce(shard, group=grid.col, async_op=True).wait()
        if clock is not None:
            marks.append(clock.mark(buf.device))
        if g > 1:
            row = grid.row_gather() if grid.row_gather is not None else grid.row
            all_gather_tensor(x, shard.clone(), group=row, async_op=True).wait()
        if x is not buf:
            buf.copy_(x[:n])
        if clock is not None:
            marks.append(clock.mark(buf.device))
            for kind, a, b in zip((ROW, COL, ROW), marks, marks[1:], strict=False):
                clock.span(kind, a, b)
