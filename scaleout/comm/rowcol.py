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

if TYPE_CHECKING:
    import torch

    from scaleout.comm.cost import Plan
    from scaleout.comm.grid import Grid
    from scaleout.config.schema import CommConfig
    from scaleout.sim.cluster import Cluster
    from scaleout.world import World

# Chunk size of the gloo pipeline. 4 MiB: big enough that per-chunk synchronisation (~2-3 ms on a
# busy 2-core box, hidden behind the in-flight column all-reduces) stays small next to a chunk's ~35
# ms on a 1 Gbit link, small enough that pipeline fill + drain (one chunk's reduce-scatter and
# all-gather over loopback) stays a few % of a 64 MiB all-reduce. 2, 4 and 8 MiB measured within
# noise of each other (docs/collectives.md, `scaleout bench allreduce --chunk-bytes
# 2MiB,4MiB,8MiB`).
DEFAULT_CHUNK_BYTES = 4 << 20
# At most this many chunks per call: each chunk costs ~2-3 ms of synchronisation on a 2-core box
# (measured: 1M fp32 in 16 KiB chunks = 245 chunks took 0.57 s vs 0.04 s in 1 MiB chunks).
MAX_CHUNKS = 64
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


def gloo_chunks(nbytes: float, chunk_bytes: int | None = None) -> int:
    """How many chunks scaleout.comm.grid's gloo pipeline cuts ``nbytes`` into."""
    return int(min(MAX_CHUNKS, max(1, -(-nbytes // (chunk_bytes or DEFAULT_CHUNK_BYTES)))))


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
        from scaleout.comm.shard import grid_shard_index  # deferred: torch runtime

        return grid_shard_index(prepared)

    def reduce_scatter(
        self, out: torch.Tensor, inp: torch.Tensor, world: World, opts: Any, prepared: Grid
    ) -> None:
        from scaleout.comm.shard import grid_reduce_scatter  # deferred: torch runtime

        grid_reduce_scatter(out, inp, prepared)

    def all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, world: World, opts: Any, prepared: Grid
    ) -> None:
        from scaleout.comm.shard import grid_all_gather  # deferred: torch runtime

        grid_all_gather(out, inp, prepared)

    # -- cost model -------------------------------------------------------------------------------
    def cost(
        self, opts: Any, cluster: Cluster, nodes: int, nbytes: float, chunks: int | None = None
    ) -> Plan:
        from scaleout.comm.cost import grid_plan  # deferred: numpy cost model

        g = cluster.gpus_per_node
        if chunks is None:
            chunks = gloo_chunks(nbytes, opts.chunk_bytes) if cluster.backend == "gloo" else 1
        return grid_plan(cluster, nodes, nbytes, self.row_length(opts, g * nodes, g), chunks)

    def half_cost(self, kind: str, opts: Any, cluster: Cluster, nodes: int, nbytes: float) -> Plan:
        from scaleout.comm.cost import row_col_half_plan  # deferred: numpy cost model

        g = cluster.gpus_per_node
        return row_col_half_plan(kind, self.row_length(opts, g * nodes, g), cluster, nodes, nbytes)
