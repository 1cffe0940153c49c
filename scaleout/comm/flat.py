"""``flat``: torch.distributed's own all_reduce on the world group -- the baseline.

gloo runs a ring (or halving-doubling) over all p ranks, so every node boundary carries
2(p-1)/p * n bytes each way; NCCL picks ring/tree itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from scaleout.world import World


def flat(buf: torch.Tensor, world: World) -> None:
    if world.world_size > 1 and buf.numel():
        dist.all_reduce(buf, group=world.group)


def flat_async(buf: torch.Tensor, world: World) -> Any:
    """The native async work (no comm thread needed: it is a single collective)."""
    if world.world_size > 1 and buf.numel():
        return dist.all_reduce(buf, group=world.group, async_op=True)
    return None
