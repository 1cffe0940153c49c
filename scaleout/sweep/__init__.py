"""Scaling-efficiency sweeps (``scaleout sweep``): plan the points, read their reports, tabulate and
plot.

What runs inside ranks is the ordinary trainer (``scaleout train``); starting the runs is a launcher
concern (launchers/sweep.py). This package holds the launcher-independent parts:

- :mod:`scaleout.sweep.plan`     world sizes -> nodes x ranks and batch per point, checked up front
- :mod:`scaleout.sweep.results`  report.json -> throughput, breakdown, efficiency; CSV/JSON/Markdown
- :mod:`scaleout.sweep.plot`     the PNG (throughput and efficiency vs GPUs with the ideal line)
- :mod:`scaleout.sweep.simulate` the cost model's efficiency for the same points (scaleout.sim)
"""

from scaleout.sweep.plan import (
    MODES,
    SweepPoint,
    check_points,
    default_batch,
    node_shapes,
    plan_points,
    point_overrides,
)
from scaleout.sweep.results import (
    PHASES,
    PointResult,
    add_efficiency,
    breakdown,
    read_point,
    write_outputs,
)

__all__ = [
    "MODES",
    "PHASES",
    "PointResult",
    "SweepPoint",
    "add_efficiency",
    "breakdown",
    "check_points",
    "default_batch",
    "node_shapes",
    "plan_points",
    "point_overrides",
    "read_point",
    "write_outputs",
]
