"""Sequence-length histograms: read them from files or lengths, with one-line errors for bad input.

A histogram is a numpy int64 array ``h`` of size ``max_len + 1`` where ``h[l]`` is the number of
sequences of length ``l`` (``h[0]`` is always 0). The file format is Graphcore's (arXiv 2107.02027,
``../shared/data/wikipedia_seqlen_hist_512.txt``): one ``length count`` pair per line, ``#``
comments, blank lines ignored.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from scaleout.errors import UserError

# Sequence counts and token totals are int64 in every histogram and packing computation; keeping the
# totals below 2^62 leaves headroom for the algorithms' own sums (packs x max_len) without wrapping
# silently.
MAX_TOTAL = 1 << 62


# A histogram is max_len + 1 int64 bins; 2^20 tokens per pack is 8 times the longest context of any
# published BERT-style packing setup and an 8 MiB histogram, while 10^12 would be an 8 TB
# allocation.
MAX_LEN = 1 << 20


def check_max_len(max_len: int) -> int:
    if (
        isinstance(max_len, bool)
        or not isinstance(max_len, (int, np.integer))
        or not 1 <= max_len <= MAX_LEN
    ):
        raise UserError(f"max_len={max_len!r} must be an integer >= 1 and <= {MAX_LEN}")
    return int(max_len)


def parse_histogram(
    text: str, max_len: int | None = None, source: str = "<histogram>"
) -> np.ndarray:
    """Parse ``length count`` lines. ``max_len`` defaults to the largest length in the file."""
    if max_len is not None:
        check_max_len(max_len)
    pairs: dict[int, int] = {}
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise UserError(f"{source} line {no}: expected 'length count', got {raw.strip()!r}")
        try:
            length, count = int(parts[0]), int(parts[1])
        except ValueError:
            raise UserError(
                f"{source} line {no}: expected two integers 'length count', got {raw.strip()!r}"
            ) from None
        if length < 1:
            raise UserError(f"{source} line {no}: length {length} must be >= 1")
        if count < 0:
            raise UserError(f"{source} line {no}: count {count} for length {length} must be >= 0")
        if max_len is not None and length > max_len:
            raise UserError(f"{source} line {no}: length {length} is longer than max_len={max_len}")
        if length in pairs:
            raise UserError(f"{source} line {no}: length {length} appears twice")
        pairs[length] = count
    if not pairs or sum(pairs.values()) == 0:
        raise UserError(f"{source}: empty histogram (no 'length count' line with a positive count)")
    check_totals(pairs, source)
    n = max_len if max_len is not None else max(pairs)
    h = np.zeros(n + 1, dtype=np.int64)
    for length, count in pairs.items():
        h[length] = count
    return h


def check_totals(pairs: dict[int, int], source: str) -> None:
    """Counts and tokens must fit int64 with headroom (Python ints do not wrap; numpy's would)."""
    sequences = sum(pairs.values())
    tokens = sum(length * count for length, count in pairs.items())
    if sequences > MAX_TOTAL or tokens > MAX_TOTAL:
        big = max(pairs.items(), key=lambda kv: kv[1])
        raise UserError(
            f"{source}: {sequences} sequences / {tokens} tokens in total (largest count {big[1]} "
            "for length "
            f"{big[0]}): expected totals below 2^62"
        )


def load_histogram(path: str | os.PathLike[str], max_len: int | None = None) -> np.ndarray:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"histogram file {str(path)!r} not found")
    try:
        text = p.read_text()
    except UnicodeDecodeError:
        raise UserError(
            f"histogram file {str(path)!r} is not a text file of 'length count' lines"
        ) from None
    return parse_histogram(text, max_len, source=str(path))


def histogram_from_lengths(lengths: Iterable[int], max_len: int) -> np.ndarray:
    max_len = check_max_len(max_len)
    arr = np.asarray(list(lengths), dtype=np.int64)
    if arr.size == 0:
        raise UserError("no sequences to pack (empty list of lengths)")
    if arr.min() < 1 or arr.max() > max_len:
        bad = int(arr.min()) if arr.min() < 1 else int(arr.max())
        raise UserError(f"sequence length {bad} outside 1..max_len={max_len}")
    return np.bincount(arr, minlength=max_len + 1).astype(np.int64)


def format_histogram(h: np.ndarray) -> str:
    lines = [f"# sequence-length histogram, max_len={len(h) - 1}, {int(h.sum())} sequences"]
    lines += [f"{length} {int(c)}" for length, c in enumerate(h) if length > 0]
    return "\n".join(lines) + "\n"
