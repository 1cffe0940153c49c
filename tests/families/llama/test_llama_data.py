"""Megatron-style indexed token files and the rows cut from them."""

from __future__ import annotations

import numpy as np
import pytest

from scaleout.errors import UserError
from scaleout.families.llama.data.indexed import (
    HEADER,
    IndexedTokens,
    token_dtype,
    write_indexed,
)
from scaleout.families.llama.data.rows import Rows


def _docs(seed: int = 0, n: int = 50, vocab: int = 128256) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(0, 40)) for _ in range(n)]


@pytest.mark.unit
def test_round_trip_and_the_layout_megatron_reads(tmp_path) -> None:
    docs = _docs()
    assert token_dtype(128256) == np.int32 and token_dtype(32000) == np.uint16
    write_indexed(tmp_path / "c4", docs, token_dtype(128256))
    ds = IndexedTokens(tmp_path / "c4")
    assert len(ds) == len(docs) and ds.dtype == np.int32
    for i, d in enumerate(docs):
        assert np.array_equal(ds[i], d)
    assert ds.total_tokens == sum(len(d) for d in docs)
    # the .idx layout byte for byte: header, sizes, pointers (byte offsets), document starts
    raw = (tmp_path / "c4.idx").read_bytes()
    magic, version, code, n, ndocs = HEADER.unpack(raw[: HEADER.size])
    assert (magic, version, code, n, ndocs) == (b"MMIDIDX\x00\x00", 1, 4, len(docs), len(docs) + 1)
    sizes = np.frombuffer(raw, np.int32, n, 34)
    pointers = np.frombuffer(raw, np.int64, n, 34 + 4 * n)
    assert sizes.tolist() == [len(d) for d in docs]
    assert pointers.tolist() == (np.cumsum([0] + sizes.tolist()[:-1]) * 4).tolist()
    assert (tmp_path / "c4.bin").stat().st_size == 4 * sum(len(d) for d in docs)


@pytest.mark.unit
@pytest.mark.parametrize(
    "damage",
    ["magic", "truncated_idx", "truncated_bin", "missing_bin"],
)
def test_a_damaged_corpus_is_one_line(tmp_path, damage: str) -> None:
    write_indexed(tmp_path / "c", _docs(), np.int32)
    idx, bin_ = tmp_path / "c.idx", tmp_path / "c.bin"
    if damage == "magic":
        idx.write_bytes(b"NOTMEGA" + idx.read_bytes()[7:])
    elif damage == "truncated_idx":
        idx.write_bytes(idx.read_bytes()[:-8])
    elif damage == "truncated_bin":
        bin_.write_bytes(bin_.read_bytes()[:-4])
    else:
        bin_.unlink()
    with pytest.raises(UserError) as e:
        IndexedTokens(tmp_path / "c")
    assert "\n" not in str(e.value) and "c." in str(e.value)


@pytest.mark.unit
@pytest.mark.parametrize("seed", [None, 3])
def test_rows_hold_every_token_once_with_document_ids(tmp_path, seed: int | None) -> None:
    docs = _docs(1, n=80, vocab=1000)
    write_indexed(tmp_path / "c", docs, np.uint16)
    rows = Rows(IndexedTokens(tmp_path / "c"), seq_len=16, seed=seed)
    order = rows.order
    stream = np.concatenate([docs[i] for i in order])
    assert len(rows) == len(stream) // 16
    ids_stream = np.concatenate([np.full(len(docs[i]), k) for k, i in enumerate(order)])
    for r in range(len(rows)):
        tokens, doc_ids = rows[r]
        assert np.array_equal(tokens, stream[16 * r : 16 * (r + 1)])
        assert np.array_equal(doc_ids, ids_stream[16 * r : 16 * (r + 1)])
