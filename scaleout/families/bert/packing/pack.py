"""``pack_histogram``: the front door of packing, one algorithm by name or ``auto`` (the best of
them).

It sits above both :mod:`.algos` (the algorithms) and :mod:`.auto` (which runs several of them), so
neither imports the other back.
"""

from __future__ import annotations

import numpy as np

from scaleout.families.bert.packing.algos import check_histogram, run_algorithm
from scaleout.families.bert.packing.auto import pack_auto
from scaleout.families.bert.packing.hist import check_max_len
from scaleout.families.bert.packing.strategy import Strategy


def pack_histogram(
    h: np.ndarray,
    max_len: int,
    max_per_pack: int = 3,
    algorithm: str = "auto",
    budget_s: float | None = None,
) -> Strategy:
    """Run one algorithm on histogram ``h`` (length max_len + 1, or shorter) and time it.
    ``auto`` runs the candidates of :mod:`.auto` (``budget_s``: its time budget) and returns the
    most efficient."""
    max_len = check_max_len(max_len)
    hist = check_histogram(h, max_len, max_per_pack, algorithm)
    if algorithm == "auto":
        return pack_auto(hist, max_len, int(max_per_pack), budget_s)
    return run_algorithm(hist, max_len, int(max_per_pack), algorithm)
