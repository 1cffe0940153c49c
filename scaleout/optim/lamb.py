"""LAMB (You et al., arXiv 1904.00962) as NVIDIA runs it for MLPerf BERT (apex FusedLAMB).

Per step, for each tensor w with gradient g (optionally pre-scaled by the global clip factor c):

    m = b1 m + (1 - b1) c g            v = b2 v + (1 - b2) (c g)^2
    u = (m / bc1) / (sqrt(v / bc2) + eps) + wd w          bc = 1 - b^step (1 if
    bias_correction=False)
    r = ||w|| / ||u||   (1 if either norm is 0; min(r, trust_clamp) if set; 1 if the group is not
    adapted)
    w = w - lr r u

Global clipping as in apex FusedLAMB: c = max_norm / max(||g||_all, max_norm) over every gradient of
every group. A group is adapted (trust ratio applied) when ``trust_ratio=True``, or by default when
its weight decay is non-zero: with NVIDIA's BERT groups (bias/LayerNorm get wd = 0) that is apex's
``use_nvlamb=False``.

Speed (CPU): the bias corrections are folded into two scalars, u/k = m / (sqrt(v) + eps sqrt(bc2)) +
(wd/k) w
with k = sqrt(bc2) / bc1, and each cache-sized chunk runs the whole chain before the next (see
chunks.py).
An adapted tensor needs ||u|| before w can move, so phase 1 updates the moments and accumulates
||u||^2 and
||w||^2 per tensor, and phase 2 recomputes u (from m, v and w, all cheap to read again) rather than
writing
and re-reading a full-size u: 10 array passes to DRAM against ~20 for AdamW-foreach.

Speed (GPU): there each foreach op is a kernel streaming its arrays from device memory, and that
chain moved ~100 bytes per fp32 parameter (fused AdamW: 28). Off the CPU the step therefore runs
as two one-pass custom ops (scaleout/optim/fused.py: moments + norms, then the update with u
recomputed): 40 bytes per parameter, counted by scaleout/optim/bytecount.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from scaleout.optim.base import (
    CheckedGroups,
    ChunkedOptimizer,
    check_hparams,
    clip_factor,
    fp32_state_like,
    scalars,
    sq_norms,
)
from scaleout.optim.chunks import default_chunk, pieces

# (LAMB's one-pass ops, torch.ops.scaleout.*, are registered by scaleout/optim/fused.py, which
# scaleout/optim/__init__.py imports with this module.)


@dataclass(frozen=True)
class LambCoeffs:
    """The scalars of one LAMB step for one group, with bias correction and clipping folded in."""

    beta1: float
    beta2: float
    m_weight: float  # (1 - b1) c
    v_weight: float  # (1 - b2) c^2
    eps: float  # eps sqrt(bc2)
    wd: float  # wd / k
    k: float  # sqrt(bc2) / bc1: true update = k * computed direction
    lr: float
    adapt: bool
    clamp: float | None

    @staticmethod
    def of(group: dict[str, Any], step: int, clip: float = 1.0) -> LambCoeffs:
        b1, b2 = group["betas"]
        if group["bias_correction"]:
            bc1, bc2 = 1.0 - b1**step, 1.0 - b2**step
        else:
            bc1 = bc2 = 1.0
        k = math.sqrt(bc2) / bc1
        wd = group["weight_decay"]
        adapt = group["trust_ratio"] if group["trust_ratio"] is not None else wd != 0.0
        return LambCoeffs(
            b1,
            b2,
            (1.0 - b1) * clip,
            (1.0 - b2) * clip * clip,
            group["eps"] * math.sqrt(bc2),
            wd / k,
            k,
            group["lr"],
            bool(adapt),
            group["trust_clamp"],
        )


def update_moments(
    g: list[torch.Tensor], m: list[torch.Tensor], v: list[torch.Tensor], co: LambCoeffs
) -> None:
    if co.m_weight == 1.0 - co.beta1 and g[0].dtype == m[0].dtype:
        torch._foreach_lerp_(m, g, co.m_weight)  # one pass instead of mul_ + add_
    else:
        torch._foreach_mul_(m, co.beta1)
        torch._foreach_add_(m, g, alpha=co.m_weight)
    torch._foreach_mul_(v, co.beta2)
    torch._foreach_addcmul_(v, g, g, value=co.v_weight)


def new_moments(
    g: list[torch.Tensor], m: list[torch.Tensor], v: list[torch.Tensor], co: LambCoeffs
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`update_moments` out of place (fresh tensors, the same operations, so the same
    values): the moments a step would write, read before it is decided (the sharded LAMB learns
    of a non-finite gradient in its norm all-reduce, after the norms, and must then leave its
    state untouched)."""
    if co.m_weight == 1.0 - co.beta1 and g[0].dtype == m[0].dtype:
        m2 = torch._foreach_lerp(m, g, co.m_weight)
    else:
        m2 = torch._foreach_mul(m, co.beta1)
        torch._foreach_add_(m2, g, alpha=co.m_weight)
    v2 = torch._foreach_mul(v, co.beta2)
    torch._foreach_addcmul_(v2, g, g, value=co.v_weight)
    return m2, v2


