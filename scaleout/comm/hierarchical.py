"""``hierarchical``: intra-node reduce-scatter -> inter-node all-reduce of each shard among
same-local-rank peers -> intra-node all-gather (Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE, NVIDIA's
DistributedFusedLAMB). The phases and their chunk pipeline are in :mod:`scaleout.comm.grid`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scaleout.comm.grid import Grid

if TYPE_CHECKING:
    from scaleout.world import World


def hierarchical_grid(world: World) -> Grid:
    """Rows = the ranks of this node, columns = this local rank on every node."""
    world.require_uniform("the hierarchical all-reduce")
    return Grid(world.rank, tuple(world.intra_ranks), world.intra, world.inter, world.num_nodes)
