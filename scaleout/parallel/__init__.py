"""Data parallelism: overlapped, bucketed gradient all-reduce with any :mod:`scaleout.comm`
algorithm.

``DataParallel`` (our reducer), ``ddp_comm_hook`` (the same algorithms inside torch's own
DistributedDataParallel), ``Timeline`` (Chrome trace of backward and communication). See
docs/overlap.md.
"""

from __future__ import annotations

import importlib
from typing import Any

# Lazy, so that a torch-free submodule (buckets: the bucket defaults) is importable without torch.
_LAZY = {
    "DataParallel": "scaleout.parallel.data_parallel",
    "ddp_comm_hook": "scaleout.parallel.ddp_hook",
    "Timeline": "scaleout.parallel.timeline",
    "load_trace": "scaleout.parallel.timeline",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'scaleout.parallel' has no attribute {name!r}")


__all__ = ["DataParallel", "Timeline", "ddp_comm_hook", "load_trace"]