def direction(
    p: list[torch.Tensor], m: list[torch.Tensor], v: list[torch.Tensor], co: LambCoeffs
) -> list[torch.Tensor]:
    """u / k = m / (sqrt(v) + eps') + (wd / k) w, in fp32 (fresh, chunk-sized tensors). eps' and
    wd / k may be 0-d device tensors (the sharded LAMB's staged scalars under CUDA graphs): then
    the Tensor overloads by name, since torch's parser would take a 0-d tensor as a Scalar (a
    host read, and a number frozen into a captured graph), and the decay term always (w x 0 adds
    exactly nothing where the group has no decay)."""
    d = torch._foreach_sqrt(v)
    if isinstance(co.eps, torch.Tensor):
        torch.ops.aten._foreach_add_.Tensor(d, co.eps)
    else:
        torch._foreach_add_(d, co.eps)
    u = torch._foreach_div(m, d)
    if isinstance(co.wd, torch.Tensor):
        torch._foreach_add_(u, torch.ops.aten._foreach_mul.Tensor(p, co.wd))
    elif co.wd:
        torch._foreach_add_(u, p, alpha=co.wd)
    return u


def trust_ratios(wsq: torch.Tensor, usq: torch.Tensor, co: LambCoeffs) -> torch.Tensor:
    """Per-tensor r = ||w|| / ||u|| from squared norms of w and of u/k; 1 where either norm is 0."""
    wn = wsq.sqrt()
    un = usq.sqrt() * co.k
    ok = (wn > 0) & (un > 0)
    r = torch.where(ok, wn / torch.where(ok, un, torch.ones_like(un)), torch.ones_like(wn))
    if co.clamp is not None:
        r = r.clamp(max=co.clamp)
    return r


def lamb_chunks(
    P: Sequence[list[torch.Tensor]],
    G: Sequence[list[torch.Tensor]],
    M: Sequence[list[torch.Tensor]],
    V: Sequence[list[torch.Tensor]],
    owner: Sequence[torch.Tensor],
    ntensors: int,
    co: LambCoeffs,
    reduce_norms: Callable[[torch.Tensor], torch.Tensor] | None = None,
    device: torch.device | None = None,
    U: Sequence[list[torch.Tensor]] | None = None,
) -> None:
    """One LAMB step over chunked views (chunk c: parameter pieces P[c], gradient G[c], moments
    M[c], V[c]).

    ``owner[c]`` maps each piece to its tensor for the per-tensor norms; ``reduce_norms`` (sharded
    LAMB) all-reduces the stacked partial squared norms [||w||^2; ||u||^2] across the ranks holding
    the pieces; it is called on every rank, also one holding no piece of this group (then ``device``
    must be given). ``U`` (same layout, fp32): scratch that keeps each chunk's update direction from
    phase 1 to phase 2; without it the direction is recomputed in phase 2 (one sqrt and one division
    more per element).
    """
    nchunks = len(P)
    if not nchunks and reduce_norms is None:
        return
    step_scale = -co.lr * co.k
    if not co.adapt:  # (never needs reduce_norms: nothing to agree on across ranks)
        for c in range(nchunks):  # no norms needed: update and apply chunk by chunk
            update_moments(G[c], M[c], V[c], co)
            u = direction(P[c], M[c], V[c], co)
            torch._foreach_add_(P[c], u, alpha=step_scale)
        return
    # one chunk (accelerator layout): keep u as is
    keep = nchunks == 1 and reduce_norms is None and U is None
    wnorms: list[torch.Tensor] = []
    unorms: list[torch.Tensor] = []
    u = None
    for c in range(nchunks):
        update_moments(G[c], M[c], V[c], co)
        u = direction(P[c], M[c], V[c], co)
        wnorms.extend(torch._foreach_norm(P[c], 2, dtype=torch.float32))
        unorms.extend(torch._foreach_norm(u, 2, dtype=torch.float32))
        if U is not None:
            torch._foreach_copy_(U[c], u)  # still in cache: cheaper than recomputing it in phase 2
    sq = torch.zeros(2, ntensors, dtype=torch.float32, device=device or owner[0].device)
    # tensor of every piece
    own = (owner[0] if nchunks == 1 else torch.cat(list(owner))) if nchunks else None
    if own is not None:
        sq.index_add_(1, own, torch.stack([torch.stack(wnorms), torch.stack(unorms)]).square_())
    if reduce_norms is not None:
        sq = reduce_norms(sq)
    scale = trust_ratios(sq[0], sq[1], co) * step_scale
    per_piece = scalars(scale[own]) if own is not None else []
    at = 0
    for c in range(nchunks):
        n = len(P[c])
        if U is not None:
            u = U[c]
        elif not keep:
            u = direction(P[c], M[c], V[c], co)
        s = per_piece[at : at + n]
        at += n
        if n == 1 and not isinstance(s[0], torch.Tensor):
            torch._foreach_add_(P[c], u, alpha=s[0])  # one fused pass: w += (-lr r k) u
        else:
            torch._foreach_mul_(u, s)
            torch._foreach_add_(P[c], u)


