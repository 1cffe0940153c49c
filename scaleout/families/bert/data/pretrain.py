"""BERT pre-training samples from the offline corpus: sentence pairs, NSP labels, 15 % masking.

Sample creation follows Google's BERT ``create_pretraining_data.py`` (Devlin et al. 2018, sec. 3.1
and appendix A.1), which MLPerf's BERT data is made with:

* per document, sentences are accumulated into a chunk up to a target length (``max_seq_len - 3``;
  with probability ``short_seq_prob`` = 0.1 a shorter random target, so the model also sees short
  inputs); the chunk is split at a random sentence boundary into A and B;
* with probability 0.5 B is replaced by text from a random other document (NSP label 1 = "random
  next"; 0 = B really follows A) and the unused sentences go back to the pool;
* ``[CLS] A [SEP] B [SEP]``, the longer of A/B trimmed from a random end until it fits;
* 15 % of the non-special tokens (``round(0.15 * len)``, at least 1, at most ``max_predictions``
  mask slots) are chosen; of those 80 % become ``[MASK]``, 10 % a random token, 10 % stay unchanged.

Each sample is a :class:`BertSample` of *unpadded* numpy arrays, i.e. its real length; the collator
(``scaleout.families.bert.data.bert_batch``) pads or packs them. :func:`to_padded` gives the
fixed-shape MLPerf layout (the same field names as MLPerf's HDF5 shards, see
``scaleout.families.bert.data.shard_format``). ``dupe_factor`` copies of the corpus are made with
different masks (Google uses 10). Everything is a function of ``seed``; results are cached as
``.npz`` keyed by the corpus hash and every setting.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import sysconfig
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from scaleout.data.corpus import (
    Document,
    cache_dir,
    corpus_hash,
    is_eval,
    load_corpus,
    stdlib_files,
)
from scaleout.data.tokenizer import WordPiece, train_or_load
from scaleout.errors import UserError
from scaleout.fsutil import atomic_write, atomic_write_path, file_lock
from scaleout.output import format_table

FORMAT_VERSION = 1


@dataclass
class BertSample:
    """One sequence: ``[CLS] A [SEP] B [SEP]`` with its masked positions (all int32, unpadded)."""

    input_ids: np.ndarray  # [L] token ids after masking
    token_type_ids: np.ndarray  # [L] 0 for [CLS] A [SEP], 1 for B [SEP]
    masked_positions: np.ndarray  # [m] positions in input_ids, ascending
    masked_labels: np.ndarray  # [m] original token ids at those positions
    nsp_label: int  # 1 = B is a random next segment, 0 = B follows A

    def __len__(self) -> int:
        return len(self.input_ids)


def create_samples(
    docs: list[list[list[int]]],
    tok: WordPiece,
    max_seq_len: int = 128,
    max_predictions: int = 20,
    mask_prob: float = 0.15,
    short_seq_prob: float = 0.1,
    dupe_factor: int = 1,
    seed: int = 0,
) -> list[BertSample]:
    """``docs``: documents as lists of tokenised sentences. Returns samples, deterministic in
    ``seed``."""
    if max_seq_len < 8:
        raise UserError(
            f"data.max_seq_len={max_seq_len} is too short for [CLS] A [SEP] B [SEP]; expected >= 8"
        )
    docs = [d for d in docs if d]
    if len(docs) < 2:
        raise UserError(
            f"need at least 2 non-empty documents for next-sentence pairs, got {len(docs)}"
        )
    rng = random.Random(seed)
    vocab_words = list(range(5, len(tok)))  # random replacements never produce special tokens
    out: list[BertSample] = []
    for _ in range(dupe_factor):
        for di in range(len(docs)):
            out.extend(
                _document_samples(
                    docs,
                    di,
                    tok,
                    max_seq_len,
                    max_predictions,
                    mask_prob,
                    short_seq_prob,
                    vocab_words,
                    rng,
                )
            )
    rng.shuffle(out)
    return out


def _document_samples(
    docs, di, tok, max_seq_len, max_predictions, mask_prob, short_seq_prob, vocab_words, rng
):
    doc = docs[di]
    max_tokens = max_seq_len - 3
    target = rng.randint(2, max_tokens) if rng.random() < short_seq_prob else max_tokens
    samples, chunk, length, i = [], [], 0, 0
    while i < len(doc):
        chunk.append(doc[i])
        length += len(doc[i])
        if i == len(doc) - 1 or length >= target:
            if chunk:
                a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
                a = [t for s in chunk[:a_end] for t in s]
                b: list[int] = []
                if len(chunk) == 1 or rng.random() < 0.5:
                    nsp = 1
                    other = di
                    for _ in range(10):
                        other = rng.randint(0, len(docs) - 1)
                        if other != di:
                            break
                    odoc = docs[other]
                    start = rng.randint(0, len(odoc) - 1)
                    for s in odoc[start:]:
                        b.extend(s)
                        if len(b) >= target - len(a):
                            break
                    i -= len(chunk) - a_end  # put the unused sentences back
                else:
                    nsp = 0
                    b = [t for s in chunk[a_end:] for t in s]
                _truncate_pair(a, b, max_tokens, rng)
                if a and b:
                    samples.append(
                        _mask(tok, a, b, nsp, max_predictions, mask_prob, vocab_words, rng)
                    )
            chunk, length = [], 0
            target = rng.randint(2, max_tokens) if rng.random() < short_seq_prob else max_tokens
        i += 1
    return samples


def _truncate_pair(a: list[int], b: list[int], max_tokens: int, rng: random.Random) -> None:
    while len(a) + len(b) > max_tokens:
        longer = a if len(a) > len(b) else b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def _mask(tok, a, b, nsp, max_predictions, mask_prob, vocab_words, rng) -> BertSample:
    ids = [tok.cls_id, *a, tok.sep_id, *b, tok.sep_id]
    types = [0] * (len(a) + 2) + [1] * (len(b) + 1)
    cand = [i for i, t in enumerate(ids) if t not in (tok.cls_id, tok.sep_id)]
    rng.shuffle(cand)
    n = min(max_predictions, max(1, round(len(ids) * mask_prob)))
    chosen = sorted(cand[:n])
    labels = [ids[p] for p in chosen]
    for p in chosen:
        r = rng.random()
        if r < 0.8:
            ids[p] = tok.mask_id
        elif r < 0.9:
            ids[p] = rng.choice(vocab_words)
        # else: keep the original token
    return BertSample(
        np.asarray(ids, np.int32),
        np.asarray(types, np.int32),
        np.asarray(chosen, np.int32),
        np.asarray(labels, np.int32),
        nsp,
    )


def to_padded(sample: BertSample, max_seq_len: int, max_predictions: int) -> dict[str, np.ndarray]:
    """Fixed-shape arrays with MLPerf's HDF5 field names (masked_lm_ids 0 = empty slot)."""
    n, m = len(sample), len(sample.masked_positions)
    if n > max_seq_len or m > max_predictions:
        raise UserError(
            f"sample of length {n} with {m} masks does not fit max_seq_len={max_seq_len}, "
            f"max_predictions={max_predictions}"
        )
    out = {k: np.zeros(max_seq_len, np.int32) for k in ("input_ids", "input_mask", "segment_ids")}
    out["input_ids"][:n] = sample.input_ids
    out["input_mask"][:n] = 1
    out["segment_ids"][:n] = sample.token_type_ids
    out["masked_lm_positions"] = np.zeros(max_predictions, np.int32)
    out["masked_lm_ids"] = np.zeros(max_predictions, np.int32)
    out["masked_lm_positions"][:m] = sample.masked_positions
    out["masked_lm_ids"][:m] = sample.masked_labels
    out["next_sentence_labels"] = np.asarray(sample.nsp_label, np.int32)
    return out


