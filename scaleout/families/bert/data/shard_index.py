"""Per-shard length index and pack assignment for MLPerf BERT shards, built once and cached beside
the data.

Lazy training (:mod:`scaleout.families.bert.data.shard_source`) needs, per shard, how many packs it
makes and which rows go together; it never needs every sequence of every shard in memory. Per shard
``f`` this module stores::

    <index>/<f>.<key>.len.npy                 real tokens per row (int32)
    <index>/<f>.<key>.seq.npy                 packed layout only: sequences per row (int8)
    <index>/<f>.<key>.<settings>.packs.npz    rows of each pack: ids (int32) + offsets (int64)
    <index>/<f>.<key>.<settings>.meta.json    packs, sequences, tokens, deepest pack
    <index>/summary-<hash>.npz                the meta of every shard in one file (one read per
    rank)

``<index>`` is ``DIR/.scaleout-index`` beside the shards, or ``~/.cache/scaleout/shard-index/<hash
of DIR>`` when DIR is read-only. ``<key>`` hashes the file's name, size and mtime, so a replaced
shard is re-indexed; ``<settings>`` hashes max_len, packing algorithm, sequences per pack, seed and
the rows skipped at the start of the shard. Packing uses each shard's own length histogram (the
configured algorithm on it, then :func:`~scaleout.families.bert.packing.assign.assign_sequences`
with a seed derived from the shard's name), so a rank that opens a shard can rebuild its packs alone
and gets the same ones as every other rank.

:func:`ensure_index` builds in parallel: rank r indexes the shards j with ``j % world == r`` that
are not cached, all ranks meet at a barrier, rank 0 gathers the small meta files into the summary,
barrier, and every rank reads the summary. A shard missing from a rank's view of the cache
(node-local copies of the data) is rebuilt by that rank when it first needs it.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scaleout.data.corpus import cache_dir
from scaleout.errors import ConfigError, UserError
from scaleout.families.bert.data.shard_format import ShardReader
from scaleout.families.bert.packing.assign import assign_sequences
from scaleout.families.bert.packing.hist import histogram_from_lengths
from scaleout.families.bert.packing.pack import pack_histogram
from scaleout.fsutil import atomic_write_path

INDEX_VERSION = 1


@dataclass(frozen=True)
class PackSettings:
    max_len: int
    # "none" (one sequence per row) or a scaleout.families.bert.packing algorithm / "auto"
    algorithm: str
    max_per_pack: int
    seed: int = 0

    def key(self, skip: int = 0) -> str:
        parts = (self.max_len, self.algorithm, self.max_per_pack, self.seed, skip, INDEX_VERSION)
        text = ":".join(str(p) for p in parts)
        return hashlib.sha256(text.encode()).hexdigest()[:10]


@dataclass
class ShardPacks:
    """One shard's packs: pack i holds rows ``ids[offsets[i]:offsets[i + 1]]``."""

    ids: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray  # sequences per pack
    tokens: np.ndarray  # real tokens per pack

    def __len__(self) -> int:
        return len(self.offsets) - 1


def index_dir(data_dir: Path) -> Path:
    """Where the index of ``data_dir`` lives (beside the data when writable)."""
    beside = data_dir / ".scaleout-index"
    if beside.is_dir() and os.access(beside, os.W_OK) or os.access(data_dir, os.W_OK):
        return beside

    return (
        Path(cache_dir())
        / "shard-index"
        / hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:16]
    )


def shard_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(
        f"{path.name}:{st.st_size}:{st.st_mtime_ns}:{INDEX_VERSION}".encode()
    ).hexdigest()[:10]


def _atomic(path: Path, write: Callable[[Path], None]) -> None:
    atomic_write_path(path, write, keep_suffix=True)  # numpy's writers append a missing suffix


