"""``torus2d``: Sony's 2D-torus all-reduce (Mikami et al., arXiv 1811.05233): reduce-scatter along
the X ranks of a row, all-reduce along the Y ranks of a column, all-gather along the row. It needs
2(X-1) + 2(Y-1) latency steps instead of a ring's 2(p-1), which is what matters for small buckets at
thousands of ranks. Default X = ranks per node, so rows stay on a node's fast fabric.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scaleout.comm.grid import Grid

if TYPE_CHECKING:
    from scaleout.world import World


def torus_grid(world: World, x: int | None = None, y: int | None = None) -> Grid:
    tg = world.torus(x, y)
    return Grid(world.rank, tuple(tg.row_ranks), tg.row, tg.col, tg.y)