# -- statistics the README states ------------------------------------------------------------------
def mlm_baselines(samples: list[BertSample]) -> dict[str, Any]:
    """Accuracies a model that learned nothing gets on these masked positions.

    ``most_frequent``: always predict the most frequent masked token (the floor any target must
    clear); ``copy_input``: predict the visible input token (right on the 10 % kept unchanged, and
    on random replacements that happen to hit). A target must sit well above both.
    """
    labels: Counter[int] = Counter()
    copies = total = 0
    for s in samples:
        labels.update(s.masked_labels.tolist())
        copies += int(np.sum(s.input_ids[s.masked_positions] == s.masked_labels))
        total += len(s.masked_labels)
    if not total:
        raise UserError("no masked positions in the samples")
    token, count = labels.most_common(1)[0]
    return {
        "most_frequent": count / total,
        "most_frequent_token": int(token),
        "copy_input": copies / total,
        "masked_positions": total,
    }


def length_stats(samples: list[BertSample], max_seq_len: int) -> dict[str, Any]:
    """Histogram (index = length) and summary of the real sequence lengths."""
    lens = np.array([len(s) for s in samples])
    hist = np.bincount(lens, minlength=max_seq_len + 1)
    return {
        "count": int(len(lens)),
        "mean": float(lens.mean()),
        "p50": float(np.percentile(lens, 50)),
        "p90": float(np.percentile(lens, 90)),
        "full_length_fraction": float(np.mean(lens == max_seq_len)),
        "padding_efficiency": float(lens.mean() / max_seq_len),
        "histogram": hist.tolist(),
    }


