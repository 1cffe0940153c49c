"""The packing speed-up of a config's own training corpus: pack its length histogram with the
config's algorithm and read sequences per row (``BertFamily.packing_speedup``; the time-to-train
benchmark and the planner size their runs with it)."""

from __future__ import annotations

from typing import Any

from scaleout.families.bert.packing.hist import histogram_from_lengths
from scaleout.families.bert.packing.pack import pack_histogram


def corpus_speedup(cfg: Any) -> tuple[float, str]:
    """(sequences per packed row, algorithm) of ``cfg``'s training corpus at its ``data.*``
    settings; ``data.packing: none`` is priced as lpfhp (what the packed recipes run)."""
    from scaleout.families.bert.data.bert_sources import load_bert_data  # deferred: reads data

    d = cfg.data
    algo = d.packing if d.packing != "none" else "lpfhp"
    lengths = [len(s) for s in load_bert_data(cfg).train]
    s = pack_histogram(
        histogram_from_lengths(lengths, d.max_seq_len), d.max_seq_len, d.max_per_pack, algo
    )
    return float(s.speedup), algo
