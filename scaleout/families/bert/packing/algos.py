"""Histogram packing algorithms: SPFHP, LPFHP, NNLSHP (Graphcore, arXiv 2107.02027) and LPHP (ours).

All take a histogram ``h`` (``h[l]`` = sequences of length ``l``, see :mod:`packing_hist`),
``max_len`` and ``max_per_pack`` and return a :class:`Strategy` that reproduces ``h`` exactly.

- ``spfhp``: shortest-pack-first: lengths longest first; each goes into the open pack with the
  *most* room left (worst fit), whole groups of identical packs at a time.
- ``lpfhp``: longest-pack-first: best fit (the open pack with the *least* room that still fits), and
  several copies of a short length into one pack at once ("distribute").
- ``nnlshp``: the paper's procedure (graphcore/examples
  ``tutorials/blogs_code/packedBERT/nnlshp.py``): non-negative least squares over *every* way of
  writing max_len as a sum of <= 3 lengths (lengths the histogram does not contain included: those
  slots are padding), residual of lengths 1..8 weighted 0.09, rounded to the nearest integer; each
  length still under-covered gets packs ``(l, max_len - l)``. 0.99746 on Wikipedia-512 at depth 3
  (the paper: 0.9975).
- ``lphp`` (ours): the same exact-fill packs, but the *linear program* "fewest packs that cover the
  histogram" (HiGHS) instead of least squares -- the quantity we care about is the pack count, which
  NNLS does not minimise. The LP vertex has at most max_len non-zero patterns, so rounding down
  loses at most a few thousand sequences; they are best-fitted (lpfhp engine) into the room left in
  LP packs, then into new packs, and a ``refill`` pass moves the sequences of the emptiest packs
  into the room of the others. On Wikipedia-512: 0.99883 at <= 3 per pack (NNLSHP 0.9975 in ~24 s)
  and 0.99979 at <= 12 (LPFHP 0.9981), in ~0.3 s CPU (see docs/packing.md for the exact runs).
- ``auto``: runs the candidates and keeps the most efficient (:mod:`packing_auto`).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

import numpy as np

from scaleout.errors import UserError
from scaleout.families.bert.packing.strategy import Pack, Strategy, add_pack, remove_excess

# NNLSHP weights the residual of lengths <= 8 by 0.09 (Graphcore's reference setting).
NNLS_SHORT_CUTOFF, NNLS_SHORT_WEIGHT = 8, 0.09
# Exact-fill patterns are enumerated up to this many sequences (22k patterns for 512; 4 would be
# ~1M).
MAX_PATTERN_DEPTH = 3
# lphp's refill: empty the 0.5 % emptiest packs and best-fit their sequences elsewhere, twice (the
# second round gains at <= 12 per pack; more rounds or fractions 0.1-2 % changed nothing on
# Wikipedia-512).
REFILL_FRACTION, REFILL_ROUNDS = 0.005, 2


def _greedy(
    h: np.ndarray,
    max_len: int,
    k: int,
    worst_fit: bool,
    distribute: bool,
    initial: dict[Pack, int] | None = None,
) -> dict[Pack, int]:
    """Histogram bin packing, longest length first, moving whole groups of identical packs at once.

    Open groups are kept per remaining room; ``worst_fit`` picks the largest room (SPFHP), otherwise
    the smallest room that fits (LPFHP). ``initial`` packs are open for filling before new ones.
    """
    groups: dict[int, list[list]] = {}  # room -> [[count, pack], ...]
    rooms: list[int] = []  # sorted rooms with open groups
    done: dict[Pack, int] = {}

    def put(pack: Pack, count: int) -> None:
        if count <= 0:
            return
        room = max_len - sum(pack)
        if room == 0 or len(pack) >= k:
            add_pack(done, pack, count)
            return
        if room not in groups:
            groups[room] = []
            bisect.insort(rooms, room)
        groups[room].append([count, pack])

    for p, n in (initial or {}).items():
        put(p, n)
    for length in range(max_len, 0, -1):
        c = int(h[length])
        while c > 0:
            if worst_fit:
                i = len(rooms) - 1 if rooms and rooms[-1] >= length else -1
            else:
                i = bisect.bisect_left(rooms, length)
                i = i if i < len(rooms) else -1
            if i < 0:  # fits nowhere: new packs, several copies each when distributing
                r = min(max_len // length, k, c) if distribute else 1
                put((length,) * r, c // r)
                c -= (c // r) * r
                continue
            room = rooms[i]
            lst = groups[room]
            n, pack = lst[-1]
            r = min(1 + (room - length) // length, k - len(pack), c) if distribute else 1
            m = min(n, c // r)
            if m == n:
                lst.pop()
                if not lst:
                    del groups[room]
                    rooms.pop(i)
            else:
                lst[-1][0] = n - m
            put(pack + (length,) * r, m)
            c -= m * r
    for lst in groups.values():
        for n, pack in lst:
            add_pack(done, pack, n)
    return done


def exact_fill_patterns(
    h: np.ndarray,
    max_len: int,
    depth: int,
    balanced: bool = False,
    singletons: bool = True,
    all_lengths: bool = False,
) -> list[Pack]:
    """Every pack of <= depth present lengths summing to exactly max_len, plus (``singletons``) a
    pack of one for every present length, so that any histogram can be covered. ``balanced``
    keeps only packs whose shortest sequence is at least half the second shortest (see ``lphp``).
    ``all_lengths``: every length 1..max_len may appear in a pack, present in ``h`` or not
    (NNLSHP's strategy set)."""
    present = set(range(1, max_len + 1)) if all_lengths else set(np.nonzero(h)[0].tolist())
    pats: list[Pack] = [(int(x),) for x in sorted(present) if singletons or x == max_len]

    def extend(prefix: Pack, room: int, largest: int, left: int) -> None:
        if room == 0:
            if len(prefix) > 1:
                pats.append(prefix)
            return
        if left == 0:
            return
        if left == 1:
            if (
                room <= largest
                and room in present
                and (not balanced or len(prefix) < 2 or 2 * room >= prefix[-1])
            ):
                pats.append(prefix + (room,))
            return
        # the remaining `left` items are each <= x, so x >= room / left
        for x in range(min(largest, room), -(-room // left) - 1, -1):
            if x in present:
                extend(prefix + (x,), room - x, x, left - 1)

    for a in sorted(present, reverse=True):
        if a < max_len:
            extend((int(a),), max_len - a, int(a), depth - 1)
    return pats


def _matrix(pats: list[Pack], max_len: int):
    from scipy.sparse import csc_matrix

    rows = [x for p in pats for x in p]
    cols = [j for j, p in enumerate(pats) for _ in p]
    a = csc_matrix((np.ones(len(rows)), (rows, cols)), shape=(max_len + 1, len(pats)))
    a.sum_duplicates()
    return a


def spfhp(h: np.ndarray, max_len: int, max_per_pack: int) -> dict[Pack, int]:
    return _greedy(h, max_len, max_per_pack, worst_fit=True, distribute=False)


def lpfhp(h: np.ndarray, max_len: int, max_per_pack: int) -> dict[Pack, int]:
    return _greedy(h, max_len, max_per_pack, worst_fit=False, distribute=True)


def nnlshp(h: np.ndarray, max_len: int, max_per_pack: int) -> dict[Pack, int]:
    from scipy.optimize import nnls

    pats = exact_fill_patterns(
        h, max_len, min(max_per_pack, MAX_PATTERN_DEPTH), singletons=False, all_lengths=True
    )
    w = np.ones(max_len)
    w[:NNLS_SHORT_CUTOFF] = NNLS_SHORT_WEIGHT
    x = np.zeros(0)
    if pats:
        x, _ = nnls(w[:, None] * _matrix(pats, max_len).toarray()[1:], w * h[1:].astype(float))
    packs: dict[Pack, int] = {}
    for p, n in zip(pats, np.rint(x).astype(np.int64), strict=False):
        add_pack(packs, p, int(n))
    # the paper's residual handling: each under-covered length l gets packs (l, max_len - l), whose
    # second slot is padding unless that length is under-covered too
    residual = h - Strategy("", max_len, max_per_pack, packs).histogram()
    for length in np.nonzero(residual > 0)[0]:
        rest = (max_len - int(length),) if length < max_len and max_per_pack > 1 else ()
        add_pack(packs, (int(length),) + rest, int(residual[length]))
    remove_excess(packs, h)
    return packs


def lphp(h: np.ndarray, max_len: int, max_per_pack: int, balanced: bool = True) -> dict[Pack, int]:
    """LP over exact-fill packs, rounded down, residual best-fitted.

    ``balanced``: the LP is very degenerate (its dual prices are close to linear in the length over
    most of the range, so every exact-fill triple there costs the same); keeping only triples whose
    two shorter sequences are within a factor 2 drops 55 % of the 21.6k columns on Wikipedia-512 at
    an LP optimum 0.99820 instead of 0.99822, and makes the interior-point solve ~3x faster (~0.2
    s).
    """
    from scipy.optimize import linprog

    pats = exact_fill_patterns(h, max_len, min(max_per_pack, MAX_PATTERN_DEPTH), balanced=balanced)
    a = _matrix(pats, max_len)[1:]
    # min sum(x) s.t. A x >= h, x >= 0 (covering: extra copies become empty slots, removed below).
    # HiGHS IPM + crossover returns a vertex (<= max_len non-zeros), which keeps the rounding loss
    # small.
    res = linprog(
        np.ones(len(pats)), A_ub=-a, b_ub=-h[1:].astype(float), bounds=(0, None), method="highs-ipm"
    )
    if res.status != 0:  # pragma: no cover - singletons make the LP always feasible
        raise RuntimeError(f"lphp: LP failed: {res.message}")
    packs: dict[Pack, int] = {}
    for j in np.nonzero(res.x > 1e-9)[0]:
        add_pack(packs, pats[j], int(np.floor(res.x[j] + 1e-9)))
    remove_excess(packs, h)
    residual = h - Strategy("", max_len, max_per_pack, packs).histogram()
    if residual.any():
        packs = _fill(residual, packs, max_len, max_per_pack)
    for _ in range(REFILL_ROUNDS):
        packs = refill(packs, max_len, max_per_pack)
    return packs


def _fill(h: np.ndarray, packs: dict[Pack, int], max_len: int, k: int) -> dict[Pack, int]:
    """Best-fit the sequences of histogram ``h`` into the room left in ``packs``, then into new
    packs."""
    full = {p: n for p, n in packs.items() if sum(p) == max_len or len(p) >= k}
    open_ = {p: n for p, n in packs.items() if p not in full}
    out = _greedy(h, max_len, k, worst_fit=False, distribute=True, initial=open_)
    for p, n in full.items():
        add_pack(out, p, n)
    return out


def refill(
    packs: dict[Pack, int], max_len: int, k: int, fraction: float = REFILL_FRACTION
) -> dict[Pack, int]:
    """Empty the ``fraction`` emptiest packs and best-fit their sequences into the room of the
    others.

    After LP rounding, the waste sits in a few packs (left-overs, packs that lost over-covered
    slots) while many exact-fill packs have a slot or a few tokens free; moving the former into the
    latter is a bin-packing step the LP cannot see. On Wikipedia-512 it takes lphp from 0.99822 to
    0.99884 at <= 3 per pack (the LP bound over *all* <= 3-sequence packs, by column generation, is
    0.99884) and to 0.99979 at <= 12, in a few milliseconds.
    """
    total = sum(packs.values())
    take_n = max(1, int(fraction * total))
    take: dict[Pack, int] = {}
    keep: dict[Pack, int] = {}
    for p, n in sorted(packs.items(), key=lambda kv: (sum(kv[0]), kv[0])):
        t = min(n, take_n)
        take_n -= t
        add_pack(take, p, t)
        add_pack(keep, p, n - t)
    out = _fill(Strategy("", max_len, k, take).histogram(), keep, max_len, k)
    return out if sum(out.values()) <= total else packs


def lphp_full(h: np.ndarray, max_len: int, max_per_pack: int) -> dict[Pack, int]:
    """lphp over every exact-fill pack (no ``balanced`` filter): slower, but better where the
    filter drops the packs that matter (SQuAD-384 at depth 3: 0.988 instead of 0.971)."""
    return lphp(h, max_len, max_per_pack, balanced=False)


ALGORITHMS: dict[str, Callable[[np.ndarray, int, int], dict[Pack, int]]] = {
    "spfhp": spfhp,
    "lpfhp": lpfhp,
    "nnlshp": nnlshp,
    "lphp": lphp,
}
# Candidates of ``auto`` that are not offered on their own (variants of the above).
VARIANTS: dict[str, Callable[[np.ndarray, int, int], dict[Pack, int]]] = {"lphp-full": lphp_full}


def check_histogram(h: np.ndarray, max_len: int, max_per_pack: int, algorithm: str) -> np.ndarray:
    """``h`` as a validated int64 histogram of length max_len + 1 (no length-0 sequences), or a
    one-line UserError naming what is wrong with the arguments."""
    if (
        isinstance(max_per_pack, bool)
        or not isinstance(max_per_pack, (int, np.integer))
        or max_per_pack < 1
    ):
        raise UserError(f"max_per_pack={max_per_pack!r} must be an integer >= 1")
    if algorithm not in ALGORITHMS and algorithm not in VARIANTS and algorithm != "auto":
        raise UserError(
            f"packing algorithm {algorithm!r} is not one of {', '.join([*ALGORITHMS, 'auto'])}"
        )
    h = np.asarray(h, dtype=np.int64)
    if h.ndim != 1 or len(h) > max_len + 1 and h[max_len + 1 :].any():
        raise UserError(f"histogram has sequences longer than max_len={max_len}")
    if (h < 0).any():
        raise UserError(f"histogram has a negative count at length {int(np.nonzero(h < 0)[0][0])}")
    hist = np.zeros(max_len + 1, dtype=np.int64)
    hist[: min(len(h), max_len + 1)] = h[: max_len + 1]
    hist[0] = 0
    if hist.sum() == 0:
        raise UserError("empty histogram: nothing to pack")
    return hist


def run_algorithm(hist: np.ndarray, max_len: int, max_per_pack: int, name: str) -> Strategy:
    """Run one algorithm (or variant) on a histogram from :func:`check_histogram`, timed and
    validated."""
    if name in ("nnlshp", "lphp", "lphp-full"):
        import scipy.optimize  # noqa: F401  (a one-off import, not the algorithm's run time)
    t, c = time.perf_counter(), time.process_time()
    packs = {**ALGORITHMS, **VARIANTS}[name](hist, max_len, int(max_per_pack))
    s = Strategy(
        name, max_len, int(max_per_pack), packs, time.perf_counter() - t, time.process_time() - c
    )
    s.validate(hist)
    return s