class ShardIndex:
    """The cached index of one shard file under ``settings`` (rows from ``skip`` on are training
    rows)."""

    def __init__(
        self,
        path: Path,
        idx: Path,
        settings: PackSettings,
        skip: int = 0,
        key: str | None = None,
    ):
        """``key``: the file's :func:`shard_key` when the caller has it (rank 0 stats every shard
        once and the other ranks get the keys from it), else one ``stat`` here."""
        self.path, self.idx, self.settings, self.skip = path, idx, settings, skip
        self.base = idx / f"{path.name}.{key or shard_key(path)}"
        self.meta_path = Path(f"{self.base}.{settings.key(skip)}.meta.json")
        self.packs_path = Path(f"{self.base}.{settings.key(skip)}.packs.npz")
        self.error_path = Path(f"{self.base}.{settings.key(skip)}.error.txt")

    def lengths(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(real tokens per row, sequences per row for packed shards else None), from the cache
        or the file."""
        tok, seq = Path(f"{self.base}.len.npy"), Path(f"{self.base}.seq.npy")
        if tok.is_file():
            return np.load(tok), (np.load(seq) if seq.is_file() else None)

        reader = ShardReader(self.path)
        try:
            tokens, per_seq = reader.row_lengths()
        finally:
            reader.close()
        nseq = None if per_seq is None else np.array([len(x) for x in per_seq], np.int8)
        if nseq is not None:
            _atomic(seq, lambda p: np.save(p, nseq))
        _atomic(tok, lambda p: np.save(p, tokens.astype(np.int32)))
        return tokens.astype(np.int32), nseq

    def meta_or_error(self) -> None:
        """Index the shard; a data error (too long a row, missing fields) is recorded beside the
        index instead of raised, so the rank still meets the others at the barrier (see
        :func:`ensure_index`)."""
        try:
            self.meta()
        except UserError as exc:
            message = str(exc)
            _atomic(self.error_path, lambda p: p.write_text(message))

    def meta(self) -> dict[str, int]:
        if self.meta_path.is_file():
            try:
                return json.loads(self.meta_path.read_text())
            except (OSError, ValueError):
                pass
        return self._build()[1]

    def packs(self) -> ShardPacks:
        if self.packs_path.is_file():
            try:
                with np.load(self.packs_path) as z:
                    ids, offsets = z["ids"], z["offsets"]
                tokens, nseq = self.lengths()
                return _with_counts(ids, offsets, tokens, nseq)
            except (OSError, ValueError, KeyError):
                pass
        return self._build()[0]

    def _build(self) -> tuple[ShardPacks, dict[str, int]]:
        s = self.settings
        tokens, nseq = self.lengths()
        rows = np.arange(self.skip, len(tokens), dtype=np.int64)
        too_long = tokens[rows].max(initial=0)
        if too_long > s.max_len:
            raise ConfigError(
                f"data.max_seq_len={s.max_len} but {self.path.name} has rows of {int(too_long)} "
                "tokens"
            )
        if nseq is not None or s.algorithm == "none":  # pre-packed rows, or one sequence per row
            ids, offsets = rows, np.arange(len(rows) + 1, dtype=np.int64)
        else:
            lens = tokens[rows]
            strategy = pack_histogram(
                histogram_from_lengths(lens, s.max_len), s.max_len, s.max_per_pack, s.algorithm
            )
            seed = [
                s.seed,
                zlib.crc32(self.path.name.encode()),
            ]  # the same packs on every rank, any shard order
            packed = assign_sequences(
                strategy, lens, seed=np.random.SeedSequence(seed).generate_state(1)[0], ids=rows
            )
            ids, offsets = packed.ids, packed.offsets
        packs = _with_counts(ids, offsets, tokens, nseq)
        meta = {
            "rows": len(tokens),
            "packs": len(packs),
            "sequences": int(packs.sizes.sum()),
            "tokens": int(packs.tokens.sum()),
            "depth": int(packs.sizes.max(initial=1)),
        }
        _atomic(
            self.packs_path,
            lambda p: np.savez(p, ids=ids.astype(np.int32), offsets=offsets.astype(np.int64)),
        )
        _atomic(self.meta_path, lambda p: p.write_text(json.dumps(meta)))
        return packs, meta


def _with_counts(
    ids: np.ndarray, offsets: np.ndarray, tokens: np.ndarray, nseq: np.ndarray | None
) -> ShardPacks:
    ids, offsets = ids.astype(np.int64), offsets.astype(np.int64)
    per_row = np.ones(len(tokens), np.int64) if nseq is None else nseq.astype(np.int64)
    csum_tok = np.concatenate([[0], np.cumsum(tokens[ids].astype(np.int64))])
    csum_seq = np.concatenate([[0], np.cumsum(per_row[ids])])
    return ShardPacks(ids, offsets, np.diff(csum_seq[offsets]), np.diff(csum_tok[offsets]))


@dataclass
class Summary:
    """Per shard (in file order): packs, sequences, tokens, deepest pack."""

    packs: np.ndarray
    sequences: np.ndarray
    tokens: np.ndarray
    depth: np.ndarray


def ensure_index(
    files: list[Path],
    skips: list[int],
    settings: PackSettings,
    rank: int = 0,
    world: int = 1,
    barrier: Callable[[], None] = lambda: None,
    keys: list[str] | None = None,
    build: bool = True,
) -> tuple[Summary, Path] | None:
    """Index every shard (in parallel over ranks), return the summary and the index directory.

    A collective when ``world > 1`` and the summary is not cached yet: every rank must call it (it
    meets the others at ``barrier``). ``keys``: the shards' :func:`shard_key` (no ``stat`` here);
    ``build=False``: None instead of building when the summary is not cached (rank 0 checks
    alone whether the other ranks need to join a build)."""
    idx = index_dir(files[0].parent)
    keys = keys if keys is not None else [None] * len(files)
    shards = [
        ShardIndex(f, idx, settings, k, key) for f, k, key in zip(files, skips, keys, strict=True)
    ]
    digest = hashlib.sha256("|".join(s.meta_path.name for s in shards).encode()).hexdigest()[:16]
    summary_path = idx / f"summary-{digest}.npz"
    if not build and not summary_path.is_file():
        return None
    if not summary_path.is_file():
        for s in shards[rank::world]:
            s.meta_or_error()
        barrier()
        _raise_recorded(shards)  # a bad shard found by any rank stops every rank with the same line
        if rank == 0 and not summary_path.is_file():
            _write_summary(summary_path, shards)
        barrier()
    # rank 0 wrote it where this rank cannot see it (node-local data)
    if not summary_path.is_file():
        _write_summary(summary_path, shards)
    with np.load(summary_path) as z:
        return Summary(z["packs"], z["sequences"], z["tokens"], z["depth"]), idx


def _write_summary(path: Path, shards: list[ShardIndex]) -> None:
    metas = [s.meta() for s in shards]
    arrays = {
        k: np.array([m[k] for m in metas], np.int64)
        for k in ("packs", "sequences", "tokens", "depth")
    }
    _atomic(path, lambda p: np.savez(p, **arrays))


def _raise_recorded(shards: list[ShardIndex]) -> None:
    """Raise the first data error any rank recorded for these shards (same file and version only: a
    replaced shard has another key and is indexed again)."""
    for s in shards:
        if s.error_path.is_file():
            raise ConfigError(s.error_path.read_text().strip())
