"""What a training loop asks of whatever averages the gradients over the ranks.

Two implementations: :class:`~scaleout.parallel.DataParallel` (replicated optimizer state; the
reducer all-reduces gradients into bucket views during backward) and
:class:`~scaleout.optim.ShardedLAMB` (ZeRO-1: the optimizer reduce-scatters gradients into its shard
and owns its state in pieces). The trainer holds one of them as ``sync`` and never asks which.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class GradientSync(Protocol):
    #: ``.grad`` are views into communication buffers: zero them in place, never set them to None.
    grads_are_views: bool

    def no_sync(self) -> AbstractContextManager[None]:
        """Backward passes inside accumulate locally, without communicating (all micro-batches
        but the last)."""
        ...

    @property
    def last_stats(self) -> dict[str, Any]:
        """Of the last synchronising backward; ``exposed_s``: seconds backward waited for
        communication."""
        ...

    def unused_flag(self) -> torch.Tensor | None:
        """1.0 on the device if some parameter got no gradient on any rank in the last
        synchronisation, to fold into the step's one host read; None when the usage is checked
        elsewhere."""
        ...

    def check_unused(self) -> list[str]:
        """Read the usage (a host read: only after unused_flag() was set) and raise as
        configured."""
        ...

    def collectives(self) -> tuple[int, str]:
        """The fingerprint of the last synchronisation's gradient collectives (count, bytes,
        bucket layout: scaleout.train.skew.fingerprint) and the same in words, for the step's
        agreement: ranks whose fingerprints differ are named before a collective hangs."""
        ...

    def optimizer_state(
        self, optimizer: torch.optim.Optimizer
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """(the replicated part of ``optimizer``'s state, which rank 0 writes; this rank's shards
        or None)."""
        ...

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load the replicated part (shards are read in place by scaleout.checkpoint)."""
        ...

    def wait_params(self) -> None:
        """Wait for whatever still writes the parameters after ``optimizer.step()`` (the sharded
        LAMB's all-gathers, otherwise waited for by the next forward), before they are read
        outside a forward: a checkpoint, an evaluation, the end of training."""
        ...
