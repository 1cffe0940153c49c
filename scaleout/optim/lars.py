"""LARS (You, Gitman, Ginsburg, arXiv 1708.03888) with the MLPerf ResNet-50 reference rules.

The MLPerf reference (mlcommons/training, image_classification, TensorFlow ``LARSOptimizer``) does, for
every tensor w with gradient g and momentum buffer b (zero-initialised):

    adapted tensors:   t = eta ||w|| / (||g|| + wd ||w|| + eps)   (t = 1 if ||w|| = 0 or ||g|| = 0)
                       b = momentum b + lr t (g + wd w)
    excluded tensors:  b = momentum b + lr g                     (batch norm and bias: no decay, no t)
                       w = w - b

so the learning rate sits inside the momentum buffer, and weight decay is applied exactly where the trust
ratio is. A group is adapted when ``trust_ratio=True``, or by default when its weight decay is non-zero
(``param_groups(model, no_decay=LARS_EXCLUDE)`` builds the two groups). eta = 0.001 and eps = 0 are the
reference defaults.

Speed (CPU): the norms are two reads over whole tensors; the update then runs chunk by chunk
(mul, addcmul, addcmul, sub) so that g, w and b come from DRAM once more: 7 array passes in all against
8-11 for SGD-momentum-foreach.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from scaleout.optim.base import ChunkedOptimizer, check_hparams, fp32_state_like, sq_norms
from scaleout.optim.chunks import pieces

LARS_ETA = 0.001  # trust coefficient of the MLPerf ResNet reference (and You et al. 2017)


def lars_scales(
    wsq: torch.Tensor, gsq: torch.Tensor, lr: float, eta: float, wd: float, eps: float, clamp: float | None = None
) -> torch.Tensor:
    """Per-tensor lr * t from squared norms; t = 1 where either norm is 0 (MLPerf reference)."""
    wn, gn = wsq.sqrt(), gsq.sqrt()
    ok = (wn > 0) & (gn > 0)
    denom = torch.where(ok, gn + wd * wn + eps, torch.ones_like(gn))
    t = torch.where(ok, eta * wn / denom, torch.ones_like(wn))
    if clamp is not None:
        t = t.clamp(max=clamp)
    return t * lr


class LARS(ChunkedOptimizer):
    """LARS with momentum, MLPerf form (see the module docstring).

    Group keys: lr, momentum, weight_decay, eta, eps, trust_clamp, trust_ratio (None = adapt iff
    weight_decay != 0). ``chunk``: elements per cache block on CPU ('auto'), None = whole tensors.
    """

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
    ):
        defaults = dict(
            lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta, eps=eps, trust_clamp=trust_clamp,
            trust_ratio=trust_ratio,
        )
        super().__init__(params, defaults, chunk)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        check_hparams(
            "LARS", lr=g["lr"], momentum=g["momentum"], weight_decay=g["weight_decay"], eta=g["eta"], eps=g["eps"],
            trust_clamp=g["trust_clamp"],
        )
        g.setdefault("step", 0)

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
            plan = self.plan(params)
            P, G, B = pieces(params, plan), pieces(grads, plan), pieces(bufs, plan)
            lr, mom, wd = group["lr"], group["momentum"], group["weight_decay"]
            adapt = group["trust_ratio"] if group["trust_ratio"] is not None else wd != 0.0
            if not adapt:
                for c in range(plan.num_chunks):
                    torch._foreach_mul_(B[c], mom)
                    torch._foreach_add_(B[c], G[c], alpha=lr)
                    if wd:
                        torch._foreach_add_(B[c], P[c], alpha=lr * wd)
                    torch._foreach_sub_(P[c], B[c])
                continue
            scale = lars_scales(sq_norms(params), sq_norms(grads), lr, group["eta"], wd, group["eps"], group["trust_clamp"])
            wd_scale = scale * wd
            for c in range(plan.num_chunks):
                own = plan.owner[c]
                torch._foreach_mul_(B[c], mom)
                # b += (lr t) g + (lr t wd) w with per-tensor scalars given as 0-d tensors (addcmul broadcasts
                # them), which also keeps the arithmetic in fp32 for bf16 parameters and gradients.
                torch._foreach_addcmul_(B[c], G[c], list(scale[own].unbind()))
                if wd:
                    torch._foreach_addcmul_(B[c], P[c], list(wd_scale[own].unbind()))
                torch._foreach_sub_(P[c], B[c])
        return loss

    def _buffers(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        states = [self.state[p] for p in params]
        for p, s in zip(params, states, strict=True):
            if not s:
                s["momentum_buffer"] = fp32_state_like(p)
        return [s["momentum_buffer"] for s in states]
