"""What LAMB, LARS and the sharded LAMB share: hyper-parameter checks, fp32 state, chunk
planning."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from scaleout.errors import ConfigError
from scaleout.optim.chunks import ChunkPlan, default_chunk, plan_chunks
from scaleout.optim.lazy_dynamo import defer_dynamo_import

defer_dynamo_import()  # every optimizer's construction would import torch._dynamo (lazy_dynamo.py)


def check_hparams(where: str, **values: Any) -> None:
    """Raise a one-line ConfigError for an impossible hyper-parameter, naming it and the expected
    range."""
    for key, val in values.items():
        if val is None:
            continue
        if key == "betas":
            if len(val) != 2:
                raise ConfigError(f"{where}: betas={val!r} must be a pair (beta1, beta2)")
            for i, b in enumerate(val):
                if not (isinstance(b, (int, float)) and 0.0 <= b < 1.0):
                    raise ConfigError(f"{where}: betas[{i}]={b!r} must be in [0, 1)")
            continue
        if not isinstance(val, (int, float)) or isinstance(val, bool) or not math.isfinite(val):
            raise ConfigError(f"{where}: {key}={val!r} must be a finite number")
        if key in ("lr", "eps", "weight_decay", "end_lr") and val < 0:
            raise ConfigError(f"{where}: {key}={val!r} must be >= 0")
        if key == "momentum" and not 0.0 <= val < 1.0:
            raise ConfigError(f"{where}: momentum={val!r} must be in [0, 1)")
        if key in ("eta", "trust_clamp", "clip_grad_norm") and val <= 0:
            raise ConfigError(f"{where}: {key}={val!r} must be > 0 (or unset)")


def clip_factor(norm: float, max_norm: float | None) -> float:
    """apex FusedLAMB's global clipping: scale every gradient by max_norm / ||g|| when the global
    norm exceeds max_norm (1 when clipping is off, or when the norm is not finite: that step is
    skipped anyway)."""
    if max_norm is None or not math.isfinite(norm):
        return 1.0
    return max_norm / max(norm, max_norm)


def fp32_state_like(p: torch.Tensor) -> torch.Tensor:
    """Optimizer state is fp32 whatever the parameter dtype (bf16 parameters keep fp32 moments)."""
    dtype = torch.float32 if p.dtype in (torch.float16, torch.bfloat16, torch.float32) else p.dtype
    return torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)


def sq_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Squared L2 norms of the tensors as one fp32 vector (computed in fp32 for bf16 inputs)."""
    if not tensors:
        return torch.zeros(0)
    norms = torch._foreach_norm(list(tensors), 2, dtype=torch.float32)
    return torch.stack(norms).square_()


def scalars(values: torch.Tensor) -> list[Any]:
    """Per-tensor scalars for a foreach op: Python floats on CPU (no sync to pay), 0-d tensors
    elsewhere (no host sync; the foreach op then takes its per-tensor path)."""
    return values.tolist() if values.device.type == "cpu" else list(values.unbind())


class CheckedGroups:
    """Mixin for a ``torch.optim.Optimizer``: every parameter group's hyper-parameters named in
    ``HPARAMS`` are checked as it is added (a one-line ConfigError naming the optimizer, the key and
    the expected range) and its step count starts at 0."""

    HPARAMS: ClassVar[tuple[str, ...]] = ()
    param_groups: list[dict[str, Any]]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)  # type: ignore[misc]
        g = self.param_groups[-1]
        check_hparams(type(self).__name__, **{k: g[k] for k in self.HPARAMS})
        g.setdefault("step", 0)


class ChunkedOptimizer(torch.optim.Optimizer):
    """torch.optim.Optimizer plus: fp32 state kept fp32 on load, and cached chunk plans per
    group."""

    def __init__(self, params: Any, defaults: dict[str, Any], chunk: int | None | str = "auto"):
        if chunk != "auto" and chunk is not None and (not isinstance(chunk, int) or chunk < 1):
            raise ConfigError(
                f"chunk={chunk!r} must be a positive number of elements, None or 'auto'"
            )
        self.chunk = chunk
        self._plans: dict[tuple, ChunkPlan] = {}
        self._scratch_flat: torch.Tensor | None = None
        self._scratch_views: dict[tuple, list[torch.Tensor]] = {}
        super().__init__(params, defaults)

    def scratch(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """fp32 work space shaped like ``params``: views into one flat buffer kept between steps.

        Not optimizer state (never saved): it holds a value only within one step. Kept because on
        CPU a fresh multi-hundred-MB tensor per step costs more in page faults than the arithmetic
        it serves. One buffer (the largest group's size) serves every group, since groups are
        stepped one at a time.
        """
        key = (tuple(tuple(p.shape) for p in params), params[0].device)
        views = self._scratch_views.get(key)
        if views is None:
            total = sum(p.numel() for p in params)
            flat = self._scratch_flat
            if flat is None or flat.numel() < total or flat.device != params[0].device:
                flat = self._scratch_flat = torch.empty(
                    total, dtype=torch.float32, device=params[0].device
                )
                self._scratch_views.clear()
            views = [
                v.view(p.shape)
                for v, p in zip(
                    flat[:total].split([p.numel() for p in params]), params, strict=True
                )
            ]
            self._scratch_views[key] = views
        return views

    def plan(self, params: Sequence[torch.Tensor]) -> ChunkPlan:
        chunk = default_chunk(params[0].device) if self.chunk == "auto" else self.chunk
        numels = tuple(p.numel() for p in params)
        split = tuple(p.is_contiguous() for p in params)
        device = params[0].device
        key = (chunk, numels, split, device)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = plan_chunks(numels, chunk, split, device)
        return plan

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # torch casts floating state to the parameter dtype on load; our moments stay fp32 for bf16
        # params, so put the saved tensors back at their own dtype (once per load, not in the step).
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params, strict=True):
            for key, value in state_dict["state"].get(pid, {}).items():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    self.state[p][key] = value.to(device=p.device, copy=True)

    @staticmethod
    def grads_of(group: dict[str, Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        params = [p for p in group["params"] if p.grad is not None]
        grads = [p.grad for p in params]
        for p, g in zip(params, grads, strict=True):
            if g.is_sparse:
                raise ConfigError(
                    f"sparse gradient for a parameter of shape {tuple(p.shape)}: LAMB/LARS need "
                    "dense gradients"
                )
        return params, grads


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensor state an optimizer holds on this rank (any torch optimizer, or
    ShardedLAMB)."""
    own = getattr(optimizer, "state_bytes", None)
    if callable(own):
        return int(own())
    return sum(
        t.numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
