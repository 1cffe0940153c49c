"""torch's AdamW with MLPerf ``llama31_8b``'s global gradient clipping (``optim.clip_grad_norm``).

The trainer calls ``step()`` after the gradient reduction, so the norm clipped here is the norm of
the averaged gradient that every rank holds: clipping after the reduction, as Megatron-LM and
NVIDIA's submissions do (``clip_grad=1.0``), not each rank's local gradient before it. The sharded
mode (``optim.sharded=true``) is :class:`scaleout.optim.sharded.ShardedLAMB` with the trust ratio
off (scaleout/optim/factory.py), which clips over its shards the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from scaleout.optim.base import check_hparams


class ClippedAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose ``step()`` first scales every gradient by
    ``min(1, clip_grad_norm / ||g||)`` (``torch.nn.utils.clip_grad_norm_``; ``None`` = off).
    ``last_grad_norm`` is the norm before clipping (the last step's)."""

    def __init__(self, params: Any, clip_grad_norm: float | None = None, **kw: Any):
        check_hparams("AdamW", clip_grad_norm=clip_grad_norm)
        self.clip_grad_norm = clip_grad_norm
        self.last_grad_norm: float | None = None
        super().__init__(params, **kw)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if self.clip_grad_norm is not None:
            grads = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            if grads:
                norm = torch.nn.utils.clip_grad_norm_(grads, self.clip_grad_norm, foreach=True)
                self.last_grad_norm = float(norm)
        return super().step(closure)
