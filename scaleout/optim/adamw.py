"""MLPerf ``llama31_8b``'s global gradient clipping (``optim.clip_grad_norm``) on torch's AdamW.

The trainer calls ``step()`` after the gradient reduction, so the norm clipped here is the norm of
the averaged gradient that every rank holds: clipping after the reduction, as Megatron-LM and
NVIDIA's submissions do (``clip_grad=1.0``), not each rank's local gradient before it. The sharded
mode (``optim.sharded=true``) is :class:`scaleout.optim.sharded.ShardedLAMB` with the trust ratio
off (scaleout/optim/factory.py), which clips over its shards the same way.

A step pre-hook, not a subclass: the optimizer stays torch's own class with torch's one profiled
``step`` (a subclass's ``step`` is wrapped a second time) and its fused CPU kernel.
"""

from __future__ import annotations

from typing import Any

import torch

from scaleout.optim.base import check_hparams


def clip_before_step(optimizer: torch.optim.Optimizer, max_norm: float | None) -> Any:
    """``optimizer`` with every ``step()`` preceded by ``torch.nn.utils.clip_grad_norm_`` over all
    its gradients at ``max_norm`` (None: unchanged). Sets ``optimizer.clip_grad_norm`` and, after
    each step, ``optimizer.last_grad_norm`` (the norm before clipping)."""
    if max_norm is None:
        return optimizer
    check_hparams("AdamW", clip_grad_norm=max_norm)
    optimizer.clip_grad_norm = max_norm  # type: ignore[attr-defined]
    optimizer.last_grad_norm = None  # type: ignore[attr-defined]

    def clip(opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        grads = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if grads:
            norm = torch.nn.utils.clip_grad_norm_(grads, max_norm, foreach=True)
            opt.last_grad_norm = float(norm)  # type: ignore[attr-defined]

    optimizer.register_step_pre_hook(clip)
    return optimizer
