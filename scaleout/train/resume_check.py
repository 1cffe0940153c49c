"""Does a checkpoint fit the run that resumes it? One line naming what changed, not torch's
``load_state_dict`` traceback (a changed ``model.bert.layers``) or a ``KeyError`` from an optimizer
whose state has other entries.

Found in the rank: only the model built from the config knows its parameter names and shapes, and
the checkpoint is chosen and read there (rank 0 verifies it, every rank receives it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from scaleout.errors import ConfigError, excerpt

# How many differing names a message shows: enough to see the pattern (one layer more), one line.
SHOWN = 2


def _shape(t: Any) -> list[int] | None:
    return list(t.shape) if isinstance(t, torch.Tensor) else None


def model_mismatch(saved: Mapping[str, Any], model: torch.nn.Module) -> str | None:
    """What differs between a saved model state and ``model``'s (names, then shapes), or None."""
    mine = model.state_dict()
    missing = [k for k in mine if k not in saved]
    extra = [k for k in saved if k not in mine]
    shapes = [k for k in mine if k in saved and _shape(saved[k]) != _shape(mine[k])]
    parts = []
    if missing:
        parts.append(f"{len(missing)} tensors of this model are not in it ({_some(missing)})")
    if extra:
        parts.append(f"{len(extra)} of its tensors are not in this model ({_some(extra)})")
    if shapes:
        k = shapes[0]
        parts.append(
            f"{len(shapes)} tensors have other shapes ({k}: saved {_shape(saved[k])}, "
            f"this model {_shape(mine[k])})"
        )
    return "; ".join(parts) or None


def _some(names: list[str]) -> str:
    shown = ", ".join(names[:SHOWN])
    return shown + (", ..." if len(names) > SHOWN else "")


def load_or_explain(
    load: Callable[[], None],
    state: Mapping[str, Any],
    model: torch.nn.Module,
    path: Path,
    rank: int,
) -> None:
    """Check ``state['model']`` against ``model``, then ``load()``; a checkpoint that does not fit
    this config is one ConfigError naming the rank, the file and what differs."""
    advice = (
        "resume with the config it was written with, or start a new run in another checkpoint.dir"
    )
    saved = state.get("model")
    if isinstance(saved, Mapping):
        diff = model_mismatch(saved, model)
        if diff:
            raise ConfigError(
                f"rank {rank}: checkpoint {path} was written by another model: {diff}; {advice}"
            )
    try:
        load()
    except (RuntimeError, KeyError, ValueError, IndexError, TypeError) as exc:
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ConfigError(
            f"rank {rank}: checkpoint {path} does not fit this run's model or optimizer "
            f"({type(exc).__name__}: {excerpt(cause)}); {advice}"
        ) from None
