"""Sharded LAMB (ZeRO stage 1, like apex's DistributedFusedLAMB): each rank keeps 1/world of the state.

Layout: the parameters of all groups are packed, in group order, into one flat buffer padded to a
multiple of the world size, and every parameter becomes a view of it (``p.data`` is re-pointed once, as
apex does), so the final all-gather writes the model's weights with no copy. Rank r owns elements
[r S, (r + 1) S) with S = padded / world. Per step:

1. pack: gradients are copied into a flat fp32 buffer (skipped for a gradient that already is a view of
   it; see :meth:`ShardedLAMB.bind_grads`);
2. reduce-scatter (sum, then / world = the average a DDP all-reduce would give) into this rank's shard;
3. update: LAMB on the shard's pieces of each tensor (lamb.lamb_chunks); the per-tensor ||w||^2 and
   ||u||^2 are partial sums on each rank and one all-reduce of a [2, tensors] vector makes them whole,
   so the trust ratios are those of the original tensors; global clipping all-reduces one scalar;
4. all-gather the updated shards into the flat parameter buffer.

``timings`` holds the last step's seconds per phase (communication apart from the update). Where the
collectives issue's ``scaleout.comm`` lands, steps 2 and 4 are the place to plug in its hierarchical /
torus reduce-scatter and all-gather (they take the flat buffers as they are).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from scaleout.errors import ConfigError
from scaleout.optim.base import check_hparams, sq_norms
from scaleout.optim.chunks import default_chunk, pieces, plan_chunks
from scaleout.optim.lamb import LambCoeffs, lamb_chunks
from scaleout.profile import traced

# torch 2.13 renamed the tensor-in/tensor-out collectives (*_single); older builds only have the old names.
# traced: profiler ranges scaleout.reduce_scatter / scaleout.all_gather (scaleout/profile.py)
_reduce_scatter = traced("reduce_scatter", getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)
_all_gather = traced("all_gather", getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)


def reduce_scatter_mean(out: torch.Tensor, flat: torch.Tensor, group: Any, size: int, rank: int) -> None:
    """out = mean over ranks of flat[rank S : (rank + 1) S]. gloo has the tensor reduce-scatter in torch 2.13
    (checked); a build without it falls back to an all-reduce of the whole buffer and a slice (twice the traffic)."""
    try:
        _reduce_scatter(out, flat, op=dist.ReduceOp.SUM, group=group)
    except (RuntimeError, NotImplementedError, AttributeError):
        dist.all_reduce(flat, group=group)
        out.copy_(flat[rank * out.numel() : (rank + 1) * out.numel()])
    out.div_(size)  # ReduceOp.AVG is NCCL-only


def all_gather_shards(flat: torch.Tensor, shard: torch.Tensor, group: Any) -> None:
    """flat = concat of every rank's shard (shard is this rank's slice of flat, gathered in place)."""
    try:
        _all_gather(flat, shard, group=group)
    except (RuntimeError, NotImplementedError, AttributeError):
        dist.all_gather(list(flat.chunk(dist.get_world_size(group))), shard.clone(), group=group)


class ShardedLAMB(torch.optim.Optimizer):
    """LAMB whose moments are sharded over ``world`` (same hyper-parameters and rules as :class:`LAMB`).

    Call :meth:`step` after backward on every rank with the rank's *local* (unreduced) gradients: the
    optimizer averages them itself, so do not also all-reduce them. All parameters must share one dtype
    and device. ``state_dict`` is this rank's shard; load it on the same rank of a world of the same size.
    ``overlap=True`` (with ``bucket_mb``) returns the overlapped variant, see sharded_overlap.py.
    """

    def __new__(cls, *args: Any, overlap: bool = False, **kwargs: Any) -> ShardedLAMB:
        # overlap=True builds the bucketed variant (reduce-scatter during backward, per-bucket all-gathers)
        if overlap and cls is ShardedLAMB:
            from scaleout.optim.sharded_overlap import OverlappedShardedLAMB

            return super().__new__(OverlappedShardedLAMB)
        return super().__new__(cls)

    def __init__(
        self,
        params: Any,
        world: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = True,
        trust_clamp: float | None = None,
        trust_ratio: bool | None = None,
        clip_grad_norm: float | None = None,
        chunk: int | None | str = "auto",
        group: Any = None,
        profile: bool = False,
        overlap: bool = False,
    ):
        check_hparams("ShardedLAMB", clip_grad_norm=clip_grad_norm)
        if world is None:
            raise ConfigError("ShardedLAMB needs the World (optim.sharded=true needs a distributed run)")
        self.world = world
        self.group = world.group if group is None else group
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.clip_grad_norm = clip_grad_norm
        self.profile = profile
        self.timings: dict[str, float] = {}
        self._built = False
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
            trust_clamp=trust_clamp, trust_ratio=trust_ratio,
        )
        super().__init__(params, defaults)
        self._build(chunk)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._built:
            raise ConfigError("ShardedLAMB: pass every parameter group at construction (the flat layout is fixed)")
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        check_hparams("ShardedLAMB", lr=g["lr"], betas=g["betas"], eps=g["eps"], weight_decay=g["weight_decay"], trust_clamp=g["trust_clamp"])
        g.setdefault("step", 0)

    # -- layout -----------------------------------------------------------------------------------
    def _build(self, chunk: int | None | str) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) != 1:
            raise ConfigError(f"ShardedLAMB needs one dtype and device for all parameters, got {sorted(map(str, kinds))}")
        dtype, device = kinds.pop()
        numels = [p.numel() for p in params]
        self.numel = sum(numels)
        self.shard_numel = S = max(1, math.ceil(self.numel / self.size))
        lo, hi = self.rank * S, (self.rank + 1) * S
        self.flat_param = torch.zeros(S * self.size, dtype=dtype, device=device)
        self.flat_grad = torch.zeros(S * self.size, dtype=torch.float32 if dtype != torch.float64 else dtype, device=device)
        offsets = [0]
        for n in numels:
            offsets.append(offsets[-1] + n)
        views = [self.flat_param[a : a + n].view(p.shape) for p, a, n in zip(params, offsets[:-1], numels, strict=True)]
        with torch.no_grad():
            for view, p in zip(views, params, strict=True):
                view.copy_(p.detach())
        for p, view in zip(params, views, strict=True):
            p.data = view  # parameters now live in the flat buffer (apex does the same)
        self.grad_views = [self.flat_grad[a : a + n].view(p.shape) for p, a, n in zip(params, offsets[:-1], numels, strict=True)]
        self.params = params
        self.p_shard = self.flat_param[lo:hi]
        self.g_shard = torch.zeros(S, dtype=self.flat_grad.dtype, device=device)
        self.exp_avg = torch.zeros(S, dtype=torch.float32 if dtype != torch.float64 else dtype, device=device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        chunk = default_chunk(device) if chunk == "auto" else chunk
        # Per group: the pieces of its tensors that fall in [lo, hi), as views of the shard buffers.
        self._work = []
        first = 0
        for g in self.param_groups:
            n_t = len(g["params"])
            segs = []
            for i in range(n_t):
                a, b = max(offsets[first + i], lo), min(offsets[first + i + 1], hi)
                if a < b:
                    segs.append((i, a - lo, b - lo))
            first += n_t
            plan = plan_chunks([b - a for _, a, b in segs], chunk, device=device)
            seg_owner = torch.tensor([i for i, _, _ in segs], dtype=torch.long, device=device)
            owner = [seg_owner[o] for o in plan.owner]

            def cut(buf: torch.Tensor, segs=segs, plan=plan) -> list[list[torch.Tensor]]:
                return pieces([buf[a:b] for _, a, b in segs], plan)

            self._work.append((g, n_t, cut(self.p_shard), cut(self.g_shard), cut(self.exp_avg), cut(self.exp_avg_sq), owner))
        self._built = True

    def bind_grads(self) -> None:
        """Make every ``p.grad`` a view of the flat gradient buffer, so backward accumulates straight into it
        and step() skips the pack copy. Then zero gradients with ``zero_grad(set_to_none=False)``."""
        if self.flat_grad.dtype != self.flat_param.dtype:
            raise ConfigError(f"bind_grads: {self.flat_param.dtype} parameters keep an fp32 gradient buffer; leave grads unbound")
        for p, view in zip(self.params, self.grad_views, strict=True):
            view.zero_()
            p.grad = view

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank (the two moment shards)."""
        return self.exp_avg.numel() * self.exp_avg.element_size() * 2

    # -- step -------------------------------------------------------------------------------------
    def _tick(self, name: str, t0: float) -> float:
        if self.profile and self.flat_param.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        self.timings[name] = self.timings.get(name, 0.0) + t - t0
        return t

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.timings = {}
        t = time.perf_counter()
        dst, src = [], []
        for p, view in zip(self.params, self.grad_views, strict=True):
            g = p.grad
            if g is None:
                view.zero_()
            elif g.data_ptr() != view.data_ptr():
                dst.append(view)
                src.append(g)
        if dst:
            torch._foreach_copy_(dst, src)
        t = self._tick("pack", t)
        reduce_scatter_mean(self.g_shard, self.flat_grad, self.group, self.size, self.rank)
        t = self._tick("reduce_scatter", t)
        clip = 1.0
        if self.clip_grad_norm is not None:
            sq = sq_norms([self.g_shard])
            dist.all_reduce(sq, group=self.group)
            norm = float(sq.sum().sqrt())
            self.last_grad_norm = norm
            clip = self.clip_grad_norm / max(norm, self.clip_grad_norm) if math.isfinite(norm) else 1.0
        t = self._tick("norm_allreduce", t)
        comm = 0.0

        def reduce_norms(x: torch.Tensor) -> torch.Tensor:
            nonlocal comm
            t0 = time.perf_counter()
            dist.all_reduce(x, group=self.group)
            comm += time.perf_counter() - t0
            return x

        device = self.flat_param.device
        for g, n_t, P, G, M, V, owner in self._work:
            g["step"] += 1
            co = LambCoeffs.of(g, g["step"], clip)
            lamb_chunks(P, G, M, V, owner, n_t, co, reduce_norms=reduce_norms, device=device)
        t = self._tick("update", t)
        self.timings["update"] -= comm
        self.timings["norm_allreduce"] += comm
        all_gather_shards(self.flat_param, self.p_shard, self.group)
        self._tick("all_gather", t)
        return loss

    # -- checkpoint -------------------------------------------------------------------------------
    def _layout_key(self) -> dict[str, int]:
        return {"rank": self.rank, "world_size": self.size, "numel": self.numel, "shard_numel": self.shard_numel}

    def state_dict(self) -> dict[str, Any]:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {
            "layout": self._layout_key(),
            "param_groups": groups,
            "state": {"exp_avg": self.exp_avg.clone(), "exp_avg_sq": self.exp_avg_sq.clone()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        mine, theirs = self._layout_key(), state_dict.get("layout", {})
        if mine != theirs:
            raise ConfigError(f"ShardedLAMB checkpoint layout {theirs} does not match this rank's {mine}")
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ConfigError(
                f"ShardedLAMB checkpoint has {len(state_dict['param_groups'])} parameter groups, expected {len(self.param_groups)}"
            )
        for g, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            g.update({k: v for k, v in saved.items() if k != "params"})
        self.exp_avg.copy_(state_dict["state"]["exp_avg"])
        self.exp_avg_sq.copy_(state_dict["state"]["exp_avg_sq"])
