"""A packing strategy: which lengths go together in a pack, and how often (Graphcore, arXiv
2107.02027).

``Strategy.packs`` maps a pack (a tuple of sequence lengths, longest first) to its repeat count. A
valid strategy for a histogram ``h`` uses every sequence exactly once (``strategy.histogram() ==
h``), keeps every pack within ``max_len`` tokens and ``max_per_pack`` sequences. Metrics as in the
paper: efficiency = real tokens / (packs x max_len); speed-up = sequences / packs (rows saved vs
padding).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from scaleout.errors import UserError

Pack = tuple[int, ...]


@dataclass
class Strategy:
    algorithm: str
    max_len: int
    max_per_pack: int
    packs: dict[Pack, int]
    seconds: float = 0.0  # wall time of the algorithm
    cpu_seconds: float = 0.0  # process CPU time (less sensitive to a busy machine than wall time)
    notes: dict[str, object] = field(default_factory=dict)

    @property
    def num_packs(self) -> int:
        return int(sum(self.packs.values()))

    @property
    def num_sequences(self) -> int:
        return int(sum(len(p) * n for p, n in self.packs.items()))

    @property
    def real_tokens(self) -> int:
        return int(sum(sum(p) * n for p, n in self.packs.items()))

    @property
    def efficiency(self) -> float:
        return self.real_tokens / max(self.num_packs * self.max_len, 1)

    @property
    def speedup(self) -> float:
        return self.num_sequences / max(self.num_packs, 1)

    def depth_histogram(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for p, n in self.packs.items():
            out[len(p)] = out.get(len(p), 0) + n
        return dict(sorted(out.items()))

    def histogram(self) -> np.ndarray:
        h = np.zeros(self.max_len + 1, dtype=np.int64)
        for p, n in self.packs.items():
            for length in p:
                h[length] += n
        return h

    def validate(self, h: np.ndarray) -> None:
        """Raise UserError unless this strategy packs exactly ``h`` within its limits (a real
        check, not an ``assert``: it guards data that reaches training, also under ``python
        -O``)."""
        for p, n in self.packs.items():
            if not (isinstance(n, (int, np.integer)) and n > 0):
                raise UserError(
                    f"{self.algorithm}: pack {p} has count {n!r}; expected a positive integer"
                )
            if not 0 < len(p) <= self.max_per_pack:
                raise UserError(
                    f"{self.algorithm}: pack {p} holds {len(p)} sequences; expected "
                    f"1..{self.max_per_pack}"
                )
            if sum(p) > self.max_len or min(p) < 1:
                raise UserError(
                    f"{self.algorithm}: pack {p} has {sum(p)} tokens; expected sequences of 1.. "
                    "and "
                    f"at most max_len={self.max_len} in total"
                )
        h = np.asarray(h, dtype=np.int64)
        if len(h) > self.max_len + 1 and h[self.max_len + 1 :].any():
            raise UserError(
                f"{self.algorithm}: the histogram has sequences longer than max_len={self.max_len}"
            )
        got = self.histogram()
        want = np.zeros(self.max_len + 1, dtype=np.int64)
        want[: min(len(h), self.max_len + 1)] = h[: self.max_len + 1]
        if not np.array_equal(got, want):
            at = int(np.nonzero(got != want)[0][0])
            raise UserError(
                f"{self.algorithm}: the strategy packs {int(got[at])} sequences of length {at} but "
                "the "
                f"histogram has {int(want[at])}; a strategy must reproduce its histogram exactly"
            )

    def stats(self) -> dict[str, object]:
        return {
            "algorithm": self.algorithm,
            "max_len": self.max_len,
            "max_per_pack": self.max_per_pack,
            "sequences": self.num_sequences,
            "packs": self.num_packs,
            "efficiency": self.efficiency,
            "speedup": self.speedup,
            "depth_histogram": self.depth_histogram(),
            "seconds": self.seconds,
            "cpu_seconds": self.cpu_seconds,
            "strategies": len(self.packs),
            **self.notes,
        }

    def to_json(self) -> dict[str, object]:
        rows = sorted(self.packs.items(), key=lambda kv: (-len(kv[0]), kv[0]))
        return {**self.stats(), "packs": [{"lengths": list(p), "count": n} for p, n in rows]}

    @classmethod
    def from_json(cls, data: dict | str) -> Strategy:
        d = json.loads(data) if isinstance(data, str) else data
        try:
            packs = {
                tuple(sorted((int(x) for x in r["lengths"]), reverse=True)): int(r["count"])
                for r in d["packs"]
            }
            return cls(str(d["algorithm"]), int(d["max_len"]), int(d["max_per_pack"]), packs)
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"not a packing strategy JSON (missing or bad field: {exc})") from None


def speedup_ceiling(h: np.ndarray) -> float:
    """Sequences / minimal packs if every pack were full: 2.0013 for Wikipedia-512 (arXiv
    2107.02027)."""
    max_len = len(h) - 1
    tokens = float((h * np.arange(len(h))).sum())
    return float(h.sum()) / (tokens / max_len)


def add_pack(packs: dict[Pack, int], pack: Pack | list[int], count: int) -> None:
    if count > 0:
        key = tuple(sorted(pack, reverse=True))
        packs[key] = packs.get(key, 0) + int(count)


def remove_excess(packs: dict[Pack, int], h: np.ndarray) -> None:
    """Take out sequences that a covering solution (LP/NNLS) placed beyond the histogram's counts.

    Those slots were padding in the paper's NNLSHP; removing them keeps the pack (and its count) and
    makes the strategy reproduce the histogram exactly.
    """
    max_len = len(h) - 1
    have = np.zeros(max_len + 1, dtype=np.int64)
    for p, n in packs.items():
        for length in p:
            have[length] += n
    for length in np.nonzero(have > h)[0]:
        excess = int(have[length] - h[length])
        while excess > 0:
            # the group holding the most copies first: fewest group splits
            p = max((p for p in packs if length in p), key=lambda p: (p.count(length), packs[p]))
            t = min(packs[p], excess)
            q = list(p)
            q.remove(int(length))
            packs[p] -= t
            if packs[p] == 0:
                del packs[p]
            if q:  # an emptied pack simply disappears
                add_pack(packs, q, t)
            excess -= t
