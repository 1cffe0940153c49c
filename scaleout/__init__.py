"""scaleout: PyTorch-native max-scale data-parallel training.

``scaleout.init()`` -> :class:`World`; everything else takes that World explicitly.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "World": ("scaleout.world", "World"),
    "init": ("scaleout.world", "init"),
    "DataParallel": ("scaleout.parallel", "DataParallel"),
    "load_config": ("scaleout.config", "load_config"),
}


def __getattr__(name: str) -> Any:  # lazy so that `scaleout --help` does not import torch
    if name in _LAZY:
        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'scaleout' has no attribute {name!r}")


__all__ = list(_LAZY)
