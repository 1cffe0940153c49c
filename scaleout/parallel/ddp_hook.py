"""The same all-reduce algorithms (and compression) inside torch's own DistributedDataParallel:

    ddp = DistributedDataParallel(model, bucket_cap_mb=25)
    ddp.register_comm_hook(None, ddp_comm_hook("hierarchical", world, compression="bf16"))

Without compression each bucket is divided by the world size and summed with the algorithm. With
compression it also pre-divides the bucket by the world size, casts it to bf16/fp16, sums it with
the algorithm and casts the result back into the bucket's dtype -- the same arithmetic as
:class:`scaleout.DataParallel`, so the two are interchangeable (torch's own ``fp16_compress_hook``
does the same division before the cast since PyTorch issue #57410).
"""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook inspects the hook's
# annotations and rejects anything but the real ``dist.GradBucket`` /
# ``torch.futures.Future[Tensor]``.
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from scaleout.comm.collective import Collective
from scaleout.parallel.reducer import compression_dtype

if TYPE_CHECKING:
    from scaleout.world import World


def ddp_comm_hook(
    algorithm: str, world: "World", compression: str | None = None, **options: Any
) -> Callable[[Any, Any], torch.futures.Future]:
    """A ``register_comm_hook`` hook averaging each DDP bucket with ``algorithm`` (and
    compression)."""
    # resolved now (a one-line error here, not inside backward), not per bucket
    collective = Collective.resolve(world, algorithm, **options)
    dtype = compression_dtype(compression)
    p = world.world_size

    def hook(_state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        if dtype is None:  # pre-divide like DDP's default hook; the sum is then the average
            wire = buf.div_(p)
            return collective.all_reduce(wire, async_op=True).future
        wire = buf.div(p).to(dtype)
        handle = collective.all_reduce(wire, async_op=True)

        def back(_fut: torch.futures.Future) -> torch.Tensor:
            buf.copy_(wire)
            return buf

        return handle.future.then(back)

    return hook
