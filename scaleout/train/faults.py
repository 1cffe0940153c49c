"""Per-step agreement between ranks, and fault injection for tests.

One tiny MAX all-reduce per step carries [non-finite gradients here, stop requested here, notice received
here, SIGTERM received here], so every rank takes the same decision: skip the step if any rank saw NaN/Inf
(with the sharded optimizer a rank only sees its own shard, so the reduced gradients alone cannot tell
everyone), stop (checkpoint, exit) if any rank was signalled, requeue if any rank got a notice, and leave
out the optional end-of-run collectives if any rank got SIGTERM. The end of the run uses these agreed
flags, never a rank's own: a SIGTERM that reached some ranks only, or after the agreement, must not send
ranks into different collectives.
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
    notice: bool = False  # some rank received a preemption notice (so far)
    terminate: bool = False  # some rank received SIGTERM (so far)


def grads_finite(params: list[torch.nn.Parameter]) -> bool:
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return True
    norms = torch._foreach_norm(grads)  # one fused pass; NaN/Inf anywhere makes its tensor's norm non-finite
    return bool(torch.isfinite(torch.stack(norms)).all())


def agree(world: Any, nonfinite: bool, stop: bool, notice: bool = False, terminate: bool = False) -> StepFlags:
    flags = torch.tensor([float(nonfinite), float(stop), float(notice), float(terminate)], device=world.device)
    if world.world_size > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    skip, stop_, notice_, term = (bool(v > 0) for v in flags.tolist())  # one device->host copy
    return StepFlags(skip=skip, stop=stop_, notice=notice_, terminate=term)


def injected_nan(step: int, rank: int) -> bool:
    """SCALEOUT_INJECT_NAN="STEP:RANK[,STEP:RANK...]": poison one rank's gradients after the reduction at
    that step (a test hook that simulates a corrupted rank; see tests/test_train.py)."""
    spec = os.environ.get("SCALEOUT_INJECT_NAN", "")
    return any(item == f"{step}:{rank}" for item in spec.split(",") if item)
