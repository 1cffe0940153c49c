"""What a training loop asks of whatever averages the gradients over the ranks.

Two implementations: :class:`~scaleout.parallel.DataParallel` (replicated optimizer state; the
reducer all-reduces gradients into bucket views during backward) and
:class:`~scaleout.optim.ShardedLAMB` (ZeRO-1: the optimizer reduce-scatters gradients into its shard
and owns its state in pieces). The trainer holds one of them as ``sync`` and never asks which: what
one of them has nothing for, it answers with None or does nothing (the sharded LAMB has no reduced
gradient buffers, no rider and no wire wait of its own to fill).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class GradientSync(Protocol):
    #: ``.grad`` are views into communication buffers: zero them in place, never set them to None.
    grads_are_views: bool
    #: True: the sync finds non-finite reduced gradients in its own step and skips it on every
    #: rank alike (the sharded LAMB sums its shards' counts into the norm all-reduce its step makes
    #: anyway), so the step's agreement does not carry a non-finite flag of this rank's.
    finds_nonfinite: bool

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

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients for the next step (views into buffers: zeroed in place whatever
        ``set_to_none`` says)."""
        ...

    def reduced_grads(self) -> list[torch.Tensor] | None:
        """The reduced gradients as a few flat tensors (their communication buffers), for a
        non-finite check of one pass over them; None when there are none (then every ``.grad``)."""
        ...

    def nonfinite_flag(self) -> torch.Tensor | None:
        """1.0 on the device if a reduced gradient of the last synchronisation is NaN/Inf, found
        for free while averaging (nothing read); None when the sync has no such flag."""
        ...

    def ride(self, fill: Callable[[torch.Tensor], None] | None) -> bool:
        """Offer ``fill(view)`` to write a caller's values (the step's agreement) into the last
        gradient buffer as it goes out, once, in the next synchronisation: the values are summed
        over the ranks with the gradients (:meth:`ride_result`). False when nothing can ride
        (then ``fill`` is not kept); None withdraws an earlier offer."""
        ...

    def ride_result(self) -> torch.Tensor | None:
        """The sums of what the last synchronisation's ``fill`` wrote; None when nothing rode."""
        ...

    def while_waiting(self, work: Callable[[], None]) -> None:
        """Run ``work`` once, in the next synchronisation, while the host would sit idle waiting
        for the wire (no CUDA stream, no comm-thread schedule needing the GIL); its seconds are
        ``last_stats["idle_s"]``. A sync with no such wait drops it."""
        ...
