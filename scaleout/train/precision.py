"""Mixed precision of the training step: ``train.precision: fp32 | bf16 | fp16``.

- ``fp32``: nothing changes.
- ``bf16`` / ``fp16``: the forward and the loss run under ``torch.autocast(device, dtype)``: matmuls
  and convolutions (and attention) in the low precision, softmax / LayerNorm / losses in fp32
  (autocast's op lists). Parameters, gradients and optimizer state stay fp32: the optimizer updates
  fp32 *master* weights and autocast casts them per op (cached within one forward), so no separate
  master copy is kept. Evaluation runs under the same autocast.
- ``fp16`` adds dynamic loss scaling: fp16 stops at 65504 and flushes gradients below ~6e-8 to zero
  (Micikevicius et al. 2018, "Mixed Precision Training", arXiv 1710.03740; NVIDIA's MLPerf BERT ran
  fp16 this way). The loss is multiplied by S before backward and the (reduced) gradients by 1/S
  before the update. S follows ``torch.amp.GradScaler``'s rule and defaults: start at 2**16, halve
  after a step whose gradients are not finite (that step is skipped), double after 2000 finite steps
  in a row.

Unlike ``GradScaler``, which decides per process from its local gradients, the skip decision here is
the trainer's per-step agreement (:func:`scaleout.train.agreement.agree_on_step`): every rank gets
the same flag, so every rank skips the same step and moves S the same way (with a sharded optimizer
no rank sees all gradients, so a local decision would split the ranks). S lives on the host as a
Python float, so scaling and unscaling launch kernels but never wait for the device.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from scaleout.errors import ConfigError

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# torch.amp.GradScaler's defaults (torch/amp/grad_scaler.py).
INIT_SCALE, GROWTH_FACTOR, BACKOFF_FACTOR, GROWTH_INTERVAL = 2.0**16, 2.0, 0.5, 2000


class Precision:
    """The numerics of one run: ``autocast()`` for forward passes, and for fp16 the loss scale."""

    def __init__(
        self,
        name: str,
        device: torch.device | str,
        init_scale: float = INIT_SCALE,
        growth_interval: int = GROWTH_INTERVAL,
    ):
        if name not in DTYPES:
            raise ConfigError(f"train.precision={name!r}: expected one of {sorted(DTYPES)}")
        self.name, self.dtype = name, DTYPES[name]
        self.device_type = torch.device(device).type
        self.scaling = name == "fp16"
        self.scale = float(init_scale) if self.scaling else 1.0
        self.growth_interval = growth_interval
        self.good_steps = 0  # finite steps since the last change of the scale
        self._scale_t: torch.Tensor | None = None

    def autocast(self, cache: bool = True) -> contextlib.AbstractContextManager[Any]:
        """Autocast for forward passes; ``cache=False`` inside a CUDA graph capture (the
        weight-cast cache must not outlive the captured region: torch.cuda.amp docs, "CUDA
        Graphs")."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype, cache_enabled=cache)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """What to call backward on: ``loss * S`` with fp16, ``loss`` otherwise. S is read from a
        device tensor that :meth:`update` refills, so a CUDA graph captured once keeps using the
        current S."""
        if not self.scaling:
            return loss
        if self._scale_t is None or self._scale_t.device != loss.device:
            self._scale_t = torch.full((), self.scale, dtype=torch.float32, device=loss.device)
        return loss * self._scale_t

    def unscale_(self, params: list[torch.Tensor], optimizer: Any = None) -> None:
        """Gradients * 1/S in place, after their reduction and before the finiteness check and
        the update (inf and NaN stay non-finite). An optimizer that holds its reduced gradients
        elsewhere (reduced during backward into its own buffers) unscales them itself through
        ``optimizer.unscale_(factor)``."""
        if not self.scaling:
            return
        own = getattr(optimizer, "unscale_", None)
        if own is not None:
            own(1.0 / self.scale)
            return
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, skipped: bool) -> None:
        """After the agreement: every rank passes the same ``skipped``, so every rank's S stays
        equal."""
        if not self.scaling:
            return
        if skipped:
            self._set(self.scale * BACKOFF_FACTOR)
        elif self.good_steps + 1 >= self.growth_interval:
            self._set(self.scale * GROWTH_FACTOR)
        else:
            self.good_steps += 1

    def _set(self, scale: float) -> None:
        self.scale, self.good_steps = scale, 0
        if self._scale_t is not None:
            self._scale_t.fill_(scale)  # a kernel, not a host read

    def state_dict(self) -> dict[str, Any]:
        return {"precision": self.name, "scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the loss scale; a checkpoint of another precision keeps this run's initial
        scale."""
        if state.get("precision") == self.name:
            self._set(float(state["scale"]))
            self.good_steps = int(state["good_steps"])
