"""Sharded LAMB with its communication overlapped (apex DistributedFusedLAMB's pattern): ``overlap=True``.

The plain :class:`~scaleout.optim.sharded.ShardedLAMB` runs pack -> reduce-scatter -> update -> all-gather
back to back after backward, so the network idles during backward and the CPU/GPU idles during both
collectives. Here:

* Layout: parameters are packed in *reverse* order (backward produces the last layer's gradients first)
  into buckets of about ``bucket_mb`` MB (25 MB: the DDP paper's default, Li et al. VLDB 2020); each
  bucket is padded to a multiple of the world size and rank r owns slice r of *every* bucket, so every
  bucket has its own reduce-scatter and all-gather (apex cuts its buffer into blocks the same way).
* Backward: a post-accumulate-grad hook copies each gradient into the flat gradient buffer and counts the
  bucket's ready tensors; a full bucket starts its async reduce-scatter at once. Buckets are launched
  strictly in index order (a later full bucket waits for the earlier ones) so every rank issues the same
  sequence of collectives even if autograd finishes tensors in a different order.
* step(): launches any bucket backward did not finish (unused parameters: zero gradient), waits the
  reduce-scatters bucket by bucket and runs LAMB's first phase (moments, partial ||w||^2 and ||u||^2) on
  each as it arrives; one all-reduce of all groups' partial norms gives the per-tensor trust ratios
  (global clipping, if on, needs every bucket first: one scalar all-reduce); the second phase then
  updates bucket by bucket and starts each bucket's all-gather as soon as its shard is written, so the
  gathers of early buckets overlap the update of later ones.

The result equals the non-overlapped ShardedLAMB and LAMB on the averaged gradient (same formulas, sums
in a different order: ~1e-7 relative). Several backward passes per step (gradient accumulation): wrap all
but the last in :meth:`OverlappedShardedLAMB.no_sync`; without it a bucket that fills again is re-sent
(correct, but each micro-batch pays the traffic).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from scaleout.errors import ConfigError
from scaleout.optim.base import scalars, sq_norms
from scaleout.optim.chunks import default_chunk, pieces, plan_chunks
from scaleout.optim.lamb import LambCoeffs, direction, trust_ratios, update_moments
from scaleout.optim.sharded import ShardedLAMB, _all_gather, _reduce_scatter

DEFAULT_BUCKET_MB = 25.0  # DDP's default bucket (Li et al., "PyTorch Distributed", VLDB 2020)


class OverlappedShardedLAMB(ShardedLAMB):
    """ShardedLAMB whose reduce-scatters run during backward and all-gathers during the update.

    Build it as ``ShardedLAMB(groups, world, overlap=True, bucket_mb=...)`` (or directly). Hooks are
    installed at construction; call backward then :meth:`step` as with ShardedLAMB.
    """

    def __init__(self, params: Any, world: Any, *args: Any, overlap: bool = True, bucket_mb: float = DEFAULT_BUCKET_MB, **kwargs: Any):
        if not (isinstance(bucket_mb, int | float) and bucket_mb > 0 and math.isfinite(bucket_mb)):
            raise ConfigError(f"ShardedLAMB bucket_mb={bucket_mb!r} must be a positive number of megabytes")
        self.bucket_mb = float(bucket_mb)
        self._sync = True
        super().__init__(params, world, *args, **kwargs)

    # -- layout -----------------------------------------------------------------------------------
    def _build(self, chunk: int | None | str) -> None:
        order = [(gi, i, p) for gi, g in enumerate(self.param_groups) for i, p in enumerate(g["params"])]
        kinds = {(p.dtype, p.device) for _, _, p in order}
        if len(kinds) != 1:
            raise ConfigError(f"ShardedLAMB needs one dtype and device for all parameters, got {sorted(map(str, kinds))}")
        dtype, device = kinds.pop()
        gdtype = torch.float32 if dtype != torch.float64 else dtype
        order.reverse()  # backward meets the last parameters first
        cap = max(1, int(self.bucket_mb * 2**20 / torch.empty((), dtype=gdtype).element_size()))
        buckets: list[list[tuple[int, int, torch.Tensor]]] = [[]]
        fill = 0
        for item in order:
            if buckets[-1] and fill + item[2].numel() > cap:
                buckets.append([])
                fill = 0
            buckets[-1].append(item)
            fill += item[2].numel()
        W, r = self.size, self.rank
        slices = [max(1, math.ceil(sum(p.numel() for _, _, p in b) / W)) for b in buckets]
        starts = [0]
        for s in slices:
            starts.append(starts[-1] + s * W)
        self.numel = sum(p.numel() for _, _, p in order)
        self.shard_numel = sum(slices)
        self.flat_param = torch.zeros(starts[-1], dtype=dtype, device=device)
        self.flat_grad = torch.zeros(starts[-1], dtype=gdtype, device=device)
        self.g_shard = torch.zeros(self.shard_numel, dtype=gdtype, device=device)
        self.exp_avg = torch.zeros(self.shard_numel, dtype=gdtype, device=device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        chunk = default_chunk(device) if chunk == "auto" else chunk
        self.params = [p for g in self.param_groups for p in g["params"]]
        view_of: dict[int, torch.Tensor] = {}
        self._bucket_of: dict[int, int] = {}
        self._buckets = []  # per bucket: (flat slice, param shard, grad shard, [(view, param)], work per group)
        shard_off = 0
        for b, (items, s) in enumerate(zip(buckets, slices, strict=True)):
            a0 = starts[b]
            lo, hi = a0 + r * s, a0 + (r + 1) * s
            segs: dict[int, list[tuple[int, int, int]]] = {}
            members = []
            off = a0
            for gi, i, p in items:
                n = p.numel()
                view = self.flat_param[off : off + n].view(p.shape)
                with torch.no_grad():
                    view.copy_(p.detach())
                p.data = view  # parameters live in the flat buffer (as in ShardedLAMB)
                gview = self.flat_grad[off : off + n].view(p.shape)
                view_of[id(p)] = gview
                self._bucket_of[id(p)] = b
                members.append((gview, p))
                x, y = max(off, lo), min(off + n, hi)
                if x < y:
                    segs.setdefault(gi, []).append((i, x - lo, y - lo))
                off += n
            sl = slice(shard_off, shard_off + s)
            P, G, M, V = self.flat_param[lo:hi], self.g_shard[sl], self.exp_avg[sl], self.exp_avg_sq[sl]
            work = []
            for gi, sg in segs.items():
                plan = plan_chunks([y - x for _, x, y in sg], chunk, device=device)
                seg_owner = torch.tensor([i for i, _, _ in sg], dtype=torch.long, device=device)
                cut = lambda buf, sg=sg, plan=plan: pieces([buf[x:y] for _, x, y in sg], plan)  # noqa: E731
                work.append((gi, cut(P), cut(G), cut(M), cut(V), [seg_owner[o] for o in plan.owner]))
            self._buckets.append((self.flat_param[a0 : a0 + s * W], P, self.flat_grad[a0 : a0 + s * W], G, members, work))
            shard_off += s
        self._gview = view_of
        self.grad_views = [view_of[id(p)] for p in self.params]
        self.p_shard = None  # no single contiguous shard: see self._buckets
        self._ready = [0] * len(buckets)
        self._expect = [len(b) for b in buckets]  # tensors a bucket waits for (minus those seen unused)
        self._absent: set[int] = set()
        self._seen: set[int] = set()
        self._rs: list[Any] = [None] * len(buckets)
        self._next = 0  # first bucket whose reduce-scatter is not launched yet
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.params]
        self._built = True

    def _layout_key(self) -> dict[str, int]:
        return {**super()._layout_key(), "buckets": len(self._buckets)}

    # -- backward ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients without communicating (all micro-batches but the last)."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    @torch.no_grad()
    def _grad_ready(self, p: torch.Tensor) -> None:
        if not self._sync:
            return
        b = self._bucket_of[id(p)]
        if id(p) in self._seen:  # a second backward this step without no_sync: re-send this bucket
            self._restart(b)
        self._seen.add(id(p))
        if id(p) in self._absent:  # unused last step, used now: its bucket waits for it again
            self._absent.discard(id(p))
            self._expect[b] += 1
            if b < self._next:  # already sent without it (zero gradient): send again
                self._restart(b)
                self._seen.add(id(p))
        view = self._gview[id(p)]
        if p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        self._ready[b] += 1
        self._launch_ready()

    def _restart(self, b: int) -> None:
        """Wait every launched bucket from b on, then mark them unsent (their gradients will be re-read)."""
        for k in range(b, self._next):
            self._rs[k].wait()
            self._rs[k] = None
        if b < self._next:
            self._next = b
        for _, q in self._buckets[b][4]:
            self._seen.discard(id(q))
        self._ready[b] = 0

    def _launch_ready(self) -> None:
        while self._next < len(self._buckets) and self._ready[self._next] >= self._expect[self._next]:
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        _, _, flat_g, G, _, _ = self._buckets[b]
        self._rs[b] = _reduce_scatter(G, flat_g, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Also drops the reduce-scatters of a backward whose step was skipped (e.g. non-finite gradients)."""
        if self._next or self._seen:
            for h in self._rs[: self._next]:
                h.wait()
            self._reset()
        super().zero_grad(set_to_none=set_to_none)

    def _reset(self) -> None:
        self._rs = [None] * len(self._buckets)
        self._ready = [0] * len(self._buckets)
        self._seen.clear()
        self._next = 0

    # -- step -------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.timings = {}
        t = time.perf_counter()
        for b in range(self._next, len(self._buckets)):  # buckets backward did not fill (or no backward ran)
            for gview, p in self._buckets[b][4]:
                if id(p) in self._seen:
                    continue
                if p.grad is None:  # unused this step: zero, and let its bucket go without it from now on
                    gview.zero_()
                    if id(p) not in self._absent:
                        self._absent.add(id(p))
                        self._expect[b] -= 1
                elif p.grad.data_ptr() != gview.data_ptr():
                    gview.copy_(p.grad)
            self._launch(b)
        self._next = len(self._buckets)
        t = self._tick("pack", t)
        groups = self.param_groups
        for g in groups:
            g["step"] += 1
        ntens = [len(g["params"]) for g in groups]
        sq = torch.zeros(2, sum(ntens), dtype=torch.float32, device=self.flat_param.device)
        base = [sum(ntens[:gi]) for gi in range(len(groups))]
        clip = 1.0
        wait_s = 0.0
        if self.clip_grad_norm is not None:  # the global norm needs every bucket before any moment moves
            t0 = time.perf_counter()
            for h in self._rs:
                h.wait()
            wait_s += time.perf_counter() - t0
            self.g_shard.div_(self.size)
            gsq = sq_norms([self.g_shard])
            dist.all_reduce(gsq, group=self.group)
            norm = float(gsq.sum().sqrt())
            self.last_grad_norm = norm
            clip = self.clip_grad_norm / max(norm, self.clip_grad_norm) if math.isfinite(norm) else 1.0
        co = [LambCoeffs.of(g, g["step"], clip) for g in groups]
        t = self._tick("norm_allreduce", t)
        for b, (_, _, _, G, _, work) in enumerate(self._buckets):  # phase 1 as each bucket arrives
            if self.clip_grad_norm is None:
                t0 = time.perf_counter()
                self._rs[b].wait()
                wait_s += time.perf_counter() - t0
                G.div_(self.size)  # ReduceOp.AVG is NCCL-only
            for gi, Pc, Gc, Mc, Vc, owner in work:
                c = co[gi]
                if not c.adapt:
                    continue
                for k in range(len(Pc)):
                    update_moments(Gc[k], Mc[k], Vc[k], c)
                    sq[0, base[gi] :].index_add_(0, owner[k], sq_norms(Pc[k]))
                    sq[1, base[gi] :].index_add_(0, owner[k], sq_norms(direction(Pc[k], Mc[k], Vc[k], c)))
        t = self._tick("update", t)
        self.timings["update"] -= wait_s
        self.timings["reduce_scatter_wait"] = wait_s
        if any(c.adapt for c in co):
            dist.all_reduce(sq, group=self.group)
        scale = [trust_ratios(sq[0, base[gi] : base[gi] + n], sq[1, base[gi] : base[gi] + n], c) * (-c.lr * c.k)
                 for gi, (n, c) in enumerate(zip(ntens, co, strict=True))]
        t = self._tick("norm_allreduce", t)
        gathers = []
        for flat_p, P, _, _, _, work in self._buckets:  # phase 2, then this bucket's all-gather at once
            for gi, Pc, Gc, Mc, Vc, owner in work:
                c = co[gi]
                for k in range(len(Pc)):
                    if not c.adapt:
                        update_moments(Gc[k], Mc[k], Vc[k], c)
                    u = direction(Pc[k], Mc[k], Vc[k], c)
                    if c.adapt:
                        torch._foreach_mul_(u, scalars(scale[gi][owner[k]]))
                        torch._foreach_add_(Pc[k], u)
                    else:
                        torch._foreach_add_(Pc[k], u, alpha=-c.lr * c.k)
            gathers.append(_all_gather(flat_p, P, group=self.group, async_op=True))
        t = self._tick("update", t)
        for h in gathers:
            h.wait()
        self._tick("all_gather_wait", t)
        self._reset()
        return loss
