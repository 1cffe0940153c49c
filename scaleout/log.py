"""Rank-aware output: the one helper for rank-0-only printing, and rank-tagged failures."""

from __future__ import annotations

import os
import sys
from typing import Any


def _rank() -> int:
    from scaleout.env import rank_variables  # deferred: scaleout.log is imported first of all

    for var in rank_variables():  # the launchers' rank variables, in detection order
        value = os.environ.get(var)
        if value is not None and value.lstrip("-").isdigit():
            return int(value)
    return 0


def print0(*args: Any, rank: int | None = None, file=None, **kwargs: Any) -> None:
    """Print only on global rank 0 (``rank`` if given, else read from the launcher's variables)."""
    if (_rank() if rank is None else rank) == 0:
        print(*args, file=file or sys.stdout, flush=True, **kwargs)


def rank_prefix(rank: int | None = None) -> str:
    return f"[rank {(_rank() if rank is None else rank)}]"


def fail(message: str, rank: int | None = None) -> str:
    """Format a failure so that every rank's error names the rank it came from."""
    return f"{rank_prefix(rank)} {message}"