# -- the cached end-to-end builder
# -------------------------------------------------------------------
@dataclass
class PretrainData:
    tokenizer: WordPiece
    train: list[BertSample]
    eval: list[BertSample]
    info: dict[str, Any]


def build_pretraining_data(
    vocab_size: int = 4096,
    max_seq_len: int = 128,
    max_predictions: int = 20,
    mask_prob: float = 0.15,
    dupe_factor: int = 5,
    eval_fraction: float = 0.05,
    seed: int = 0,
    sources: tuple[str, ...] = ("pydoc", "stdlib"),
    cache: str | None = None,
    docs: list[Document] | None = None,
) -> PretrainData:
    """Corpus -> tokenizer -> train/eval samples; everything cached under ``cache`` (default
    ~/.cache/scaleout).

    Eval documents (a hash-chosen ``eval_fraction``) never appear in training; eval samples are made
    once (dupe 1) with a fixed seed so every run evaluates on the same masked positions.
    """
    cache = cache or cache_dir()
    # One builder at a time: ranks starting together on a cold cache wait for the first one and then
    # read its files instead of all spending the same ~25 s (2-core machine) building them.
    with file_lock(os.path.join(cache, "build.lock")):
        docs = docs if docs is not None else _cached_corpus(sources, cache)
        key_src = (
            f"{corpus_hash(docs)}:{vocab_size}:{max_seq_len}:{max_predictions}:{mask_prob}:{dupe_factor}:"
            f"{eval_fraction}:{seed}:{FORMAT_VERSION}"
        )
        key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
        train_docs = [d for d in docs if not is_eval(d, eval_fraction)]
        eval_docs = [d for d in docs if is_eval(d, eval_fraction)]
        tok = train_or_load(
            [s for d in train_docs for s in d.sentences], vocab_size, corpus_hash(train_docs), cache
        )
        path = os.path.join(cache, f"pretrain-{key}.npz")
        if os.path.exists(path):
            try:
                train, ev = load_samples(path)
                return PretrainData(tok, train, ev, _info(train, ev, max_seq_len, path))
            except (OSError, ValueError, KeyError):
                pass
        enc = lambda ds: [[tok.encode(s) for s in d.sentences] for d in ds]  # noqa: E731
        train = create_samples(
            enc(train_docs),
            tok,
            max_seq_len,
            max_predictions,
            mask_prob,
            dupe_factor=dupe_factor,
            seed=seed,
        )
        ev = create_samples(
            enc(eval_docs),
            tok,
            max_seq_len,
            max_predictions,
            mask_prob,
            dupe_factor=1,
            seed=seed + 1_000_003,
        )
        save_samples(path, train, ev)
        return PretrainData(tok, train, ev, _info(train, ev, max_seq_len, path))


def _info(train, ev, max_seq_len, path) -> dict[str, Any]:
    return {
        "train_samples": len(train),
        "eval_samples": len(ev),
        "cache": path,
        "lengths": {k: v for k, v in length_stats(train, max_seq_len).items() if k != "histogram"},
        "eval_baselines": mlm_baselines(ev),
    }


