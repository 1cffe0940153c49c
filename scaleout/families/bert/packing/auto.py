"""``auto`` packing: run the candidate algorithms on the histogram and keep the most efficient
strategy.

No single algorithm wins on every histogram: lphp is the best on Wikipedia-512 (0.99883 at <= 3 per
pack, LPFHP 0.895), but on the SQuAD 1.1 histogram at max_len 384 (Graphcore, arXiv 2107.02027) its
``balanced`` pattern filter costs it 1.7 points at depth 3 (0.971) where LPFHP reaches 0.977, lphp
without the filter 0.988 and the paper's NNLSHP 0.974. ``auto`` therefore runs, cheapest first:

spfhp, lpfhp (milliseconds), lphp (~0.3 s on 16 M sequences), lphp-full, nnlshp

and returns the strategy with the fewest packs (= highest efficiency: every candidate packs the same
tokens). Ties go to the candidate that ran first. The result is never worse than any candidate that
ran.

Cost control: SPFHP, LPFHP and lphp always run. ``lphp-full`` runs while the time used so far is
within ``budget_s``. NNLSHP solves a dense NNLS over every composition of max_len into <= 3 lengths;
its cost grows with max_len x patterns: 4.8 M matrix cells at max_len 384 took 4.5 s here, 11.3 M at
512 took 74-111 s (the paper: 24 s). It runs when the matrix has at most ``NNLS_MAX_CELLS`` cells
and the budget is not spent; otherwise the strategy's notes say it was skipped, and the "never worse
than NNLSHP" claim rests on measurement (Wikipedia-512: lphp 0.99883 > NNLSHP 0.99746).
"""

from __future__ import annotations

import time

import numpy as np

from scaleout.families.bert.packing.algos import (
    MAX_PATTERN_DEPTH,
    exact_fill_patterns,
    run_algorithm,
)
from scaleout.families.bert.packing.strategy import Strategy

# Seconds after which auto stops starting optional candidates (lphp-full, nnlshp).
AUTO_BUDGET_S = 30.0
# Largest dense NNLS problem (max_len x patterns) auto runs: SQuAD-384 (4.8 M cells, ~5 s) fits,
# Wikipedia-512 (11.3 M cells, 24 s in the paper, 74 s here) does not.
NNLS_MAX_CELLS = 6_000_000
ALWAYS = ("spfhp", "lpfhp", "lphp")
OPTIONAL = ("lphp-full", "nnlshp")


def nnls_cells(h: np.ndarray, max_len: int, max_per_pack: int) -> int:
    """Size of NNLSHP's dense matrix: max_len rows x one column per composition of max_len."""
    pats = exact_fill_patterns(
        h, max_len, min(max_per_pack, MAX_PATTERN_DEPTH), singletons=False, all_lengths=True
    )
    return max_len * len(pats)


def pack_auto(
    h: np.ndarray, max_len: int, max_per_pack: int, budget_s: float | None = None
) -> Strategy:
    """The most efficient of the candidates that ran; ``notes["auto"]`` holds every candidate's
    result."""
    budget = AUTO_BUDGET_S if budget_s is None else float(budget_s)
    t0, c0 = time.perf_counter(), time.process_time()
    results: dict[str, Strategy] = {}
    skipped: dict[str, str] = {}
    for name in ALWAYS + OPTIONAL:
        spent = time.perf_counter() - t0
        if name in OPTIONAL and spent > budget:
            skipped[name] = f"time budget {budget:g} s spent ({spent:.1f} s)"
            continue
        if name == "nnlshp" and (cells := nnls_cells(h, max_len, max_per_pack)) > NNLS_MAX_CELLS:
            skipped[name] = f"NNLS matrix of {cells} cells > {NNLS_MAX_CELLS}"
            continue
        results[name] = run_algorithm(h, max_len, max_per_pack, name)
    best = min(results.values(), key=lambda s: s.num_packs)  # min keeps the first of equals
    notes = {
        "auto": {n: round(s.efficiency, 6) for n, s in results.items()},
        "auto_skipped": skipped,
    }
    return Strategy(
        best.algorithm,
        max_len,
        max_per_pack,
        best.packs,
        time.perf_counter() - t0,
        time.process_time() - c0,
        notes,
    )
