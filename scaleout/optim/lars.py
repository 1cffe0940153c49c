"""LARS (You, Gitman, Ginsburg, arXiv 1708.03888) with the MLPerf ResNet-50 reference rules.

The MLPerf reference (mlcommons/training, image_classification, TensorFlow ``LARSOptimizer``) does,
for every tensor w with gradient g and momentum buffer b (zero-initialised):

    adapted tensors:   t = eta ||w|| / (||g|| + wd ||w|| + eps)   (t = 1 if ||w|| = 0 or ||g|| = 0)
                       b = momentum b + lr t (g + wd w)
    excluded tensors:  b = momentum b + lr g                     (batch norm and bias: no decay, no
    t)
                       w = w - b

so the learning rate sits inside the momentum buffer, and weight decay is applied exactly where the
trust ratio is. A group is adapted when ``trust_ratio=True``, or by default when its weight decay is
non-zero (``param_groups(model, no_decay=LARS_EXCLUDE)`` builds the two groups). eta = 0.001 and eps
= 0 are the reference defaults.

Speed (CPU, fp32): the norms are two foreach reads (w and g); the update is torch's fused SGD kernel
with lr = 1 and dampening = 1 - lr t, one pass over w, g and b per tensor: 7 array transfers in all
against 8 for SGD-momentum-foreach. bf16/fp16 parameters and accelerators take the multi-tensor
foreach path (cache-blocked chunks; per-tensor 0-d scalars, so the arithmetic stays fp32 for bf16
parameters).

Speed (GPU): that foreach chain moves ~52 bytes per fp32 parameter there (each op a kernel
streaming from device memory; fused SGD: 20), so off the CPU the update runs as one one-pass op
(scaleout/optim/fused.py: b and w in one pass, the per-tensor lr t a device vector, no host sync):
norms 8 + update 20 = 28 bytes per parameter, counted by scaleout/optim/bytecount.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from scaleout.optim.base import (
    CheckedGroups,
    ChunkedOptimizer,
    fp32_state_like,
    sq_norms,
)
from scaleout.optim.chunks import default_chunk, pieces

# (the one-pass op torch.ops.scaleout.lars_apply_ is registered by scaleout/optim/fused.py, which
# scaleout/optim/__init__.py imports with this module.)

LARS_ETA = 0.001  # trust coefficient of the MLPerf ResNet reference (and You et al. 2017)


# The fused kernel gets s = lr t as dampening = 1 - s and forms 1 - dampening in double precision,
# which keeps ~16 - log10(1/s) digits of s: at s >= 1e-8, 8 digits (below fp32's 7); smaller
# non-zero s take plain ops.
FUSED_MIN_SCALE = 1e-8


def exact_in_kernel(s: float) -> bool:
    """Whether the fused kernel reproduces lr t = s to fp32 precision (s = 0 is exact: dampening
    1)."""
    return s == 0.0 or abs(s) >= FUSED_MIN_SCALE


def lars_scale(
    wn: float, gn: float, lr: float, eta: float, wd: float, eps: float, clamp: float | None
) -> float:
    """lr * t for one tensor from its norms (Python floats); the scalar form of ``lars_scales``."""
    t = eta * wn / (gn + wd * wn + eps) if wn > 0 and gn > 0 else 1.0
    return lr * (min(t, clamp) if clamp is not None else t)


def lars_scales(
    wsq: torch.Tensor,
    gsq: torch.Tensor,
    lr: float,
    eta: float,
    wd: float,
    eps: float,
    clamp: float | None = None,
) -> torch.Tensor:
    """Per-tensor lr * t from squared norms; t = 1 where either norm is 0 (MLPerf reference)."""
    wn, gn = wsq.sqrt(), gsq.sqrt()
    ok = (wn > 0) & (gn > 0)
    denom = torch.where(ok, gn + wd * wn + eps, torch.ones_like(gn))
    t = torch.where(ok, eta * wn / denom, torch.ones_like(wn))
    if clamp is not None:
        t = t.clamp(max=clamp)
    return t * lr


class LARS(CheckedGroups, ChunkedOptimizer):
    """LARS with momentum, MLPerf form (see the module docstring).

    Group keys: lr, momentum, weight_decay, eta, eps, trust_clamp, trust_ratio (None = adapt iff
    weight_decay != 0). ``chunk``: elements per cache block of the foreach path on CPU ('auto'),
    None = whole tensors. ``fused``: use torch's fused SGD kernel (one pass per tensor); None = on
    CPU with fp32 parameters and gradients, False = the multi-tensor foreach path (bf16/fp16 and
    accelerators always take it unless True is given). ``onepass``: the update as one pass
    (scaleout/optim/fused.py); None = on every device but the CPU, unless ``fused`` is set.
    """

    HPARAMS = ("lr", "momentum", "weight_decay", "eta", "eps", "trust_clamp")

    def __init__(
        self,
        params: Any,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 5e-5,
        eta: float = LARS_ETA,
        eps: float = 0.0,
        trust_clamp: float | None = None,
        trust_ratio: bool | None = None,
        chunk: int | None | str = "auto",
        fused: bool | None = None,
        onepass: bool | None = None,
    ):
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            eta=eta,
            eps=eps,
            trust_clamp=trust_clamp,
            trust_ratio=trust_ratio,
        )
        self.fused = fused
        self.onepass = onepass
        super().__init__(params, defaults, chunk)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads = self.grads_of(group)
            if not params:
                continue
            group["step"] += 1
            bufs = self._buffers(params)
            lr, mom, wd = group["lr"], group["momentum"], group["weight_decay"]
            adapt = group["trust_ratio"] if group["trust_ratio"] is not None else wd != 0.0
            if self._use_onepass(params):
                self._step_onepass(params, grads, bufs, group, adapt)
                continue
            if self._use_fused(params, grads):
                self._fused_cpu(params, grads, bufs, group, adapt)
                continue
            plan = self.plan(params)
            P, G, B = pieces(params, plan), pieces(grads, plan), pieces(bufs, plan)
            if not adapt:
                for c in range(plan.num_chunks):
                    torch._foreach_mul_(B[c], mom)
                    torch._foreach_add_(B[c], G[c], alpha=lr)
                    if wd:
                        torch._foreach_add_(B[c], P[c], alpha=lr * wd)
                    torch._foreach_sub_(P[c], B[c])
                continue
            scale = lars_scales(
                sq_norms(params),
                sq_norms(grads),
                lr,
                group["eta"],
                wd,
                group["eps"],
                group["trust_clamp"],
            )
            wd_scale = scale * wd
            for c in range(plan.num_chunks):
                own = plan.owner[c]
                torch._foreach_mul_(B[c], mom)
                # b += (lr t) g + (lr t wd) w with per-tensor scalars given as 0-d tensors (addcmul
                # broadcasts them), which also keeps the arithmetic in fp32 for bf16 parameters and
                # gradients.
                torch._foreach_addcmul_(B[c], G[c], list(scale[own].unbind()))
                if wd:
                    torch._foreach_addcmul_(B[c], P[c], list(wd_scale[own].unbind()))
                torch._foreach_sub_(P[c], B[c])
        return loss

    def _use_fused(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> bool:
        if self.fused is not None:
            return self.fused
        return params[0].device.type == "cpu" and all(
            t.dtype == torch.float32 for t in (*params, *grads)
        )

    def _use_onepass(self, params: list[torch.Tensor]) -> bool:
        if self.onepass is not None:
            return self.onepass
        return self.fused is None and params[0].device.type != "cpu"

    def _step_onepass(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        bufs: list[torch.Tensor],
        group: dict[str, Any],
        adapt: bool,
    ) -> None:
        """Norms (two reads) then scaleout::lars_apply_ with s = lr t per tensor on the device."""
        lr, wd = group["lr"], group["weight_decay"]
        if adapt:
            scale = lars_scales(
                sq_norms(params), sq_norms(grads), lr, group["eta"], wd, group["eps"],
                group["trust_clamp"],
            )  # fmt: skip
        else:
            scale = None  # every tensor: s = lr
        chunk = default_chunk(params[0].device) if self.chunk == "auto" else self.chunk
        torch.ops.scaleout.lars_apply_(
            params, grads, bufs, scale, lr, group["momentum"], wd, chunk or 0
        )

    def _fused_cpu(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        bufs: list[torch.Tensor],
        group: dict[str, Any],
        adapt: bool,
    ) -> None:
        """The fp32 CPU path: torch's fused SGD kernel, which in one pass over w, g and b computes

        b = momentum b + (1 - dampening) (g + wd w);   w = w - lr b.

        With lr = 1 and dampening = 1 - s (the kernel forms 1 - dampening in double precision) this
        is the MLPerf LARS update with s = lr t. An excluded group shares s = lr: one call for all
        its tensors. An adapted group needs the norms first (two reads), then one call per tensor,
        since each has its own t (one kernel per tensor, as multi_tensor_apply launches one per
        chunk; no chain of ops per tensor).
        """
        lr, mom, wd = group["lr"], group["momentum"], group["weight_decay"]

        def fused(
            p: list[torch.Tensor], g: list[torch.Tensor], b: list[torch.Tensor], s: float
        ) -> None:
            torch._fused_sgd_(
                p,
                g,
                b,
                weight_decay=wd,
                momentum=mom,
                lr=1.0,
                dampening=1.0 - s,
                nesterov=False,
                maximize=False,
                is_first_step=False,
            )

        def plain(p: torch.Tensor, g: torch.Tensor, b: torch.Tensor, s: float) -> None:
            b.mul_(mom).add_(g, alpha=s)
            if wd:
                b.add_(p, alpha=s * wd)
            p.sub_(b)

        # the kernel walks memory linearly: tensors whose w, g, b are not all contiguous take plain
        # ops
        flat = [
            p.is_contiguous() and g.is_contiguous() and b.is_contiguous()
            for p, g, b in zip(params, grads, bufs, strict=True)
        ]
        if not adapt:
            if not exact_in_kernel(lr):
                flat = [False] * len(params)
            idx = [i for i, ok in enumerate(flat) if ok]
            if idx:
                fused([params[i] for i in idx], [grads[i] for i in idx], [bufs[i] for i in idx], lr)
            for i, ok in enumerate(flat):
                if not ok:
                    plain(params[i], grads[i], bufs[i], lr)
            return
        eta, eps, clamp = group["eta"], group["eps"], group["trust_clamp"]
        n = len(params)
        norms = torch.stack([*torch._foreach_norm(params), *torch._foreach_norm(grads)]).tolist()
        for i in range(n):
            s = lars_scale(norms[i], norms[n + i], lr, eta, wd, eps, clamp)
            if flat[i] and exact_in_kernel(s):
                fused([params[i]], [grads[i]], [bufs[i]], s)
            else:
                plain(params[i], grads[i], bufs[i], s)

    def _buffers(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        states = [self.state[p] for p in params]
        for p, s in zip(params, states, strict=True):
            if not s:
                s["momentum_buffer"] = fp32_state_like(p)
        return [s["momentum_buffer"] for s in states]