def _cached_corpus(sources: tuple[str, ...], cache: str) -> list[Document]:
    """Parsing the stdlib takes seconds; the parsed documents are cached per Python build and
    listing of the stdlib files the corpus reads (corpus.stdlib_files: not site-packages, whose
    ~25k files cost every rank ~1 s of stat calls at each start and changed the key at every
    pip install)."""

    root = sysconfig.get_paths()["stdlib"]
    h = hashlib.sha256(f"{sys.version}:{root}:{sources}".encode())
    if "stdlib" in sources:
        for path in stdlib_files(root):
            h.update(f"{path}:{os.path.getsize(path)}".encode())
    path = os.path.join(cache, f"corpus-{h.hexdigest()[:16]}.json")
    if os.path.exists(path):
        try:
            with open(path) as fh:
                return [Document(n, tuple(s)) for n, s in json.load(fh)]
        except (OSError, ValueError):
            pass
    docs = load_corpus(sources)
    atomic_write(path, json.dumps([[d.name, list(d.sentences)] for d in docs]))
    return docs


def save_samples(path: str, train: list[BertSample], ev: list[BertSample]) -> None:
    arrays: dict[str, np.ndarray] = {}
    for split, samples in (("train", train), ("eval", ev)):
        arrays[f"{split}_ids"] = np.concatenate([s.input_ids for s in samples])
        arrays[f"{split}_types"] = np.concatenate([s.token_type_ids for s in samples]).astype(
            np.int8
        )
        arrays[f"{split}_len"] = np.array([len(s) for s in samples], np.int32)
        arrays[f"{split}_mpos"] = np.concatenate([s.masked_positions for s in samples])
        arrays[f"{split}_mlab"] = np.concatenate([s.masked_labels for s in samples])
        arrays[f"{split}_mlen"] = np.array([len(s.masked_positions) for s in samples], np.int32)
        arrays[f"{split}_nsp"] = np.array([s.nsp_label for s in samples], np.int8)
    atomic_write_path(path, lambda tmp: np.savez(tmp, **arrays), keep_suffix=True)


def load_samples(path: str) -> tuple[list[BertSample], list[BertSample]]:
    with np.load(path) as z:
        out = []
        for split in ("train", "eval"):
            ids, types, mpos, mlab = (
                z[f"{split}_ids"],
                z[f"{split}_types"],
                z[f"{split}_mpos"],
                z[f"{split}_mlab"],
            )
            off, moff = (
                np.concatenate([[0], np.cumsum(z[f"{split}_len"])]),
                np.concatenate([[0], np.cumsum(z[f"{split}_mlen"])]),
            )
            nsp = z[f"{split}_nsp"]
            out.append(
                [
                    BertSample(
                        ids[off[i] : off[i + 1]],
                        types[off[i] : off[i + 1]].astype(np.int32),
                        mpos[moff[i] : moff[i + 1]],
                        mlab[moff[i] : moff[i + 1]],
                        int(nsp[i]),
                    )
                    for i in range(len(nsp))
                ]
            )
    return out[0], out[1]


def main(argv: list[str] | None = None) -> int:
    """``python3 -m scaleout.families.bert.data.pretrain [--vocab-size N --max-seq-len L ...]``:
    build (or load) and describe."""

    p = argparse.ArgumentParser(
        prog="python3 -m scaleout.families.bert.data.pretrain", description=main.__doc__
    )
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--max-seq-len", type=int, default=128)
    p.add_argument("--max-predictions", type=int, default=20)
    p.add_argument("--dupe-factor", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    d = build_pretraining_data(
        a.vocab_size, a.max_seq_len, a.max_predictions, dupe_factor=a.dupe_factor, seed=a.seed
    )
    took = time.perf_counter() - t0
    lens, base = d.info["lengths"], d.info["eval_baselines"]
    rows = [
        ["python", sys.version.split()[0]],
        ["vocabulary (WordPiece)", len(d.tokenizer)],
        ["train / eval sequences", f"{len(d.train)} / {len(d.eval)}"],
        ["mean length / max", f"{lens['mean']:.1f} / {a.max_seq_len}"],
        ["median, p90 length", f"{lens['p50']:.0f}, {lens['p90']:.0f}"],
        ["full-length fraction", f"{lens['full_length_fraction']:.3f}"],
        ["padding efficiency (padded batches)", f"{lens['padding_efficiency']:.3f}"],
        ["eval masked positions", base["masked_positions"]],
        [
            "MLM baseline: most frequent token",
            f"{base['most_frequent']:.4f} ('{d.tokenizer.vocab[base['most_frequent_token']]}')",
        ],
        ["MLM baseline: copy the input token", f"{base['copy_input']:.4f}"],
        ["build or load time", f"{took:.1f} s"],
        ["cache", d.info["cache"]],
    ]
    print(format_table(["corpus", "value"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
