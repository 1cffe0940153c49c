"""Write MLPerf BERT shards from the offline corpus (``scaleout data make-shards``).

The corpus (:mod:`scaleout.data.corpus`), WordPiece vocabulary
(:mod:`scaleout.data.tokenizer`) and samples
(:mod:`scaleout.families.bert.data.pretrain`, Google's ``create_pretraining_data`` procedure) are
the ones ``data.source: pydoc`` trains on; this writes them in the MLPerf file layout so every
``data.source: wikipedia`` code path runs on files of the real format::

    DIR/train/part_00000_of_0000N.hdf5 ... N training shards, sizes differing by at most one
    sequence
                                          (as NVIDIA's chop_hdf5_files.py balances them)
    DIR/eval/part_eval_<n>.hdf5            the held-out documents' sequences (MLPerf:
    part_eval_10k.hdf5)
    DIR/vocab.txt                          the WordPiece vocabulary, one token per line (BERT's
    format)

Layouts (:mod:`scaleout.families.bert.data.shard_format`): ``fixed`` (the reference), ``varlength``
(NVIDIA v1.0+) or ``packed`` (NVIDIA v2.0+: each shard packed with ``packing`` at <=
``max_per_pack`` per row; the eval file stays unpacked, as NVIDIA's eval_varlength).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from scaleout.errors import UserError
from scaleout.families.bert.data.pretrain import build_pretraining_data
from scaleout.families.bert.data.shard_format import LAYOUTS, write_shard
from scaleout.families.bert.packing import assign_sequences, histogram_from_lengths, pack_histogram


def make_shards(
    out: str | os.PathLike[str],
    shards: int,
    layout: str = "fixed",
    max_seq_len: int = 128,
    max_predictions: int = 20,
    vocab_size: int = 4096,
    dupe_factor: int = 5,
    seed: int = 0,
    eval_samples: int | None = None,
    packing: str = "lphp",
    max_per_pack: int = 3,
    cache: str | None = None,
    docs: Any = None,
) -> dict[str, Any]:
    """Write the shards; returns what was written (files, sequences, tokens)."""

    if shards < 1:
        raise UserError(f"--shards={shards}: expected at least 1 training shard")
    if layout not in LAYOUTS:
        raise UserError(f"--layout={layout!r}: expected one of {', '.join(LAYOUTS)}")
    data = build_pretraining_data(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        max_predictions=max_predictions,
        dupe_factor=dupe_factor,
        seed=seed,
        cache=cache,
        docs=docs,
    )
    if len(data.train) < shards:
        raise UserError(
            f"--shards={shards}: the corpus gives only {len(data.train)} training sequences"
        )
    ev = data.eval if eval_samples is None else data.eval[:eval_samples]
    root = Path(out)
    (root / "train").mkdir(parents=True, exist_ok=True)
    (root / "eval").mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, len(data.train), shards + 1).round().astype(int)
    written = []
    for i in range(shards):
        part = data.train[bounds[i] : bounds[i + 1]]
        rows = (
            _packed_rows(part, max_seq_len, packing, max_per_pack, seed + i)
            if layout == "packed"
            else [[s] for s in part]
        )
        path = root / "train" / f"part_{i:05d}_of_{shards:05d}.hdf5"
        write_shard(path, rows, layout, max_seq_len, max_predictions)
        written.append(path)
    ev_layout = "varlength" if layout == "packed" else layout
    ev_path = root / "eval" / f"part_eval_{len(ev)}.hdf5"
    write_shard(ev_path, [[s] for s in ev], ev_layout, max_seq_len, max_predictions)
    (root / "vocab.txt").write_text("\n".join(data.tokenizer.vocab) + "\n")
    return {
        "train": [str(p) for p in written],
        "eval": str(ev_path),
        "layout": layout,
        "train_sequences": len(data.train),
        "eval_sequences": len(ev),
        "train_tokens": int(sum(len(s) for s in data.train)),
        "vocab_size": len(data.tokenizer),
    }


def _packed_rows(
    samples: list[Any], max_len: int, algorithm: str, depth: int, seed: int
) -> list[list[Any]]:
    """Samples grouped into packs (``algorithm`` on this shard's length histogram, as NVIDIA
    packs offline)."""

    lengths = np.array([len(s) for s in samples])
    strategy = pack_histogram(histogram_from_lengths(lengths, max_len), max_len, depth, algorithm)
    packed = assign_sequences(strategy, lengths, seed=seed)
    return [[samples[i] for i in packed.pack(k)] for k in range(len(packed))]
