"""``torus2d``: Sony's 2D-torus all-reduce (Mikami et al., arXiv 1811.05233): reduce-scatter along
the X ranks of a row, all-reduce along the Y ranks of a column, all-gather along the row. It needs
2(X-1) + 2(Y-1) latency steps instead of a ring's 2(p-1), which is what matters for small buckets at
thousands of ranks. Default X = ranks per node, so rows stay on a node's fast fabric; X = ranks per
node is exactly ``hierarchical``, X ~ sqrt(p) (:func:`square_x`) has the fewest latency steps.

:func:`scaleout.topology.resolve_grid` is the one X x Y rule: the runtime (``World.torus_shape``),
the config check (``comm.torus_x`` / ``comm.torus_y``) and the simulator all call it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import Field

from scaleout.comm.algorithm import register
from scaleout.comm.rowcol import GridAlgorithm, GridOptions
from scaleout.errors import ConfigError
from scaleout.topology import resolve_grid

if TYPE_CHECKING:
    from scaleout.comm.grid import Grid
    from scaleout.config.schema import CommConfig
    from scaleout.world import World


def square_x(ranks_per_node: int, nodes: int) -> int:
    """The multiple (or divisor) of g nearest sqrt(p) that divides p: fewest 2(X-1) + 2(Y-1)
    steps."""
    g, p = ranks_per_node, ranks_per_node * nodes
    cands = [x for x in range(1, p + 1) if p % x == 0 and (x % g == 0 or g % x == 0)]
    return min(cands, key=lambda x: (2 * (x - 1) + 2 * (p // x - 1), -x))


class TorusOptions(GridOptions):
    """``x`` / ``y``: ranks per torus row / column (config ``comm.torus_x`` / ``comm.torus_y``)."""

    x: int | None = Field(None, ge=1)
    y: int | None = Field(None, ge=1)
    config_keys = ("torus_x", "torus_y", "chunk_mb")

    @classmethod
    def from_config(cls, comm: CommConfig) -> TorusOptions:
        return cls(x=comm.torus_x, y=comm.torus_y, **cls.chunk_from_config(comm))


class Torus2d(GridAlgorithm):
    name = "torus2d"
    help = (
        "2D torus X x Y (arXiv 1811.05233): row reduce-scatter -> column all-reduce -> row "
        "all-gather"
    )
    Options = TorusOptions

    def check(self, opts: Any, world_size: int, ranks_per_node: int | None) -> None:
        resolve_grid(world_size, ranks_per_node, opts.x, opts.y, CONFIG_NAMES, ConfigError)

    def grid(self, world: World, opts: Any) -> Grid:
        from scaleout.comm.grid import Grid  # deferred: torch runtime

        tg = world.torus(opts.x, opts.y)
        gather = f"torus{tg.x}x{tg.y}row_gather"
        return Grid(
            world.rank,
            tuple(tg.row_ranks),
            tg.row,
            tg.col,
            tg.y,
            lambda: world.partition(gather, world.torus_rows(tg.x), shared=False),
        )

    def row_length(self, opts: Any, world_size: int, ranks_per_node: int) -> int:
        return resolve_grid(world_size, ranks_per_node, opts.x, opts.y)[0]


CONFIG_NAMES = ("comm.torus_x", "comm.torus_y")

register(Torus2d())
