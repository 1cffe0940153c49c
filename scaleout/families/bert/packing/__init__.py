"""Sequence packing without cross-contamination (Graphcore, arXiv 2107.02027; NVIDIA MLPerf v2.0
BERT).

    h = load_histogram("../shared/data/wikipedia_seqlen_hist_512.txt", max_len=512)
    s = pack_histogram(h, max_len=512, max_per_pack=3, algorithm="lphp")   # or spfhp, lpfhp,
    nnlshp, auto
    s.efficiency, s.speedup, s.depth_histogram(), s.seconds
    packed = assign_sequences(s, lengths, seed=0)                          # ids per pack

The pieces live in ``hist`` (histogram files), ``strategy`` (the Strategy and its metrics),
``algos`` (the algorithms), ``auto`` (best of them), ``pack`` (``pack_histogram``: one of them or
auto) and ``assign`` (sequences -> packs); the BERT batch layout of a pack is
:mod:`scaleout.families.bert.data.bert_batch`.
"""

from scaleout.families.bert.packing.algos import ALGORITHMS, exact_fill_patterns
from scaleout.families.bert.packing.assign import PackedSequences, assign_sequences
from scaleout.families.bert.packing.hist import (
    format_histogram,
    histogram_from_lengths,
    load_histogram,
    parse_histogram,
)
from scaleout.families.bert.packing.pack import pack_histogram
from scaleout.families.bert.packing.strategy import Strategy, speedup_ceiling

__all__ = [
    "ALGORITHMS",
    "PackedSequences",
    "Strategy",
    "assign_sequences",
    "exact_fill_patterns",
    "format_histogram",
    "histogram_from_lengths",
    "load_histogram",
    "pack_histogram",
    "parse_histogram",
    "speedup_ceiling",
]
