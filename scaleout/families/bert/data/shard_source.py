"""MLPerf BERT training from shards read lazily: each rank opens only the shards and rows its steps
need.

The global stream (the same on every rank, no communication): epoch ``e`` visits the training shards
in a permutation seeded by ``(seed, e)``; inside shard ``j`` its packs
(:mod:`scaleout.families.bert.data.shard_index`) come in a permutation seeded by ``(seed, e, j)``.
Data position ``p`` (packed rows consumed, what checkpoints store) is a place in that stream; the
step at ``p`` is positions ``[p, p + B)`` and rank ``r`` takes the slice ``[p + r*B/W, p +
(r+1)*B/W)``, as :class:`~scaleout.data.sampler.ShardedSampler` does for in-memory data.

Positions are not read in shard order: an epoch's packs (``T`` of them, in that shard order) are
cut into ``K`` *lanes*, contiguous runs of about ``T/K`` packs, and every step takes the next
``B/K`` packs of each lane (:meth:`ShardStream.lane_rows`, a fixed permutation of the epoch; the
lanes follow the epoch's phase within a step). ``K`` (:func:`lane_count`) is the largest divisor
of ``W`` that keeps a lane longer than the largest shard plus one step's chunk of it. Read straight
through, all ``W`` ranks would read the same one or two files at every step (a shard holds a few
global steps), and every few steps all of them would open the next file at once; in lanes, rank
``r`` reads lane ``r*K/W`` only, and a file holds one lane's current chunk, so at most ``W/K``
ranks read a file at a step (twice that at the one step per epoch that straddles two epochs,
whose shard orders differ): 1 at 2,048 ranks x 4,320 shards. Every pack is still read once per
epoch, and the order is a pure function of (seed, epoch, shard counts, ``B``, ``W``). A resume
with another world size changes ``K``: that epoch's remaining positions then follow the new
lanes (some packs of that one epoch may be read twice or not at all).

A rank holds the per-shard pack counts (one integer per shard), the packs of the few shards its
current steps fall in, and a few open files -- never the data set: host memory per rank does not
grow with the number of shards (``scaleout bench shards`` measures it). The whole global batch's
counts (:meth:`ShardStream.global_counts`) would need the packs of every lane's shard; the run
gets them from one all-reduce of every rank's own counts per step at the start
(:func:`open_shards`). Eval: each rank reads its share (``i % W == r``) of the first
``data.eval_samples`` eval sequences.

Start-up: rank 0 alone lists and stats the shards and checks the index; the other ranks get the
file list, keys and index summary from it in one broadcast (``comm``), so a start costs the file
system O(shards) metadata calls in all, not O(shards x ranks).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from scaleout.errors import ConfigError, UserError
from scaleout.families.bert.data.shard_format import ShardReader, shard_files
from scaleout.families.bert.data.shard_index import (
    PackSettings,
    ShardIndex,
    ShardPacks,
    Summary,
    ensure_index,
    index_dir,
    shard_key,
)

if TYPE_CHECKING:
    from scaleout.config.schema import Config

# Per process (rank or prefetch worker): shards whose packs are kept, files kept open. A step of a
# rank reads at most 2 lanes, each in at most 2 shards.
PACKS_CACHE, OPEN_FILES = 5, 4


def lane_count(world: int, counts: np.ndarray, global_batch: int) -> int:
    """Lanes of an epoch (module docstring): the most that divide the world (each rank's slice of
    a step then lies in one lane: ``W/K`` ranks per lane) while a lane stays longer than the
    largest shard plus one step's chunk of it (a file then holds at most one lane's current
    chunk). At 2,048 ranks and 4,320 balanced shards: 2,048, one rank per file."""
    total, biggest = int(np.sum(counts)), int(np.max(counts))
    for k in range(min(world, len(counts)), 1, -1):
        if world % k == 0 and total // k - 1 >= biggest + global_batch // k:
            return k
    return 1


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
        keys: list[str] | None = None,
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
        self.keys = list(keys) if keys is not None else None
        self.total = int(self.counts.sum())
        if self.total < 1:
            raise ConfigError("the training shards hold no sequences")
        self.lanes = lane_count(world, self.counts, global_batch)
        self._init_caches()

    def _init_caches(self) -> None:
        self._packs: OrderedDict[int, ShardPacks] = OrderedDict()
        self._readers: OrderedDict[int, ShardReader] = OrderedDict()
        self._epoch_cache: tuple[int, np.ndarray, np.ndarray] | None = None
        self._perm_cache: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._lane_cache: tuple[Any, ...] | None = None

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

    def _lane_layout(self, e: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Epoch ``e`` starts ``phase`` positions into a step. Step positions ``cs[k] .. cs[k+1]``
        belong to lane k (``B/K`` each); lane k's packs are the next of its run ``[a[k], a[k+1])``
        of the epoch's shard order, so the lanes end with the epoch whatever its phase."""
        if self._lane_cache is None or self._lane_cache[0] != e:
            b, k = self.global_batch, self.lanes
            cs = np.arange(k + 1, dtype=np.int64) * b // k
            phase = e * self.total % b
            taken = self._lane_taken(cs, np.full(k, phase + self.total)) - self._lane_taken(
                cs, np.full(k, phase)
            )
            self._lane_cache = (e, cs, np.concatenate([[0], np.cumsum(taken)]), phase)
        return self._lane_cache[1], self._lane_cache[2], self._lane_cache[3]

    def _lane_taken(self, cs: np.ndarray, g: np.ndarray, k: np.ndarray | None = None) -> np.ndarray:
        """Packs lane ``k`` (every lane when None) has taken before step position ``g``."""
        k = np.arange(len(cs) - 1) if k is None else k
        q, rem = np.divmod(g, self.global_batch)
        return q * (cs[k + 1] - cs[k]) + np.clip(rem - cs[k], 0, cs[k + 1] - cs[k])

    def lane_rows(self, e: int, off: np.ndarray) -> np.ndarray:
        """Offsets in epoch ``e`` -> places in its shard order (a permutation of ``[0, T)``)."""
        cs, a, phase = self._lane_layout(e)
        g = np.asarray(off, np.int64) + phase
        k = np.searchsorted(cs, g % self.global_batch, side="right") - 1
        return a[k] + self._lane_taken(cs, g, k) - self._lane_taken(cs, np.full(len(g), phase), k)

    def segments(self, start: int, count: int) -> list[tuple[int, np.ndarray]]:
        """Positions ``[start, start + count)`` of the stream as (shard, pack numbers in that
        shard) runs, in position order."""
        epoch, off = np.divmod(np.arange(start, start + count, dtype=np.int64), self.total)
        out = []
        for e in dict.fromkeys(epoch.tolist()):
            mine = self.lane_rows(e, off[epoch == e])
            order, starts = self._epoch(e)
            k = np.searchsorted(starts, mine, side="right") - 1
            shard, within = order[k], mine - starts[k]
            cut = [0, *(np.flatnonzero(np.diff(shard)) + 1).tolist(), len(shard)]
            for a, b in zip(cut[:-1], cut[1:], strict=True):
                j = int(shard[a])
                out.append((j, self._perm(e, j)[within[a:b]]))
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
            key = self.keys[j] if self.keys is not None else None
            self._packs[j] = ShardIndex(
                Path(self.files[j]), Path(self.idx), self.settings, self.skips[j], key
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

    def local_counts(self, steps: int) -> np.ndarray:
        """(sequences, real tokens) of this rank's share of each of steps ``0 .. steps - 1``,
        ``[steps, 2]``: summed over the ranks, the global counts without every lane's packs."""
        out = np.zeros((steps, 2), np.int64)
        for step in range(steps):
            for j, which in self.segments(
                step * self.global_batch + self.rank * self.local, self.local
            ):
                p = self.packs(j)
                out[step] += (int(p.sizes[which].sum()), int(p.tokens[which].sum()))
        return out

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
    # (sequences, real tokens) of the global batch of each step 0 .. train.max_steps - 1, summed
    # over the ranks at the start; None in one process (the stream's global_counts is cheap there)
    step_counts: np.ndarray | None = None

    @property
    def sequences_per_row(self) -> float:
        return float(self.info["packing"]["sequences_per_row"])


class Collectives(Protocol):
    """What :func:`open_shards` needs from the process group (BertTask passes torch.distributed's):
    ``broadcast`` rank 0's picklable object to every rank, ``sum`` an int64 array over ranks."""

    def broadcast(self, obj: Any) -> Any: ...

    def sum(self, array: np.ndarray) -> np.ndarray: ...


@dataclass
class _Plan:
    """What a start needs from the file system: the shard lists and keys (rank 0 lists and stats),
    then the index (summary, eval rows, training rows held out for eval). Picklable: rank 0
    broadcasts it."""

    split: bool
    train: list[Path]
    eval: list[Path]
    train_keys: list[str]
    eval_keys: list[str]
    idx: Path | None = None
    summary: Summary | None = None
    ev_rows: list[np.ndarray] | None = None
    count: int = 0
    skips: list[int] | None = None


def _settings(cfg: Config) -> tuple[PackSettings, PackSettings]:
    d = cfg.data
    plain = PackSettings(d.max_seq_len, "none", 1, d.seed)
    packed = PackSettings(
        d.max_seq_len, d.packing, d.max_per_pack if d.packing != "none" else 1, d.seed
    )
    return plain, packed


def _list(cfg: Config) -> _Plan:
    """List and stat the shards (``data.path``: ``train/`` + ``eval/``, or one folder)."""
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
    train_keys = [shard_key(f) for f in train_files]
    eval_keys = [shard_key(f) for f in eval_files] if split else train_keys
    return _Plan(split, train_files, eval_files, train_keys, eval_keys)


def _index(
    cfg: Config,
    plan: _Plan,
    rank: int,
    world: int,
    barrier: Callable[[], None],
    build: bool = True,
) -> _Plan | None:
    """Index the listed shards (a collective when something is to build); ``build=False``: None
    when a build is needed."""
    d = cfg.data
    plain, settings = _settings(cfg)
    if plan.split:  # MLPerf: a separate eval file (10,000 sequences); indexed once, then cached
        got = ensure_index(
            plan.eval, [0] * len(plan.eval), plain, rank, world, barrier, plan.eval_keys, build
        )
        if got is None:
            return None
        ev_idx = got[1]
    else:
        ev_idx = index_dir(plan.train[0].parent)
    ev_rows: list[np.ndarray] = []
    for f, key in zip(plan.eval, plan.eval_keys, strict=True):  # until the eval count is covered
        tokens, nseq = ShardIndex(f, ev_idx, plain, key=key).lengths()
        ev_rows.append(np.ones(len(tokens), np.int64) if nseq is None else nseq.astype(np.int64))
        if not plan.split and sum(int(n.sum()) for n in ev_rows) >= d.eval_samples:
            break
    for f in plan.eval[: len(ev_rows)]:  # a file that is not a shard fails now (field names)
        ShardReader(f).close()
    count = min(d.eval_samples, int(sum(int(n.sum()) for n in ev_rows)))
    skips = [0] * len(plan.train)
    if not plan.split:  # the held-out sequences are the first rows of the first files
        left = count
        for i, n in enumerate(ev_rows):
            skips[i] = (
                min(int(np.searchsorted(np.cumsum(n), left, side="left")) + 1, len(n))
                if left > 0
                else 0
            )
            left -= int(n[: skips[i]].sum())
    got = ensure_index(plan.train, skips, settings, rank, world, barrier, plan.train_keys, build)
    if got is None:
        return None
    summary, idx = got
    return replace(plan, idx=idx, summary=summary, ev_rows=ev_rows, count=count, skips=skips)


def open_shards(
    cfg: Config,
    rank: int = 0,
    world: int = 1,
    barrier: Callable[[], None] = lambda: None,
    comm: Collectives | None = None,
) -> ShardData:
    """``data.source: wikipedia``: index ``data.path`` (``train/`` + ``eval/``, or one folder
    whose first ``data.eval_samples`` sequences are held out) and return this rank's lazy
    training stream and eval share. A collective: every rank calls it.

    With ``comm`` (a real process group), rank 0 alone lists and stats the shards and checks the
    index; the others get its plan in one broadcast and touch no file unless the index is to be
    built (then every rank indexes its share, as before), and the global batch's counts of every
    step come from one all-reduce. Without it (one process, or ranks simulated in one), every rank
    lists and stats for itself."""
    d = cfg.data
    if comm is None or world == 1:
        plan = _index(cfg, _list(cfg), rank, world, barrier)
    else:
        found: Any = None
        if rank == 0:
            try:
                listing = _list(cfg)
                found = (listing, _index(cfg, listing, 0, world, barrier, build=False))
            except UserError as exc:  # every rank stops with the same line
                found = exc
        found = comm.broadcast(found)
        if isinstance(found, UserError):
            raise found
        listing, plan = found
        if plan is None:  # the index is to be built: every rank indexes its share
            plan = _index(cfg, listing, rank, world, barrier)
    assert plan is not None and plan.summary is not None and plan.ev_rows is not None
    summary, settings = plan.summary, _settings(cfg)[1]
    depth = int(max(summary.depth.max(initial=1), settings.max_per_pack))
    stream = ShardStream(
        plan.train,
        plan.skips or [],
        summary.packs,
        settings,
        plan.idx,
        cfg.train.global_batch,
        rank,
        world,
        d.max_predictions * depth,
        depth,
        keys=plan.train_keys,
    )
    step_counts = None
    if comm is not None and world > 1:
        step_counts = comm.sum(stream.local_counts(cfg.train.max_steps))
    seqs, tokens, packs = int(summary.sequences.sum()), int(summary.tokens.sum()), stream.total
    info = {
        "shards": len(plan.train),
        "eval_files": len(plan.eval),
        "index": str(plan.idx),
        "train_sequences": seqs,
        "eval_samples": plan.count,
        "packing": {
            "algorithm": d.packing,
            "per": "shard",
            "packs": packs,
            "efficiency": tokens / max(packs * d.max_seq_len, 1),
            "sequences_per_row": seqs / max(packs, 1),
        },
    }
    ev = EvalShards(plan.eval[: len(plan.ev_rows)], plan.ev_rows, plan.count, rank, world)
    return ShardData(stream, ev, depth, info, step_counts)


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
