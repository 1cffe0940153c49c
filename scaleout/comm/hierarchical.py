"""``hierarchical``: intra-node reduce-scatter -> inter-node all-reduce of each shard among
same-local-rank peers -> intra-node all-gather (Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE, NVIDIA's
DistributedFusedLAMB). The phases and their chunk pipeline are in :mod:`scaleout.comm.grid`.

Cost: 2(g-1) + 2(k-1) latency steps, 2(k-1)/k * n bytes through each node's NICs (g column rings at
once, sharing them); the row/column plan is :func:`scaleout.sim.cost.grid_plan` with X = g.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scaleout.comm.algorithm import register
from scaleout.comm.rowcol import GridAlgorithm, GridOptions

if TYPE_CHECKING:
    from scaleout.comm.grid import Grid
    from scaleout.world import World


class Hierarchical(GridAlgorithm):
    name = "hierarchical"
    help = (
        "intra-node reduce-scatter -> inter-node all-reduce -> intra-node all-gather, "
        "chunk-pipelined"
    )
    Options = GridOptions

    def grid(self, world: World, opts: Any) -> Grid:
        """Rows = the ranks of this node, columns = this local rank on every node."""
        from scaleout.comm.grid import Grid  # deferred: torch runtime

        world.require_uniform("the hierarchical all-reduce")
        return Grid(
            world.rank,
            tuple(world.intra_ranks),
            world.intra,
            world.inter,
            world.num_nodes,
            lambda: world.partition("intra_gather", world.ranks_per_node, shared=False),
        )

    def row_length(self, opts: Any, world_size: int, ranks_per_node: int) -> int:
        return ranks_per_node


register(Hierarchical())
