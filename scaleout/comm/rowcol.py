"""The row x column all-reduce that ``hierarchical`` and ``torus2d`` share, as an
:class:`Algorithm`: reduce-scatter along a *row* group, all-reduce of each shard along a *column*
group, all-gather along the row (the schedule itself, chunk-pipelined on gloo, is
:mod:`scaleout.comm.grid`).

A subclass says how its rows are laid out: ``grid(world, opts)`` builds the runtime's groups,
``row_length(opts, world_size, ranks_per_node)`` gives X for the simulator. Torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from scaleout.comm.algorithm import Algorithm, Options
from scaleout.comm.chunking import gloo_chunks

if TYPE_CHECKING:
    import torch

    from scaleout.comm.grid import Grid
    from scaleout.config.schema import CommConfig
    from scaleout.sim.cluster import Cluster
    from scaleout.sim.cost import Plan
    from scaleout.world import World

COMPOSITIONS = ("sharded", "leader")


class GridOptions(Options):
    """``chunk_bytes``: the gloo pipeline's chunk (config ``comm.chunk_mb``; None = 4 MiB).
    ``composition`` (gloo only): 'sharded' (the default) or 'leader' (see scaleout.comm.grid)."""

    chunk_bytes: int | None = Field(None, ge=1)
    composition: Literal["sharded", "leader"] = "sharded"
    config_keys = ("chunk_mb",)

    @classmethod
    def chunk_from_config(cls, comm: CommConfig) -> dict[str, Any]:
        return {"chunk_bytes": max(1, int(comm.chunk_mb * 2**20)) if comm.chunk_mb else None}

    @classmethod
    def from_config(cls, comm: CommConfig) -> GridOptions:
        return cls(**cls.chunk_from_config(comm))


class GridAlgorithm(Algorithm):
    Options = GridOptions

    def grid(self, world: World, opts: Any) -> Grid:
        raise NotImplementedError

    def row_length(self, opts: Any, world_size: int, ranks_per_node: int) -> int:
        raise NotImplementedError

    # -- runtime ----------------------------------------------------------------------------------
    def prepare(self, world: World, opts: Any) -> Grid:
        return self.grid(world, opts)

    def all_reduce(self, buf: torch.Tensor, world: World, opts: Any, prepared: Grid) -> None:
        from scaleout.comm.grid import reduce_grid  # deferred: torch runtime

        reduce_grid(buf, prepared, opts.chunk_bytes, opts.composition)

    def shard_index(self, world: World, opts: Any, prepared: Grid) -> int:
        from scaleout.comm.scatter import grid_shard_index  # deferred: torch runtime

        return grid_shard_index(prepared)

    def reduce_scatter(
        self, out: torch.Tensor, inp: torch.Tensor, world: World, opts: Any, prepared: Grid
    ) -> None:
        from scaleout.comm.scatter import grid_reduce_scatter  # deferred: torch runtime

        grid_reduce_scatter(out, inp, prepared)

    def all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, world: World, opts: Any, prepared: Grid
    ) -> None:
        from scaleout.comm.scatter import grid_all_gather  # deferred: torch runtime

        grid_all_gather(out, inp, prepared)

    # -- cost model -------------------------------------------------------------------------------
    def cost(
        self, opts: Any, cluster: Cluster, nodes: int, nbytes: float, chunks: int | None = None
    ) -> Plan:
        from scaleout.sim.cost import grid_plan  # deferred: numpy cost model

        g = cluster.gpus_per_node
        if chunks is None:
            chunks = gloo_chunks(nbytes, opts.chunk_bytes) if cluster.backend == "gloo" else 1
        return grid_plan(cluster, nodes, nbytes, self.row_length(opts, g * nodes, g), chunks)

    def half_cost(self, kind: str, opts: Any, cluster: Cluster, nodes: int, nbytes: float) -> Plan:
        from scaleout.sim.cost import row_col_half_plan  # deferred: numpy cost model

        g = cluster.gpus_per_node
        return row_col_half_plan(kind, self.row_length(opts, g * nodes, g), cluster, nodes, nbytes)
