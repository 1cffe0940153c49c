"""A DistributedDataParallel communication hook that averages each gradient bucket with one of the
registry's algorithms:

    model = DistributedDataParallel(module)
    model.register_comm_hook(None, ddp_hook("hierarchical", world))

DDP calls the hook once per bucket, in the same bucket order on every rank, and waits on the returned
future before the optimizer step; our handle's future completes after every phase.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from scaleout.comm.api import all_reduce, get_algorithm

if TYPE_CHECKING:
    from scaleout.world import World


def ddp_hook(
    algorithm: str, world: World, **options: Any
) -> Callable[[Any, Any], torch.futures.Future]:
    get_algorithm(algorithm)  # fail now, not inside backward

    # Unannotated on purpose: DDP's _check_comm_hook compares annotations with dist.GradBucket, and
    # under `from __future__ import annotations` they would be strings.
    def hook(_state, bucket):  # noqa: ANN001, ANN202
        buf = bucket.buffer()
        return all_reduce(buf, world, algorithm, op="avg", async_op=True, **options).future

    return hook
