"""Step-based learning-rate schedule: linear warmup, then polynomial decay to ``end_lr``.

Both MLPerf references use this shape with the step count of completed optimizer steps (lr = 0 at
step 0):

* ResNet-50 (TF2 reference, ``PolynomialDecayWithWarmup``): lr = base * step / warmup during warmup,
  then (base - end) * (1 - (step - warmup) / (total - warmup))^power + end; the reference uses power
  2. This is ``decay_from="warmup"`` (the default).
* BERT (TF reference ``optimization.py``): the same warmup, but the polynomial decay counts from
  step 0 over all ``total`` steps (so it resumes below base after warmup); power 1. This is
  ``decay_from="start"``. NVIDIA's PyTorch submissions do the same (``schedulers.py``
  ``LinearWarmupPolyDecayScheduler``: the decay progress is ``(step - offset) / total_steps``, never
  shifted by the warm-up).

``start_warmup_step`` (BERT, ``decay_from="start"`` only; <= 0): warm-up as if
``-start_warmup_step`` steps had already passed, as NVIDIA's MLPerf BERT configs
(``START_WARMUP_STEP=-76``). Exactly their scheduler, which is stepped before each optimizer step
with the 1-based step ``k = s + 1`` (``s`` = completed steps) and subtracts ``offset = 1`` only when
``start_warmup_step == 0``::

    mod = k - offset - start_warmup_step
    lr  = base * mod / warmup                              if mod < warmup
    lr  = (base - end) * (1 - min((k - offset) / total, 1)) ** power + end   otherwise

With ``start_warmup_step = 0`` this is the plain ``decay_from="start"`` schedule (``mod = s``). With
-76 the decay runs one step ahead (``(s + 1) / total``); Google's TF reference (``optimization.py``)
instead uses ``s`` in both places. NVIDIA's ``warmup + 1e-6`` denominator (a relative 3e-9) is left
out.

After ``total_steps`` the rate stays at ``end_lr``; with ``total_steps=None`` it stays at base after
warmup.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from scaleout.config.schema import warmup_end
from scaleout.errors import ConfigError
from scaleout.optim.base import check_hparams


@dataclass
class WarmupPoly:
    """lr(step) as a factor of the base rate (a callable object so LambdaLR saves it in its
    state_dict)."""

    warmup_steps: int = 0
    total_steps: int | None = None
    power: float = 1.0
    end_factor: float = 0.0  # end_lr / base lr
    decay_from: Literal["warmup", "start"] = "warmup"
    start_warmup_step: int = 0  # <= 0: NVIDIA's START_WARMUP_STEP (module docstring)

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps={self.warmup_steps} must be >= 0")
        if self.total_steps is not None and self.total_steps <= warmup_end(
            self.warmup_steps, self.start_warmup_step
        ):
            raise ConfigError(
                f"total_steps={self.total_steps} must be > warmup_steps={self.warmup_steps}"
                + (
                    f" + start_warmup_step={self.start_warmup_step}"
                    if self.start_warmup_step
                    else ""
                )
            )
        if self.power < 0:
            raise ConfigError(f"power={self.power} must be >= 0")
        if self.decay_from not in ("warmup", "start"):
            raise ConfigError(f"decay_from={self.decay_from!r} must be 'warmup' or 'start'")
        if self.start_warmup_step > 0:
            raise ConfigError(
                f"start_warmup_step={self.start_warmup_step} must be <= 0 (warm-up already under "
                "way)"
            )
        if self.start_warmup_step and self.decay_from != "start":
            raise ConfigError(
                f"start_warmup_step={self.start_warmup_step} needs decay_from='start' (NVIDIA's "
                f"LinearWarmupPolyDecayScheduler), got decay_from={self.decay_from!r}"
            )

    def __call__(self, step: int) -> float:
        if self.start_warmup_step:
            return self._nvidia(step)
        if step < self.warmup_steps:
            return step / self.warmup_steps
        if self.total_steps is None:
            return 1.0
        start = self.warmup_steps if self.decay_from == "warmup" else 0
        frac = min(step - start, self.total_steps - start) / (self.total_steps - start)
        return (1.0 - self.end_factor) * (1.0 - frac) ** self.power + self.end_factor

    def _nvidia(self, step: int) -> float:
        """NVIDIA's LinearWarmupPolyDecayScheduler with start_warmup_step != 0 (offset 0, k =
        step + 1)."""
        k = step + 1
        mod = k - self.start_warmup_step
        if mod < self.warmup_steps:
            return mod / self.warmup_steps
        if self.total_steps is None:
            return 1.0
        frac = min(k / self.total_steps, 1.0)
        return (1.0 - self.end_factor) * (1.0 - frac) ** self.power + self.end_factor


@dataclass
class WarmupCosine:
    """Linear warm-up to the base rate, then half a cosine down to ``end_factor`` at ``total_steps``
    (then flat): MLPerf ``llama31_8b``'s "cosine with linear warmup" (Megatron-LM's
    ``OptimizerParamScheduler``, decay style cosine, which NeMo's reference and NVIDIA's submissions
    run)::

        lr = base * step / warmup                                          step < warmup
        lr = end + (base - end) * (1 + cos(pi * (step - warmup) / (total - warmup))) / 2

    ``total_steps=None`` keeps the base rate after warm-up."""

    warmup_steps: int = 0
    total_steps: int | None = None
    end_factor: float = 0.0  # end_lr / base lr

    def __post_init__(self) -> None:
        WarmupPoly(self.warmup_steps, self.total_steps)  # the same checks on the two step counts

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return step / self.warmup_steps
        if self.total_steps is None:
            return 1.0
        frac = min(step - self.warmup_steps, self.total_steps - self.warmup_steps) / (
            self.total_steps - self.warmup_steps
        )
        return self.end_factor + (1.0 - self.end_factor) * 0.5 * (1.0 + math.cos(math.pi * frac))


def warmup_cosine(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int = 0,
    total_steps: int | None = None,
    end_lr: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR (call ``.step()`` after every optimizer step) following :class:`WarmupCosine`;
    ``end_lr`` as in :func:`warmup_poly`."""
    check_hparams("schedule", end_lr=end_lr)
    base = optimizer.param_groups[0]["lr"]
    schedule = WarmupCosine(warmup_steps, total_steps, end_lr / base if base > 0 else 0.0)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def warmup_poly(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int = 0,
    total_steps: int | None = None,
    power: float = 1.0,
    end_lr: float = 0.0,
    decay_from: Literal["warmup", "start"] = "warmup",
    start_warmup_step: int = 0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR (call ``.step()`` after every optimizer step) following :class:`WarmupPoly`.

    ``end_lr`` is absolute for the first group's base rate; other groups end at the same fraction of
    theirs.
    """
    check_hparams("schedule", end_lr=end_lr)
    base = optimizer.param_groups[0]["lr"]
    end_factor = end_lr / base if base > 0 else 0.0
    schedule = WarmupPoly(
        warmup_steps, total_steps, power, end_factor, decay_from, start_warmup_step
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
