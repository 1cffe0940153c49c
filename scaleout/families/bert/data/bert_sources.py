"""Other BERT sample sources: MLPerf Wikipedia shards at a config path, and synthetic data.

**Wikipedia shards** (``data.source: wikipedia``, ``data.path``): MLPerf BERT's pre-processed HDF5
in any of the layouts of :mod:`scaleout.families.bert.data.shard_format` (the reference's
fixed-length rows, NVIDIA's varlength or packed shards; ``.npz`` with the fixed keys for tiny
tests). Training reads them lazily, rank by rank (:mod:`scaleout.families.bert.data.shard_source`);
:func:`load_shards` here reads *everything* into memory and is for small data sets and tools only.

**Synthetic** samples for throughput runs: random tokens with lengths drawn from a histogram (by
default every sequence is full length; pass the Wikipedia-512 histogram to get its distribution).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from scaleout.errors import ConfigError, UserError
from scaleout.families.bert.data.pretrain import (
    BertSample,
    PretrainData,
    build_pretraining_data,
    length_stats,
    mlm_baselines,
)
from scaleout.families.bert.data.shard_format import KEYS, SUFFIXES, ShardReader, shard_files

__all__ = [
    "KEYS",
    "SUFFIXES",
    "load_bert_data",
    "load_shards",
    "read_length_histogram",
    "shard_files",
    "synthetic_samples",
    "to_bert_sequences",
]


def load_shards(path: str | os.PathLike[str]) -> list[BertSample]:
    """Every sequence of every shard, unpadded, as :class:`BertSample` records (MLPerf's NSP
    convention, 1 = random next). Eager: the whole data set in memory -- small data sets and
    tools, never training."""
    out: list[BertSample] = []
    for f in shard_files(path):
        reader = ShardReader(f)
        try:
            rows = reader.read(np.arange(reader.rows))
        finally:
            reader.close()
        out.extend(
            BertSample(
                np.asarray(q.tokens, np.int32),
                np.asarray(q.segments, np.int32),
                np.asarray(q.mlm_positions, np.int32),
                np.asarray(q.mlm_labels, np.int32),
                1 - int(q.nsp_label),
            )
            for row in rows
            for q in row
        )
    return out


def read_length_histogram(path: str | os.PathLike[str]) -> np.ndarray:
    """A ``length count`` per line text histogram (comments with #) -> counts indexed by length."""
    pairs = [
        tuple(int(x) for x in ln.split()[:2])
        for ln in Path(path).read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    hist = np.zeros(max(k for k, _ in pairs) + 1, np.int64)
    for k, c in pairs:
        hist[k] = c
    return hist


def synthetic_samples(
    n: int,
    max_seq_len: int = 512,
    vocab_size: int = 30522,
    max_predictions: int = 76,
    seed: int = 0,
    length_hist: np.ndarray | None = None,
) -> list[BertSample]:
    """Random-token samples (throughput runs): ids in [5, vocab), 15 % masked, random NSP labels.

    ``max_predictions`` = 76 is MLPerf BERT's mask slots at 512 tokens.
    """
    if n < 1 or vocab_size <= 5:
        raise UserError(
            f"synthetic BERT data needs n >= 1 and vocab_size > 5, got n={n}, "
            f"vocab_size={vocab_size}"
        )
    rng = np.random.default_rng(seed)
    if length_hist is None:
        lens = np.full(n, max_seq_len)
    else:
        h = np.asarray(length_hist, float)[: max_seq_len + 1].copy()
        h[:8] = 0  # [CLS] a [SEP] b [SEP] needs a few tokens
        if h.sum() <= 0:
            raise UserError("the length histogram has no sequences of length 8..max_seq_len")
        lens = rng.choice(len(h), size=n, p=h / h.sum())
    out = []
    for L in lens:
        L = int(L)
        ids = rng.integers(5, vocab_size, L).astype(np.int32)
        a = int(rng.integers(1, L - 3))
        ids[0], ids[a + 1], ids[L - 1] = 2, 3, 3  # [CLS] A [SEP] B [SEP]
        types = np.zeros(L, np.int32)
        types[a + 2 :] = 1
        cand = np.setdiff1d(np.arange(1, L - 1), [a + 1])
        m = min(max_predictions, max(1, round(0.15 * L)), len(cand))
        pos = np.sort(rng.choice(cand, m, replace=False)).astype(np.int32)
        labels = ids[pos].copy()
        ids[pos] = 4  # [MASK]
        out.append(BertSample(ids, types, pos, labels, int(rng.integers(0, 2))))
    return out


def to_bert_sequences(samples: list[BertSample]) -> list:
    """Records -> :class:`scaleout.families.bert.data.bert_batch.BertSequence` for ``build_batch``
    (packed or padded).

    NSP convention: our records (like Google's and MLPerf's data) use 1 = *random* next; bert_batch
    uses 1 = *is* next, so the label is flipped here, in the one place the two meet.
    """
    from scaleout.families.bert.data.bert_batch import BertSequence  # deferred: pulls in torch

    return [
        BertSequence(
            s.input_ids.tolist(),
            s.token_type_ids.tolist(),
            s.masked_positions.tolist(),
            s.masked_labels.tolist(),
            1 - int(s.nsp_label),
        )
        for s in samples
    ]


def load_bert_data(cfg, cache: str | None = None):
    """Train/eval records for ``cfg.data.source`` (pydoc, wikipedia or synthetic) as a PretrainData.

    wikipedia: ``data.path`` holds ``train/`` and ``eval/`` folders of shards (MLPerf ships its 10k
    evaluation sequences separately); a path without them is all training data and the first
    ``data.eval_samples`` sequences are held out.
    """

    d, b = cfg.data, cfg.model.bert
    if d.source == "pydoc":
        data = build_pretraining_data(
            vocab_size=b.vocab_size,
            max_seq_len=d.max_seq_len,
            max_predictions=d.max_predictions,
            mask_prob=d.mask_prob,
            dupe_factor=d.dupe_factor,
            seed=d.seed,
            cache=cache,
        )
        if len(data.tokenizer) != b.vocab_size:
            raise ConfigError(
                f"model.bert.vocab_size={b.vocab_size}: the corpus only yields a "
                f"{len(data.tokenizer)}-token WordPiece vocabulary; use at most that"
            )
        return data
    if d.source == "wikipedia":
        if not d.path:
            raise ConfigError(
                "data.source=wikipedia needs data.path (a directory of MLPerf BERT shards)"
            )
        root = Path(d.path)
        if (root / "train").is_dir() and (root / "eval").is_dir():
            train, ev = load_shards(root / "train"), load_shards(root / "eval")
        else:
            everything = load_shards(root)
            ev, train = everything[: d.eval_samples], everything[d.eval_samples :]
        tok = None
    elif d.source == "synthetic":
        n = min(cfg.train.global_batch * cfg.train.max_steps, 65536)
        train = synthetic_samples(n, d.max_seq_len, b.vocab_size, d.max_predictions, seed=d.seed)
        ev = synthetic_samples(
            d.eval_samples, d.max_seq_len, b.vocab_size, d.max_predictions, seed=d.seed + 1
        )
        tok = None
    else:
        raise ConfigError(
            f"data.source={d.source} is not a BERT source; expected pydoc, wikipedia or synthetic"
        )
    too_long = max(len(s) for s in train + ev)
    if too_long > d.max_seq_len:
        raise ConfigError(
            f"data.max_seq_len={d.max_seq_len} but the data has sequences of {too_long} tokens"
        )
    info = {
        "train_samples": len(train),
        "eval_samples": len(ev),
        "lengths": {
            k: v for k, v in length_stats(train, d.max_seq_len).items() if k != "histogram"
        },
        "eval_baselines": mlm_baselines(ev),
    }
    return PretrainData(tok, train, ev, info)
