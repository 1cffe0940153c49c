"""Step-based learning-rate schedule: linear warmup, then polynomial decay to ``end_lr``.

Both MLPerf references use this shape with the step count of completed optimizer steps (lr = 0 at step 0):

* ResNet-50 (TF2 reference, ``PolynomialDecayWithWarmup``): lr = base * step / warmup during warmup, then
  (base - end) * (1 - (step - warmup) / (total - warmup))^power + end; the reference uses power 2.
  This is ``decay_from="warmup"`` (the default).
* BERT (TF reference ``optimization.py``): the same warmup, but the polynomial decay counts from step 0 over
  all ``total`` steps (so it resumes below base after warmup); power 1. This is ``decay_from="start"``.

After ``total_steps`` the rate stays at ``end_lr``; with ``total_steps=None`` it stays at base after warmup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from scaleout.errors import ConfigError
from scaleout.optim.base import check_hparams


@dataclass
class WarmupPoly:
    """lr(step) as a factor of the base rate (a callable object so LambdaLR saves it in its state_dict)."""

    warmup_steps: int = 0
    total_steps: int | None = None
    power: float = 1.0
    end_factor: float = 0.0  # end_lr / base lr
    decay_from: Literal["warmup", "start"] = "warmup"

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps={self.warmup_steps} must be >= 0")
        if self.total_steps is not None and self.total_steps <= self.warmup_steps:
            raise ConfigError(f"total_steps={self.total_steps} must be > warmup_steps={self.warmup_steps}")
        if self.power < 0:
            raise ConfigError(f"power={self.power} must be >= 0")
        if self.decay_from not in ("warmup", "start"):
            raise ConfigError(f"decay_from={self.decay_from!r} must be 'warmup' or 'start'")

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return step / self.warmup_steps
        if self.total_steps is None:
            return 1.0
        start = self.warmup_steps if self.decay_from == "warmup" else 0
        frac = min(step - start, self.total_steps - start) / (self.total_steps - start)
        return (1.0 - self.end_factor) * (1.0 - frac) ** self.power + self.end_factor


def warmup_poly(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int = 0,
    total_steps: int | None = None,
    power: float = 1.0,
    end_lr: float = 0.0,
    decay_from: Literal["warmup", "start"] = "warmup",
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR (call ``.step()`` after every optimizer step) following :class:`WarmupPoly`.

    ``end_lr`` is absolute for the first group's base rate; other groups end at the same fraction of theirs.
    """
    check_hparams("schedule", end_lr=end_lr)
    base = optimizer.param_groups[0]["lr"]
    end_factor = end_lr / base if base > 0 else 0.0
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupPoly(warmup_steps, total_steps, power, end_factor, decay_from))
