"""Per-step agreement between ranks, and fault injection for tests.

One tiny MAX all-reduce per step carries [non-finite gradients here, stop requested here], so every rank
takes the same decision: skip the step if any rank saw NaN/Inf (with the sharded optimizer a rank only
sees its own shard, so the reduced gradients alone cannot tell everyone), stop (checkpoint, exit) if any
rank got a preemption notice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class StepFlags:
    skip: bool
    stop: bool


def grads_finite(params: list[torch.nn.Parameter]) -> bool:
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return True
    norms = torch._foreach_norm(grads)  # one fused pass; NaN/Inf anywhere makes its tensor's norm non-finite
    return bool(torch.isfinite(torch.stack(norms)).all())


def agree(world: Any, nonfinite: bool, stop: bool) -> StepFlags:
    flags = torch.tensor([float(nonfinite), float(stop)], device=world.device)
    if world.world_size > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return StepFlags(skip=bool(flags[0] > 0), stop=bool(flags[1] > 0))


def injected_nan(step: int, rank: int) -> bool:
    """SCALEOUT_INJECT_NAN="STEP:RANK[,STEP:RANK...]": poison one rank's gradients after the reduction at
    that step (a test hook that simulates a corrupted rank; see tests/test_train.py)."""
    spec = os.environ.get("SCALEOUT_INJECT_NAN", "")
    return any(item == f"{step}:{rank}" for item in spec.split(",") if item)
