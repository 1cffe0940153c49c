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


# Markers of a failed collective in gloo's / c10d's error text (torch 2.13 raises plain RuntimeError):
# a timeout, a peer that closed or reset its connection.
_COMM_MARKERS = (
    "Timed out waiting",
    "Connection closed by peer",
    "Connection reset by peer",
    "gloo/transport",
    "DistBackendError",
    "NCCL error",
)


def is_comm_failure(exc: BaseException) -> bool:
    """A failed collective (timeout, dead peer), as opposed to a bug or bad input."""
    from scaleout.comm.handles import CommFailed

    if isinstance(exc, CommFailed | dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _COMM_MARKERS)


def exit_on_comm_failure(world: Any, exc: BaseException, code: int = 1) -> None:
    """Print one line naming this rank, the error and the ranks whose heartbeat stopped, then end the
    process at once (``os._exit``): the collective sequence is broken, peers are being stopped by the
    launcher, and an orderly shutdown could block on a group whose peer is gone. NCCL's watchdog tears a
    process down for the same reason (TORCH_NCCL_ASYNC_ERROR_HANDLING=3)."""
    import sys

    from scaleout.train.liveness import describe_rank, unresponsive_verdict

    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    print(
        f"scaleout: {describe_rank(world, world.rank)}: a collective failed "
        f"(collective timeout {world.timeout_s:g} s): {first}",
        file=sys.stderr,
        flush=True,
    )
    verdict = unresponsive_verdict(world, world.timeout_s) if world.world_size > 1 else "single rank"
    print(f"scaleout: {describe_rank(world, world.rank)}: {verdict}", file=sys.stderr, flush=True)
    import logging

    logging.shutdown()  # flush the MLPerf log and other file handlers
    sys.stdout.flush()
    os._exit(code)


# Exit code of a run stopped because it diverged (train.max_consecutive_skips): a plain failure.
EXIT_ABORTED = 1
