"""Topology-aware collectives: ``all_reduce(tensor, world, algorithm=..., op=..., async_op=...)``, and
``reduce_scatter`` / ``all_gather`` (with ``shard_index``) for sharded optimizers.

Algorithms live in one registry (:data:`ALGORITHMS`): ``flat`` (baseline), ``hierarchical``,
``torus2d``. See docs/collectives.md.
"""

from scaleout.comm.api import ALGORITHMS, Algorithm, all_reduce, get_algorithm, register
from scaleout.comm.ddp_hook import ddp_hook
from scaleout.comm.handles import Handle
from scaleout.comm.shard import all_gather, reduce_scatter, shard_index

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "Handle",
    "all_gather",
    "all_reduce",
    "ddp_hook",
    "get_algorithm",
    "reduce_scatter",
    "register",
    "shard_index",
]
