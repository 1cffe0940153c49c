"""Assign concrete sequences to the packs of a strategy, deterministically for a seed.

Every sequence lands in exactly one pack slot of its own length. Vectorised: the slots of all packs
are laid out flat; sorting slots and (shuffled) sequence ids by length lines them up, so 16M
sequences take seconds, not minutes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scaleout.errors import UserError
from scaleout.families.bert.packing.hist import histogram_from_lengths
from scaleout.families.bert.packing.strategy import Strategy


@dataclass
class PackedSequences:
    """Packs as a flat id array: pack i holds ``ids[offsets[i]:offsets[i + 1]]`` (longest first)."""

    ids: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def pack(self, i: int) -> list[int]:
        return self.ids[self.offsets[i] : self.offsets[i + 1]].tolist()

    def packs(self) -> list[list[int]]:
        return [self.pack(i) for i in range(len(self))]


def assign_sequences(
    strategy: Strategy,
    lengths: Sequence[int] | np.ndarray,
    seed: int = 0,
    ids: Sequence[int] | np.ndarray | None = None,
) -> PackedSequences:
    """Place sequences (``lengths[i]`` is the length of sequence ``ids[i]``, default ``i``) into
    packs.

    The order of packs and which sequence of a given length goes where are random but fixed by
    ``seed``. Raises UserError if the sequences' histogram is not the one the strategy was made for.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    ids = (
        np.arange(len(lengths), dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64)
    )
    if ids.shape != lengths.shape:
        raise UserError(f"{len(ids)} ids for {len(lengths)} lengths: expected one id per sequence")
    h = histogram_from_lengths(lengths, strategy.max_len)
    want = strategy.histogram()
    if not np.array_equal(h, want):
        diff = np.nonzero(h != want)[0]
        length = int(diff[0])
        raise UserError(
            f"the strategy ({strategy.algorithm}) packs {int(want[length])} sequences of length "
            f"{length} but the "
            f"data has {int(h[length])}: strategies must be built from the same data's histogram"
        )
    rng = np.random.default_rng(seed)
    patterns = sorted(strategy.packs.items())
    per_pack = np.repeat(np.arange(len(patterns)), [n for _, n in patterns])
    rng.shuffle(per_pack)  # pack order
    depth = np.array([len(p) for p, _ in patterns], dtype=np.int64)[per_pack]
    offsets = np.zeros(len(per_pack) + 1, dtype=np.int64)
    np.cumsum(depth, out=offsets[1:])
    # flat slot lengths: pattern j's lengths, for each pack in order
    flat_pat = np.concatenate([np.array(p, dtype=np.int64) for p, _ in patterns])
    pat_start = np.zeros(len(patterns) + 1, dtype=np.int64)
    np.cumsum([len(p) for p, _ in patterns], out=pat_start[1:])
    within = np.arange(offsets[-1]) - np.repeat(offsets[:-1], depth)
    slot_len = flat_pat[np.repeat(pat_start[per_pack], depth) + within]
    # ids grouped by length in random order within a length; slots grouped by length in pack order
    perm = rng.permutation(len(ids))
    ids_sorted = ids[perm][np.argsort(lengths[perm], kind="stable")]
    out = np.empty(offsets[-1], dtype=np.int64)
    out[np.argsort(slot_len, kind="stable")] = ids_sorted
    return PackedSequences(out, offsets)
