"""Offline BERT data: corpus, WordPiece tokenizer, pre-training samples, shards, synthetic data,
sampler.

Uses the pydoc part of the corpus (79 topics) and small vocabularies to stay fast; the cache goes
to a temporary directory so every run exercises the real build (and then the cached path)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from conftest import WIKI_HIST as HIST  # noqa: E402 -- the packaged copy

from scaleout.data.corpus import (
    corpus_hash,
    is_eval,
    pydoc_documents,
    split_sentences,
    stdlib_documents,
)
from scaleout.data.sampler import ShardedSampler
from scaleout.data.tokenizer import (
    SPECIALS,
    WordPiece,
    train_or_load,
    train_wordpiece,
)
from scaleout.errors import ConfigError, UserError
from scaleout.families.bert.data.bert_sources import (
    load_shards,
    read_length_histogram,
    synthetic_samples,
)
from scaleout.families.bert.data.pretrain import build_pretraining_data, mlm_baselines, to_padded


@pytest.fixture(scope="module")
def pydoc():
    return pydoc_documents()


@pytest.fixture(scope="module")
def data(pydoc, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("cache"))
    return build_pretraining_data(
        vocab_size=1024,
        max_seq_len=64,
        max_predictions=10,
        dupe_factor=2,
        eval_fraction=0.1,
        seed=7,
        cache=cache,
        docs=pydoc,
    ), cache


@pytest.mark.unit
def test_corpus_is_deterministic_and_never_imports(pydoc, tmp_path):
    assert len(pydoc) > 50 and corpus_hash(pydoc) == corpus_hash(pydoc_documents())
    assert split_sentences("One thing. Two things!\n\n>>> x = 1\nThree? four.") == [
        "One thing.",
        "Two things!",
        "Three? four.",
    ]
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "evil.py").write_text(
        '"""Module doc. Second sentence."""\nraise SystemExit("imported!")\n'
        'class A:\n    """Class doc."""\n    def f(self):\n        """Method doc."""\n'
    )
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "test_x.py").write_text('"""Skipped test suite."""\n')
    docs = stdlib_documents(str(tmp_path))  # parsed with ast: the SystemExit never runs
    assert [d.name for d in docs] == ["stdlib:pkg/evil.py"]
    assert docs[0].sentences == ("Module doc.", "Second sentence.", "Class doc.", "Method doc.")


@pytest.mark.multi_process
def test_real_stdlib_docstrings():
    docs = stdlib_documents()
    names = {d.name for d in docs}
    assert len(docs) > 300 and "stdlib:json/__init__.py" in names
    assert not any("/test/" in n or "site-packages" in n for n in names)
    assert sum(len(d.sentences) for d in docs) > 10_000


@pytest.mark.unit
def test_the_corpus_cache_key_stats_only_the_files_the_corpus_reads(monkeypatch, tmp_path):
    """Every rank computes the parsed corpus's cache key at each start: it stats the stdlib
    files the corpus reads, not site-packages (torch alone is ~15k files: ~1 s a rank a start,
    and a new key, so a ~25 s rebuild, at every pip install)."""
    import os

    from scaleout.data.corpus import stdlib_files
    from scaleout.families.bert.data import pretrain

    files = list(stdlib_files())
    assert files and not [f for f in files if "site-packages" in f or "/test/" in f]
    stated: list[str] = []
    monkeypatch.setattr(
        pretrain.os.path, "getsize", lambda p: stated.append(p) or os.stat(p).st_size
    )
    monkeypatch.setattr(pretrain, "load_corpus", lambda sources: [])  # the key, not the parse
    pretrain._cached_corpus(("stdlib",), str(tmp_path))
    assert stated == files


@pytest.mark.multi_process
def test_wordpiece_training_encoding_and_cache(pydoc, tmp_path):
    texts = [s for d in pydoc[:30] for s in d.sentences]
    tok = train_wordpiece(texts, 500)
    assert len(tok) == 500 and tok.vocab[:5] == list(SPECIALS)
    assert tok.vocab == train_wordpiece(texts, 500).vocab  # deterministic
    assert len(set(tok.vocab)) == 500
    ids = tok.encode("The return statement, and the loop.")
    assert tok.unk_id not in ids and tok.decode(ids) == "the return statement , and the loop ."
    assert tok.encode("日本") == [tok.unk_id]  # characters never seen -> [UNK], as BERT does
    assert any(t.startswith("##") for t in tok.vocab) and "the" in tok.ids
    t1 = train_or_load(texts, 300, "k", str(tmp_path))
    files = list(tmp_path.glob("wordpiece-*.json"))
    assert len(files) == 1
    assert (
        train_or_load([], 300, "k", str(tmp_path)).vocab == t1.vocab
    )  # second call reads the cache
    with pytest.raises(UserError, match="vocab_size=3"):
        train_wordpiece(texts, 3)
    with pytest.raises(UserError, match="must start with"):
        WordPiece(["a", "b"])


@pytest.mark.multi_process
def test_pretraining_samples_format(data):
    d, _ = data
    tok = d.tokenizer
    assert len(d.train) > 1000 and len(d.eval) > 50
    nsp, kinds, lens = [], Counter(), []
    for s in d.train:
        L = len(s)
        lens.append(L)
        assert L <= 64 and s.input_ids[0] == tok.cls_id and s.input_ids[-1] == tok.sep_id
        seps = np.flatnonzero(s.input_ids == tok.sep_id)
        # specials are never masked, so exactly two [SEP]s remain visible
        assert (
            len(seps) == 2 and s.token_type_ids[seps[0]] == 0 and s.token_type_ids[seps[0] + 1] == 1
        )
        assert np.all(np.diff(s.token_type_ids) >= 0)
        m = len(s.masked_positions)
        assert m == min(10, max(1, round(0.15 * L)))  # fixed number of mask slots for a length
        assert np.all(np.diff(s.masked_positions) > 0)
        assert not np.isin(s.masked_positions, [0, *seps]).any()
        assert not np.isin(s.masked_labels, range(5)).any()  # labels are real tokens
        for p, lab in zip(s.masked_positions, s.masked_labels, strict=True):
            got = s.input_ids[p]
            kinds["mask" if got == tok.mask_id else "keep" if got == lab else "random"] += 1
        nsp.append(s.nsp_label)
    total = sum(kinds.values())
    assert abs(kinds["mask"] / total - 0.8) < 0.02
    assert abs(kinds["keep"] / total - 0.1) < 0.02 and abs(kinds["random"] / total - 0.1) < 0.02
    assert 0.4 < np.mean(nsp) < 0.65
    # a real length distribution: mostly full, with short sequences (short_seq_prob, document ends)
    assert 0.3 < np.mean(np.array(lens) == 64) < 0.95 and min(lens) < 20
    # to_padded gives MLPerf's fixed shapes
    p = to_padded(d.train[0], 64, 10)
    assert p["input_ids"].shape == (64,) and p["masked_lm_ids"].shape == (10,)
    assert p["input_mask"].sum() == len(d.train[0])
    base = d.info["eval_baselines"]
    assert (
        base == mlm_baselines(d.eval)
        and 0 < base["most_frequent"] < 0.15
        and 0.05 < base["copy_input"] < 0.2
    )


@pytest.mark.multi_process
def test_pretraining_is_deterministic_cached_and_split(data, pydoc, tmp_path):
    d, cache = data
    again = build_pretraining_data(
        vocab_size=1024,
        max_seq_len=64,
        max_predictions=10,
        dupe_factor=2,
        eval_fraction=0.1,
        seed=7,
        cache=cache,
        docs=pydoc,
    )
    assert again.info["cache"] == d.info["cache"]
    for a, b in zip(d.train[:50] + d.eval[:20], again.train[:50] + again.eval[:20], strict=True):
        assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(
            a.masked_labels, b.masked_labels
        )
    other = build_pretraining_data(
        vocab_size=1024,
        max_seq_len=64,
        max_predictions=10,
        dupe_factor=2,
        eval_fraction=0.1,
        seed=8,
        cache=cache,
        docs=pydoc,
    )
    assert other.tokenizer.vocab == d.tokenizer.vocab  # same corpus and vocab size: same tokenizer
    assert not all(
        np.array_equal(a.input_ids, b.input_ids)
        for a, b in zip(d.train[:20], other.train[:20], strict=True)
    )
    ev = {doc.name for doc in pydoc if is_eval(doc, 0.1)}
    assert 0 < len(ev) < len(pydoc) // 3


@pytest.mark.unit
def test_shards_npz_and_hdf5_round_trip(data, tmp_path):
    d, _ = data
    rows = [to_padded(s, 64, 10) for s in d.train[:7]]
    arrays = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    np.savez(tmp_path / "part-0.npz", **arrays)
    loaded = load_shards(tmp_path)
    assert len(loaded) == 7
    for a, b in zip(loaded, d.train[:7], strict=True):
        assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(
            a.token_type_ids, b.token_type_ids
        )
        assert np.array_equal(a.masked_positions, b.masked_positions) and a.nsp_label == b.nsp_label
    import h5py  # in the test extra: missing is a failure, not a skip

    with h5py.File(tmp_path / "part-1.hdf5", "w") as f:
        for k, v in arrays.items():
            f[k] = v
    assert len(load_shards(tmp_path)) == 14
    np.savez(tmp_path / "bad.npz", input_ids=arrays["input_ids"])
    with pytest.raises(UserError, match="missing MLPerf BERT fields"):
        load_shards(tmp_path / "bad.npz")
    with pytest.raises(UserError, match="does not exist"):
        load_shards(tmp_path / "nope")


@pytest.mark.multi_process
def test_synthetic_bert_follows_length_histogram():
    full = synthetic_samples(20, max_seq_len=128, vocab_size=1000, max_predictions=20, seed=1)
    assert all(len(s) == 128 and len(s.masked_positions) == 19 for s in full)
    hist = read_length_histogram(HIST)
    s = synthetic_samples(3000, max_seq_len=512, seed=2, length_hist=hist)
    true_mean = (np.arange(len(hist)) * hist).sum() / hist.sum()
    assert abs(np.mean([len(x) for x in s]) / true_mean - 1) < 0.03


@pytest.mark.unit
def test_sharded_sampler_covers_disjointly_and_resumes():
    W, B, N = 4, 8, 50
    samplers = [ShardedSampler(N, B, r, W, seed=1) for r in range(W)]
    seen = []
    for step in range(
        N // B + 3
    ):  # crosses an epoch boundary mid-batch (50 is not a multiple of 8)
        per_rank = [s.local_indices(step * B) for s in samplers]
        assert all(len(p) == 2 for p in per_rank)
        flat = np.concatenate(per_rank)
        assert np.array_equal(flat, samplers[0].global_indices(step * B))
        seen.extend(flat.tolist())
    assert sorted(seen[:N]) == list(range(N))  # first epoch: every sample exactly once
    assert seen[:N] != list(range(N))  # shuffled
    it = samplers[1].iterate(0)
    positions = [next(it) for _ in range(5)]
    resumed = samplers[1].iterate(positions[2][0])  # resume from the data position after step 3
    assert np.array_equal(next(resumed)[1], positions[3][1])
    with pytest.raises(ConfigError, match="global_batch=10"):
        ShardedSampler(N, 10, 0, 4)
    with pytest.raises(UserError, match="rank 4"):
        ShardedSampler(N, 8, 4, 4)


@pytest.mark.unit
def test_records_feed_the_packed_batch_builder(data):
    from scaleout.families.bert.data.bert_batch import IGNORE_INDEX, build_batch
    from scaleout.families.bert.data.bert_sources import to_bert_sequences

    d, _ = data
    short = [s for s in d.train if len(s) <= 30][:3]
    seqs = to_bert_sequences(short)
    batch = build_batch(seqs, [[0, 1, 2]], max_len=sum(len(s) for s in short))
    row = batch["input_ids"][0].numpy()
    start = 0
    for j, s in enumerate(short):
        assert np.array_equal(row[start : start + len(s)], s.input_ids)
        assert batch["nsp_labels"][0, j].item() == 1 - s.nsp_label  # bert_batch: 1 = is-next
        start += len(s)
    labels = batch["mlm_labels"][0]
    got = labels[labels != IGNORE_INDEX].numpy()
    assert np.array_equal(got, np.concatenate([s.masked_labels for s in short]))


@pytest.mark.unit
def test_load_bert_data_from_config(tmp_path):
    from scaleout.config.schema import Config
    from scaleout.families.bert.data.bert_sources import load_bert_data
    from scaleout.families.bert.data.pretrain import to_padded

    cfg = Config.model_validate(
        {
            "data": {
                "source": "synthetic",
                "max_seq_len": 32,
                "max_predictions": 5,
                "eval_samples": 16,
            },
            "model": {"bert": {"vocab_size": 100, "max_position": 32}},
            "train": {"global_batch": 8, "max_steps": 4},
        }
    )
    syn = load_bert_data(cfg)
    assert len(syn.train) == 32 and len(syn.eval) == 16 and syn.info["lengths"]["mean"] == 32
    rows = [to_padded(s, 32, 5) for s in syn.train]
    for split, part in (("train", rows[:24]), ("eval", rows[24:])):
        (tmp_path / split).mkdir()
        np.savez(tmp_path / split / "a.npz", **{k: np.stack([r[k] for r in part]) for k in part[0]})
    wiki = load_bert_data(
        cfg.model_copy(
            update={
                "data": cfg.data.model_copy(update={"source": "wikipedia", "path": str(tmp_path)})
            }
        )
    )
    assert len(wiki.train) == 24 and len(wiki.eval) == 8
    small = cfg.model_copy(
        update={
            "data": cfg.data.model_copy(
                update={"source": "wikipedia", "path": str(tmp_path), "max_seq_len": 16}
            )
        }
    )
    with pytest.raises(ConfigError, match="max_seq_len=16"):
        load_bert_data(small)