def global_grad_norm(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    grads = list(grads)
    return sq_norms(grads).sum().sqrt() if grads else torch.zeros(())


class LAMB(CheckedGroups, ChunkedOptimizer):
    """LAMB with NVIDIA's MLPerf-BERT rules; see the module docstring for the exact update.

    Group keys: lr, betas, eps, weight_decay, bias_correction, trust_clamp, trust_ratio (None =
    adapt iff weight_decay != 0). ``clip_grad_norm`` clips the global gradient norm before the
    update (None = off). ``chunk``: elements per cache block on CPU ('auto'), None = whole tensors
    (what CUDA uses). ``onepass``: run each phase as one pass (scaleout/optim/fused.py); None = on
    every device but the CPU (whose cache-blocked chain is as fast, and bit-identical to before).
    """

    HPARAMS = ("lr", "betas", "eps", "weight_decay", "trust_clamp")

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = True,
        trust_clamp: float | None = None,
        trust_ratio: bool | None = None,
        clip_grad_norm: float | None = None,
        chunk: int | None | str = "auto",
        onepass: bool | None = None,
    ):
        check_hparams("LAMB", clip_grad_norm=clip_grad_norm)
        self.clip_grad_norm = clip_grad_norm
        self.onepass = onepass
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            trust_clamp=trust_clamp,
            trust_ratio=trust_ratio,
        )
        super().__init__(params, defaults, chunk)

    def clip_factor(self, grads: Sequence[torch.Tensor]) -> float:
        """apex FusedLAMB: divide every gradient by ||g|| / max_norm when the global norm exceeds
        max_norm."""
        if self.clip_grad_norm is None:
            return 1.0
        norm = float(global_grad_norm(grads))
        self.last_grad_norm = norm
        return clip_factor(norm, self.clip_grad_norm)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [(group, *self.grads_of(group)) for group in self.param_groups]
        clip = self.clip_factor([g for _, _, grads in work for g in grads])
        for group, params, grads in work:
            if not params:
                continue
            group["step"] += 1
            ms, vs = self._moments(params)
            plan = self.plan(params)
            co = LambCoeffs.of(group, group["step"], clip)
            if self.onepass or (self.onepass is None and params[0].device.type != "cpu"):
                self._step_onepass(params, grads, ms, vs, co)
                continue
            U = pieces(self.scratch(params), plan) if co.adapt and plan.num_chunks > 1 else None
            lamb_chunks(
                pieces(params, plan),
                pieces(grads, plan),
                pieces(ms, plan),
                pieces(vs, plan),
                plan.owner,
                len(params),
                co,
                U=U,
            )
        return loss

    def _chunk_elems(self, device: torch.device) -> int:
        chunk = default_chunk(device) if self.chunk == "auto" else self.chunk
        return chunk or 0

    def _step_onepass(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        ms: list[torch.Tensor],
        vs: list[torch.Tensor],
        co: LambCoeffs,
    ) -> None:
        """The two one-pass ops of scaleout/optim/fused.py; the trust ratios stay on the device."""
        chunk = self._chunk_elems(params[0].device)
        sq = torch.ops.scaleout.lamb_moments_(
            params, grads, ms, vs, co.beta1, co.beta2, co.m_weight, co.v_weight, co.eps, co.wd,
            chunk,
        )  # fmt: skip
        step_scale = -co.lr * co.k
        scale = trust_ratios(sq[0], sq[1], co) * step_scale if co.adapt else None
        torch.ops.scaleout.lamb_apply_(params, ms, vs, scale, step_scale, co.eps, co.wd, chunk)

    def _moments(self, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        states = [self.state[p] for p in params]
        for p, s in zip(params, states, strict=True):
            if not s:
                s["exp_avg"] = fp32_state_like(p)
                s["exp_avg_sq"] = fp32_state_like(p)
        return [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
