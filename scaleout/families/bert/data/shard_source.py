"""MLPerf BERT training from shards read lazily: each rank opens only the shards and rows its steps
need.

The global stream (the same on every rank, no communication): epoch ``e`` visits the training shards
in a permutation seeded by ``(seed, e)``; inside shard ``j`` its packs
(:mod:`scaleout.families.bert.data.shard_index`) come in a permutation seeded by ``(seed, e, j)``.
Data position ``p`` (packed rows consumed, what checkpoints store) is a place in that stream; the
step at ``p`` is rows ``[p, p + B)`` and rank ``r`` takes the contiguous slice ``[p + r*B/W, p +
(r+1)*B/W)``, as :class:`~scaleout.data.sampler.ShardedSampler` does for in-memory data. A rank
holds the per-shard pack counts (one integer per shard), the packs of the one or two shards its
current steps fall in, and a couple of open files -- never the data set: host memory per rank does
not grow with the number of shards (``scaleout bench shards`` measures it). Eval: each rank reads
its share (``i % W == r``) of the first ``data.eval_samples`` eval sequences.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from scaleout.errors import ConfigError
from scaleout.families.bert.data.shard_format import ShardReader, shard_files
from scaleout.families.bert.data.shard_index import (
    PackSettings,
    ShardIndex,
    ShardPacks,
    ensure_index,
    index_dir,
)

if TYPE_CHECKING:
    from scaleout.config.schema import Config

# Per process (rank or prefetch worker): shards whose packs are kept, files kept open.
PACKS_CACHE, OPEN_FILES = 3, 2


class ShardStream:
    """This rank's view of the global packed-row stream over the training shards (picklable:
    paths and per-shard counts; caches and open files are per process)."""

    def __init__(
        self,
        files: list[Path],
        skips: list[int],
        counts: np.ndarray,
        settings: PackSettings,
        idx: Path,
        global_batch: int,
        rank: int,
        world: int,
        max_pred: int,
        depth: int,
        shuffle: bool = True,
    ):
        if global_batch % world:
            raise ConfigError(
                f"train.global_batch={global_batch} must be divisible by the world size {world}"
            )
        self.files, self.skips, self.counts = (
            [str(f) for f in files],
            list(skips),
            np.asarray(counts, np.int64),
        )
        self.settings, self.idx, self.global_batch = settings, str(idx), global_batch
        self.rank, self.world, self.local = rank, world, global_batch // world
        self.max_pred, self.depth, self.shuffle = max_pred, depth, shuffle
        self.total = int(self.counts.sum())
        if self.total < 1:
            raise ConfigError("the training shards hold no sequences")
        self._init_caches()

    def _init_caches(self) -> None:
        self._packs: OrderedDict[int, ShardPacks] = OrderedDict()
        self._readers: OrderedDict[int, ShardReader] = OrderedDict()
        self._epoch_cache: tuple[int, np.ndarray, np.ndarray] | None = None
        self._perm_cache: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_caches()

    # -- the global order
    # ------------------------------------------------------------------------------
    def _epoch(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        if self._epoch_cache is None or self._epoch_cache[0] != e:
            s = self.settings.seed
            order = (
                np.random.default_rng([s, e]).permutation(len(self.counts))
                if self.shuffle
                else np.arange(len(self.counts))
            )
            self._epoch_cache = (e, order, np.concatenate([[0], np.cumsum(self.counts[order])]))
        return self._epoch_cache[1], self._epoch_cache[2]

    def segments(self, start: int, count: int) -> list[tuple[int, np.ndarray]]:
        """Rows ``[start, start + count)`` of the stream as (shard, pack numbers in that shard)
        runs."""
        out, pos, end = [], start, start + count
        while pos < end:
            e, off = divmod(pos, self.total)
            order, starts = self._epoch(e)
            k = int(np.searchsorted(starts, off, side="right")) - 1
            j, within = int(order[k]), off - int(starts[k])
            take = min(int(self.counts[j]) - within, end - pos)
            out.append((j, self._perm(e, j)[within : within + take]))
            pos += take
        return out

    def _perm(self, e: int, j: int) -> np.ndarray:
        key = (e, j)
        if key not in self._perm_cache:
            n = int(self.counts[j])
            self._perm_cache[key] = (
                np.random.default_rng([self.settings.seed, e, j]).permutation(n)
                if self.shuffle
                else np.arange(n)
            )
            while len(self._perm_cache) > PACKS_CACHE:
                self._perm_cache.popitem(last=False)
        return self._perm_cache[key]

    def packs(self, j: int) -> ShardPacks:
        if j not in self._packs:
            self._packs[j] = ShardIndex(
                Path(self.files[j]), Path(self.idx), self.settings, self.skips[j]
            ).packs()
            if len(self._packs[j]) != self.counts[j]:
                raise ConfigError(
                    f"{self.files[j]}: the index says {self.counts[j]} packs, the file makes "
                    f"{len(self._packs[j])}; remove {self.idx} and restart"
                )
            while len(self._packs) > PACKS_CACHE:
                self._packs.popitem(last=False)
        self._packs.move_to_end(j)
        return self._packs[j]

    def reader(self, j: int) -> ShardReader:
        if j not in self._readers:
            self._readers[j] = ShardReader(self.files[j])
            while len(self._readers) > OPEN_FILES:
                self._readers.popitem(last=False)[1].close()
        self._readers.move_to_end(j)
        return self._readers[j]

    # -- what the trainer asks
    # ---------------------------------------------------------------------------
    def global_counts(self, position: int) -> tuple[int, int]:
        """(sequences, real tokens) in the whole global batch at ``position``; no communication."""
        n = t = 0
        for j, which in self.segments(position, self.global_batch):
            p = self.packs(j)
            n, t = n + int(p.sizes[which].sum()), t + int(p.tokens[which].sum())
        return n, t

    def batches(self, position: int, grad_accum: int) -> list[tuple[dict[str, Any], int, int]]:
        """This rank's micro-batches at ``position``: (batch dict for the model, sequences, real
        tokens)."""
        from scaleout.families.bert.data.bert_batch import build_batch  # deferred: pulls in torch

        runs = [
            (j, int(q))
            for j, which in self.segments(position + self.rank * self.local, self.local)
            for q in which
        ]
        out = []
        for part in np.array_split(np.arange(len(runs)), grad_accum):
            seqs, packs, tokens = [], [], 0
            by_shard: dict[int, list[int]] = {}
            for i in part:
                by_shard.setdefault(runs[i][0], []).append(i)
            rows_of = {}
            for j, items in by_shard.items():
                p = self.packs(j)
                pack_rows = [
                    p.ids[p.offsets[runs[i][1]] : p.offsets[runs[i][1] + 1]] for i in items
                ]
                got = self.reader(j).read(np.concatenate(pack_rows))
                at = 0
                for i, rows in zip(items, pack_rows, strict=True):
                    rows_of[i] = [s for r in got[at : at + len(rows)] for s in r]
                    at += len(rows)
                    tokens += int(p.tokens[runs[i][1]])
            for i in part:
                packs.append(list(range(len(seqs), len(seqs) + len(rows_of[i]))))
                seqs.extend(rows_of[i])
            batch = build_batch(seqs, packs, self.settings.max_len, self.max_pred, self.depth)
            out.append((batch, len(seqs), tokens))
        return out


class EvalShards:
    """This rank's share of the first ``count`` eval sequences: ``len()`` is the global count,
    indexing with a global index ``i`` (``i % world == rank``) gives the sequence (what
    BertTask.evaluate asks).

    The sequences are read on first use (the first evaluation), not when the data is opened: that
    happens before MLPerf's run_start, and the clock must start before any part of the system
    touches the dataset (MLPerf Training rules, "Run Results"; NVIDIA's BERT starts reading its
    eval set after RUN_START too). The count comes from the index (sequences per row: metadata,
    "Other Uses of Data")."""

    def __init__(
        self, files: list[Path], rows_per_file: list[np.ndarray], count: int, rank: int, world: int
    ):
        self.count, self.rank, self.world = count, rank, world
        self.files, self.rows_per_file = files, rows_per_file
        self._seqs: dict[int, Any] | None = None
        for f in (
            files
        ):  # a file that is not a shard fails now, on every rank (its field names: metadata)
            ShardReader(f).close()

    def _read(self) -> dict[int, Any]:
        seq_per_row = [
            np.ones(len(n), np.int64) if n is None else n.astype(np.int64)
            for n in self.rows_per_file
        ]
        first = np.cumsum([0] + [int(s.sum()) for s in seq_per_row])
        mine = np.arange(self.rank, self.count, self.world)
        seqs: dict[int, Any] = {}
        for f, n, start in zip(self.files, seq_per_row, first[:-1], strict=True):
            want = mine[(mine >= start) & (mine < start + n.sum())] - start
            if not len(want):
                continue
            row_start = np.concatenate([[0], np.cumsum(n)])
            rows = np.searchsorted(row_start, want, side="right") - 1
            reader = ShardReader(f)
            try:
                got = reader.read(np.unique(rows))
            finally:
                reader.close()
            by_row = dict(zip(np.unique(rows).tolist(), got, strict=True))
            for w, r in zip(want.tolist(), rows.tolist(), strict=True):
                seqs[int(w + start)] = by_row[r][w - int(row_start[r])]
        return seqs

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> Any:
        if self._seqs is None:
            self._seqs = self._read()
        return self._seqs[i]


@dataclass
class ShardData:
    stream: ShardStream
    eval: EvalShards
    depth: int
    info: dict[str, Any]

    @property
    def sequences_per_row(self) -> float:
        return float(self.info["packing"]["sequences_per_row"])


def open_shards(
    cfg: Config, rank: int = 0, world: int = 1, barrier: Any = lambda: None
) -> ShardData:
    """``data.source: wikipedia``: index ``data.path`` (``train/`` + ``eval/``, or one folder
    whose first ``data.eval_samples`` sequences are held out) and return this rank's lazy
    training stream and eval share. A collective: every rank calls it."""
    d = cfg.data
    if not d.path:
        raise ConfigError(
            "data.source=wikipedia needs data.path (a directory of MLPerf BERT shards)"
        )
    root = Path(d.path)
    split = (root / "train").is_dir() and (root / "eval").is_dir()
    train_files = shard_files(root / "train" if split else root)
    eval_files = shard_files(root / "eval") if split else train_files
    _check_mask_slots(train_files[0], d.max_predictions)
    plain = PackSettings(d.max_seq_len, "none", 1, d.seed)
    if (
        split
    ):  # MLPerf: a separate eval file (10,000 sequences); index it once, all ranks read the cache
        _, ev_idx = ensure_index(eval_files, [0] * len(eval_files), plain, rank, world, barrier)
    else:
        ev_idx = index_dir(root)
    ev_rows: list[np.ndarray] = []
    for f in eval_files:  # sequences per row, file by file until the eval count is covered
        tokens, nseq = ShardIndex(f, ev_idx, plain).lengths()
        ev_rows.append(np.ones(len(tokens), np.int64) if nseq is None else nseq.astype(np.int64))
        if not split and sum(int(n.sum()) for n in ev_rows) >= d.eval_samples:
            break
    available = int(sum(int(n.sum()) for n in ev_rows))
    count = min(d.eval_samples, available)
    skips = [0] * len(train_files)
    if not split:  # the held-out sequences are the first rows of the first files
        left = count
        for i, n in enumerate(ev_rows):
            skips[i] = (
                min(int(np.searchsorted(np.cumsum(n), left, side="left")) + 1, len(n))
                if left > 0
                else 0
            )
            left -= int(n[: skips[i]].sum())
    settings = PackSettings(
        d.max_seq_len, d.packing, d.max_per_pack if d.packing != "none" else 1, d.seed
    )
    summary, idx = ensure_index(train_files, skips, settings, rank, world, barrier)
    depth = int(max(summary.depth.max(initial=1), settings.max_per_pack))
    stream = ShardStream(
        train_files,
        skips,
        summary.packs,
        settings,
        idx,
        cfg.train.global_batch,
        rank,
        world,
        d.max_predictions * depth,
        depth,
    )
    seqs, tokens, packs = int(summary.sequences.sum()), int(summary.tokens.sum()), stream.total
    info = {
        "shards": len(train_files),
        "eval_files": len(eval_files),
        "index": str(idx),
        "train_sequences": seqs,
        "eval_samples": count,
        "packing": {
            "algorithm": d.packing,
            "per": "shard",
            "packs": packs,
            "efficiency": tokens / max(packs * d.max_seq_len, 1),
            "sequences_per_row": seqs / max(packs, 1),
        },
    }
    return ShardData(
        stream, EvalShards(eval_files[: len(ev_rows)], ev_rows, count, rank, world), depth, info
    )


def _check_mask_slots(path: Path, max_predictions: int) -> None:
    """A fixed-layout shard declares its mask slots per sequence; more than data.max_predictions
    would fail in the middle of training (vlen layouts are checked row by row by the batch
    builder)."""
    reader = ShardReader(path)
    try:
        slots = reader.mask_slots()
    finally:
        reader.close()
    if slots is not None and slots > max_predictions:
        raise ConfigError(
            f"data.max_predictions={max_predictions} but {path.name} has {slots} mask slots per "
            f"sequence (MLPerf BERT at 512 tokens: 76)"
        )
