"""Topology-aware collectives: ``all_reduce(tensor, world, algorithm=..., op=..., async_op=...)``.

Algorithms live in one registry (:data:`ALGORITHMS`): ``flat`` (baseline), ``hierarchical``,
``torus2d``. See docs/collectives.md.
"""

from scaleout.comm.api import ALGORITHMS, Algorithm, all_reduce, get_algorithm, register
from scaleout.comm.ddp_hook import ddp_hook
from scaleout.comm.handles import Handle

__all__ = ["ALGORITHMS", "Algorithm", "Handle", "all_reduce", "ddp_hook", "get_algorithm", "register"]
