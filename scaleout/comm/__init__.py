"""Topology-aware collectives: ``all_reduce(tensor, world, algorithm=..., op=..., async_op=...)``,
and ``reduce_scatter`` / ``all_gather`` (with ``shard_index``) for sharded optimizers.

Algorithms live in one registry (:data:`ALGORITHMS`, :mod:`scaleout.comm.algorithm`), one file each:
``flat`` (baseline), ``hierarchical``, ``torus2d``. See docs/collectives.md and
docs/extending.md.

Importing this package registers the algorithms without importing torch (the config schema reads the
registry); the collectives themselves load on first use. A caller that holds the run's algorithm
resolves it once into a :class:`~scaleout.comm.collective.Collective` (algorithm, options, prepared
groups) and calls that.
"""

from __future__ import annotations

import importlib
from typing import Any

from scaleout.comm import flat, hierarchical, torus2d  # noqa: F401  (registers the built-ins)
from scaleout.comm.algorithm import (
    ALGORITHMS,
    Algorithm,
    Options,
    get_algorithm,
    register,
)

_LAZY = {
    "Collective": "scaleout.comm.collective",
    "all_reduce": "scaleout.comm.collective",
    "reduce_scatter": "scaleout.comm.collective",
    "all_gather": "scaleout.comm.collective",
    "shard_index": "scaleout.comm.collective",
    "Handle": "scaleout.comm.handles",
}


def __getattr__(name: str) -> Any:  # lazy so that the registry can be read without torch
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'scaleout.comm' has no attribute {name!r}")


__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "Collective",
    "Handle",
    "Options",
    "all_gather",
    "all_reduce",
    "get_algorithm",
    "reduce_scatter",
    "register",
    "shard_index",
]
