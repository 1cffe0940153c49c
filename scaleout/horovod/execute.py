"""Running what the ranks agreed on: fused buffers, scaleout's all-reduce algorithms, Horovod's
scaling.

Tensor fusion (Horovod's algorithm, docs/tensor-fusion.rst): the ready tensors of one round that
share dtype, reduction and scale factors are copied, in the agreed order, into flat contiguous
buffers of at most ``HOROVOD_FUSION_THRESHOLD`` bytes (a larger tensor travels alone; 0 disables
fusion), one collective per buffer. Sum and Average go through :func:`scaleout.comm.all_reduce` with
the chosen algorithm (flat, hierarchical, torus2d); Min, Max and Product through torch.distributed's
own all-reduce on the engine's group (they are not bandwidth-bound reductions worth a topology-aware
schedule). At most two buffers are in flight (one reducing while the next is packed), so the extra
memory is bounded by twice the threshold whatever the number of ready gradients. Broadcasts with the
same root are fused too, as raw bytes (any dtype); the allgathers of a round share one size exchange
and one byte all-gather; reduce-scatters are fused like all-reduces.

Scaling follows Horovod's CPU semantics: fp16/bf16 are scaled in fp32, integers in fp64 and
truncated toward zero (so an integer Average is ``trunc(sum / size)``), fp32/fp64 in their own type.
Average is the sum times ``postscale_factor / size``. gloo has no int16 reductions (torch 2.13:
"Invalid scalar type"), so int16 is reduced as int32 and cast back, which is exact.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from scaleout.comm import all_reduce
from scaleout.comm.grid import split_bounds
from scaleout.horovod.errors import HorovodInternalError
from scaleout.horovod.negotiate import label
from scaleout.parallel.buckets import fuse

if TYPE_CHECKING:
    from scaleout.world import World

RED = {"Min": dist.ReduceOp.MIN, "Max": dist.ReduceOp.MAX, "Product": dist.ReduceOp.PRODUCT}
WIRE = {torch.int16: torch.int32}
ALIGN = 16  # byte offsets of packed segments, so that every segment can be viewed as its own dtype
IN_FLIGHT = 2
_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def scale_(t: torch.Tensor, factor: float) -> None:
    """Multiply in place with Horovod's CPU compute types (see module docstring)."""
    if factor == 1.0:
        return
    if t.dtype in (torch.float16, torch.bfloat16):
        t.copy_(t.float().mul_(factor))
    elif t.is_floating_point() or t.is_complex():
        t.mul_(factor)
    else:
        t.copy_(t.double().mul_(factor).trunc_())


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class Executor:
    def __init__(self, world: World, groups: Any, threshold: int, engine: Any):
        self.world, self.threshold = world, threshold
        self.data_world, self.group, self.control = groups.data_world, groups.data, groups.control
        self.engine = engine
        self.size, self.rank = world.world_size, world.rank

    def run(self, resolved: list[tuple], joined: bool) -> None:
        """Execute one round: deliver each request's result or error to its handle."""
        now = time.time()
        by_kind: dict[str, list[tuple]] = {}
        for key, meta, err, req in resolved:
            if req is not None:
                self._span(
                    f"NEGOTIATE_{key[0].upper()}", "wait", req.enqueued, now, tensor=label(key)
                )
                if err is not None:
                    req.handle._fail(HorovodInternalError(err))
            if err is None:
                by_kind.setdefault(key[0], []).append((key, meta, req))
        for (
            kind,
            items,
        ) in by_kind.items():  # kinds in order of first appearance: the same on every rank
            getattr(self, f"_{kind}")(items)

    def _span(self, name: str, track: str, start: float, end: float, **args: Any) -> None:
        if self.engine.timeline is not None:
            self.engine.timeline.span(name, track, start * 1e6, end * 1e6, **args)

    def _device(self, items: list[tuple]) -> torch.device:
        for *_, req in items:
            if req is not None and req.tensor is not None:
                return req.tensor.device
        return self.world.device

    # -- allreduce ---------------------------------------------------------------------------------
    def _allreduce(self, items: list[tuple]) -> None:
        groups: dict[tuple, list[tuple]] = {}
        for key, meta, req in items:
            dtype, shape, op, pre, post, alg, dev = meta
            groups.setdefault((dtype, op, pre, post, alg, dev), []).append((key, shape, req))
        inflight: deque = deque()
        for (dtype, op, pre, post, alg, _), members in groups.items():
            wire = WIRE.get(dtype_of(dtype), dtype_of(dtype))
            device = self._device(members)
            sizes = [math.prod(shape) * wire.itemsize for _, shape, _ in members]
            for idx in fuse(sizes, self.threshold):
                batch = [members[i] for i in idx]
                start = time.time()
                buf = torch.empty(sum(math.prod(s) for _, s, _ in batch), dtype=wire, device=device)
                off = 0
                for _, shape, req in batch:
                    n = math.prod(shape)
                    if req is not None:
                        buf[off : off + n].copy_(req.tensor.detach().reshape(-1))
                    else:  # a rank that joined contributes zeros
                        buf[off : off + n].zero_()
                    off += n
                scale_(buf, pre)
                inflight.append((batch, buf, self._launch(buf, op, alg), op, post, start))
                if len(inflight) >= IN_FLIGHT:
                    self._finish_allreduce(*inflight.popleft())
        while inflight:
            self._finish_allreduce(*inflight.popleft())

    def _launch(self, buf: torch.Tensor, op: str, alg: str) -> Any:
        if self.size == 1 or buf.numel() == 0:
            return None
        if op in ("Sum", "Average"):
            return all_reduce(buf, self.data_world, algorithm=alg, op="sum", async_op=True)
        return dist.all_reduce(buf, op=RED[op], group=self.group, async_op=True)

    def _finish_allreduce(
        self, batch: list[tuple], buf: torch.Tensor, work: Any, op: str, post: float, start: float
    ) -> None:
        if work is not None:
            work.wait()
        scale_(buf, post / self.size if op == "Average" else post)
        off = 0
        for _, shape, req in batch:
            n = math.prod(shape)
            if req is not None:
                seg = buf[off : off + n].view(shape)
                if req.inplace:
                    with torch.no_grad():
                        req.tensor.copy_(seg)
                    result = req.tensor
                elif len(batch) == 1 and seg.dtype == req.tensor.dtype:
                    result = seg  # an unfused buffer is the output: no copy
                else:
                    result = seg.to(req.tensor.dtype, copy=True)
                req.handle._set(req.slot, result)
            off += n
        self._span(
            "ALLREDUCE",
            "comm",
            start,
            time.time(),
            tensors=[label(k) for k, _, _ in batch],
            bytes=buf.numel() * buf.element_size(),
        )

    # -- broadcast ---------------------------------------------------------------------------------
    def _broadcast(self, items: list[tuple]) -> None:
        groups: dict[int, list[tuple]] = {}
        for key, meta, req in items:
            groups.setdefault(meta[2], []).append((key, meta, req))
        for root, members in groups.items():
            sizes = [aligned(math.prod(m[1]) * dtype_of(m[0]).itemsize) for _, m, _ in members]
            for idx in fuse(sizes, self.threshold):
                start = time.time()
                offs = [0]
                for i in idx:
                    offs.append(offs[-1] + sizes[i])
                buf = torch.empty(offs[-1], dtype=torch.uint8, device=self._device(members))
                if self.rank == root:
                    for j, i in enumerate(idx):
                        b = as_bytes(members[i][2].tensor)
                        buf[offs[j] : offs[j] + b.numel()].copy_(b)
                if self.size > 1 and buf.numel():
                    dist.broadcast(buf, src=root, group=self.group)
                for j, i in enumerate(idx):
                    key, (dtype, shape, *_), req = members[i]
                    n = math.prod(shape) * dtype_of(dtype).itemsize
                    value = buf[offs[j] : offs[j] + n].view(dtype_of(dtype)).view(shape)
                    if req.inplace:
                        if self.rank != root:
                            with torch.no_grad():
                                req.tensor.copy_(value)
                        value = req.tensor
                    req.handle._set(
                        req.slot, value.clone() if not req.inplace and len(idx) > 1 else value
                    )
                self._span(
                    "BROADCAST",
                    "comm",
                    start,
                    time.time(),
                    root=root,
                    tensors=[label(members[i][0]) for i in idx],
                )

    # -- allgather ---------------------------------------------------------------------------------
    def _allgather(self, items: list[tuple]) -> None:
        batches = [items] if self.threshold > 0 else [[it] for it in items]
        for batch in batches:
            start = time.time()
            reqs = [req for _, _, req in batch]
            device = self._device(batch)
            dims = torch.tensor([r.tensor.shape[0] for r in reqs], dtype=torch.int64)
            all_dims = torch.empty(self.size * len(reqs), dtype=torch.int64)
            if self.size > 1:
                _gather(all_dims, dims, group=self.control)
            else:
                all_dims.copy_(dims)
            table = all_dims.view(self.size, len(reqs)).tolist()
            rowbytes = [math.prod(r.tensor.shape[1:]) * r.tensor.element_size() for r in reqs]
            seg = [
                [aligned(table[p][t] * rowbytes[t]) for t in range(len(reqs))]
                for p in range(self.size)
            ]
            width = max(sum(s) for s in seg)
            send = torch.zeros(width, dtype=torch.uint8, device=device)
            off = 0
            for t, r in enumerate(reqs):
                b = as_bytes(r.tensor)
                send[off : off + b.numel()].copy_(b)
                off += seg[self.rank][t]
            recv = torch.empty(self.size * width, dtype=torch.uint8, device=device)
            if self.size > 1 and width:
                _gather(recv, send, group=self.group)
            else:
                recv.copy_(send)
            for t, r in enumerate(reqs):
                rows = [table[p][t] for p in range(self.size)]
                out = torch.empty(
                    (sum(rows), *r.tensor.shape[1:]), dtype=r.tensor.dtype, device=device
                )
                flat, pos = as_bytes(out) if out.numel() else None, 0
                for p in range(self.size):
                    n = rows[p] * rowbytes[t]
                    if n:
                        src = p * width + sum(seg[p][:t])
                        flat[pos : pos + n].copy_(recv[src : src + n])
                    pos += n
                r.handle.extra.setdefault("rows", {})[r.slot] = rows
                r.handle._set(r.slot, out)
            self._span(
                "ALLGATHER", "comm", start, time.time(), tensors=[label(k) for k, _, _ in batch]
            )

    # -- alltoall ----------------------------------------------------------------------------------
    def _alltoall(self, items: list[tuple]) -> None:
        for key, _, req in items:
            start = time.time()
            t = req.tensor.detach().contiguous()
            send_splits = torch.tensor(req.splits, dtype=torch.int64)
            recv_splits = torch.empty(self.size, dtype=torch.int64)
            if self.size > 1:
                dist.all_to_all_single(recv_splits, send_splits, group=self.control)
            else:
                recv_splits.copy_(send_splits)
            recv = recv_splits.tolist()
            out = torch.empty((sum(recv), *t.shape[1:]), dtype=t.dtype, device=t.device)
            if t.shape[0] and out.numel() + t.numel() and math.prod(t.shape[1:]):
                src = t.reshape(t.shape[0], -1).view(torch.uint8)
                dst = out.reshape(out.shape[0], -1).view(torch.uint8)
                if self.size > 1:
                    dist.all_to_all_single(
                        dst,
                        src,
                        output_split_sizes=recv,
                        input_split_sizes=req.splits,
                        group=self.group,
                    )
                else:
                    dst.copy_(src)
            req.handle._set(req.slot, (out, recv_splits.to(torch.int32)))
            self._span("ALLTOALL", "comm", start, time.time(), tensors=[label(key)])

    # -- reducescatter -----------------------------------------------------------------------------
    def _reducescatter(self, items: list[tuple]) -> None:
        groups: dict[tuple, list[tuple]] = {}
        for key, meta, req in items:
            dtype, shape, op, pre, post, dev = meta
            groups.setdefault((dtype, op, pre, post, dev), []).append((key, shape, req))
        for (dtype, op, pre, post, _), members in groups.items():
            wire = WIRE.get(dtype_of(dtype), dtype_of(dtype))
            sizes = [math.prod(s) * wire.itemsize for _, s, _ in members]
            for idx in fuse(sizes, self.threshold):
                self._reducescatter_batch([members[i] for i in idx], wire, op, pre, post)

    def _reducescatter_batch(
        self, batch: list[tuple], wire: torch.dtype, op: str, pre: float, post: float
    ) -> None:
        start = time.time()
        p = self.size
        # per tensor: (row bounds per rank, elements per row, offset inside a rank's shard)
        layout = []
        width = 0
        for _, shape, _ in batch:
            bounds, row = split_bounds(shape[0], p), math.prod(shape[1:])
            layout.append((bounds, row, width))
            width += (bounds[1] - bounds[0]) * row  # rank 0 has the largest share
        device = self._device(batch)
        inbuf = torch.zeros(p * width, dtype=wire, device=device)
        for (_, _, req), (bounds, row, off) in zip(batch, layout, strict=True):
            flat = req.tensor.detach().reshape(-1)
            for r in range(p):
                n = (bounds[r + 1] - bounds[r]) * row
                inbuf[r * width + off : r * width + off + n].copy_(
                    flat[bounds[r] * row : bounds[r] * row + n]
                )
        scale_(inbuf, pre)
        out = torch.empty(width, dtype=wire, device=device)
        if p > 1 and width:
            _reduce_scatter(out, inbuf, group=self.group)
        else:
            out.copy_(inbuf[:width])
        scale_(out, post / p if op == "Average" else post)
        for (_, shape, req), (bounds, row, off) in zip(batch, layout, strict=True):
            mine = bounds[self.rank + 1] - bounds[self.rank]
            value = out[off : off + mine * row].view(mine, *shape[1:])
            req.handle._set(req.slot, value.to(req.tensor.dtype, copy=True))
        self._span(
            "REDUCESCATTER", "comm", start, time.time(), tensors=[label(k) for k, _, _ in batch]
        )

    # -- barrier and timeline ----------------------------------------------------------------------
    def _barrier(self, items: list[tuple]) -> None:
        for *_, req in items:  # agreeing on it was the barrier
            if req is not None:
                req.handle._set(req.slot, None)

    def _timeline(self, items: list[tuple]) -> None:
        for *_, req in items:
            timeline, self.engine.timeline = self.engine.timeline, None
            if timeline is not None:
                timeline.write(self.world)
            if req is not None:
                req.handle._set(req.slot, None)
