"""Atomic, checksummed checkpoints; rank 0 chooses the one to resume and every rank follows.

File layout (one replicated file per checkpoint, ``ckpt-<step:08d>.pt``)::

b"SCALEOUTCKPT1\\n" | sha256(payload) (32 bytes) | payload length (8 bytes, little endian) | payload

where the payload is ``torch.save(state)``. A save streams ``torch.save`` into
``<name>.<pid>-<random>.tmp`` through a hashing writer (no in-memory copy of the payload: the save's
extra memory is torch's record buffers), writes the header's digest and length last, fsyncs the
file, renames it over the final name and fsyncs the directory, so a crash leaves either the old set
or the new set of files, never a half-written checkpoint under a real name. A read verifies magic,
length and digest block by block before ``torch.load`` reads the tensors from the file; a truncated
or corrupted latest checkpoint is reported and the previous one is used.

Everything stored is a tensor or a plain Python value, so ``torch.load(weights_only=True)`` works.
Data-parallel ranks hold identical weights, so rank 0 writes. No per-rank state is stored: a
step's random streams follow from (seed, step, rank) (:mod:`scaleout.train.rng`), so a save moves
no object between ranks.

Sharded optimizer state (``optim.sharded``) is not gathered: every rank writes its own part with
``torch.distributed.checkpoint`` into ``ckpt-<step>.shards-<token>/``
(:mod:`scaleout.checkpoint_dcp`), and only then does rank 0 write the replicated file, which names
that directory and the digests of its files: the replicated file is the commit marker, so a
checkpoint is complete exactly when it exists.

Resume (:meth:`Checkpointer.restore`, a collective): rank 0 alone lists the directory and picks the
newest checkpoint that verifies (checksum; for a sharded one also its ``.metadata`` digest and every
shard file's size), broadcasts its choice and the replicated state (tensors by ``dist.broadcast``),
and every rank reads its own shard of the optimizer state. A rank that cannot read what rank 0 chose
stops the run with a one-line error naming it, on every rank, rather than fall back on its own.

Asynchronous saves (``checkpoint.async``, the default): at the step boundary the trainer's thread
copies the replicated state into host memory (pinned when the state is on a GPU; the buffers of the
previous save are reused) and returns; a background thread then writes, fsyncs, hashes, commits
(rename) and prunes, as above. No collective spans that write, so a save slower than
``train.step_timeout_s`` no longer times out the peers waiting at the next collective. The sharded
state goes through ``torch.distributed.checkpoint.async_save`` (DCP stages a copy, its thread writes
and coordinates on a gloo group of its own, never the training's); rank 0's background thread waits
for it, gathers every rank's file digests on that group and only then commits the replicated file.
At most one save is in flight: the next save, the end of the run and a preemption first wait for
the previous one (:meth:`Checkpointer.wait`), and a write that failed is raised there. Memory: the
live state, one snapshot of it (1x) and the streaming write's buffers (<= 0.5x, measured), so at
most 2.5x the replicated state on rank 0 during a save, 1x of it between saves (the snapshot
buffers are kept for reuse).

Small agreements (the chosen name, the shard directory's token, the state's structure) go through
the rendezvous store (:mod:`scaleout.store_share`): one value rank 0 sets, one ``get`` per rank,
so a start costs every rank O(1) sockets and bytes at any world size. DCP's plans and the shard
digests, which need a process group, run on :attr:`World.cpu_group` (gloo, connected lazily when
the default group is NCCL): never a pickled object through the GPU, never an eager world mesh.
"""

from __future__ import annotations

import hashlib
import io
import logging
import math
import os
import re
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, BinaryIO

import torch
import torch.distributed as dist

from scaleout.diskfull import DiskFull, disk_full, is_disk_full
from scaleout.errors import ConfigError, UserError
from scaleout.fsutil import atomic_write
from scaleout.store_share import broadcast_object
from scaleout.world import lazy_gloo_group

if TYPE_CHECKING:
    from scaleout.world import World

log = logging.getLogger("scaleout.checkpoint")

MAGIC = b"SCALEOUTCKPT1\n"
_HEADER = len(MAGIC) + 32 + 8
_NAME = re.compile(r"^ckpt-(\d{8,})\.pt$")
_BLOCK = 4 << 20  # bytes hashed per read when a file is verified


class CorruptCheckpoint(UserError):
    """A checkpoint whose header, length or checksum does not match its contents."""


# -- files
# -------------------------------------------------------------------------------------------
class _HashingWriter:
    """The file object ``torch.save`` writes through: each record goes to the file as torch hands
    it over (a memoryview of the tensor's storage), hashed and counted on the way. No copy of the
    state is made: the save's extra memory is torch's per-record buffers, not the payload."""

    def __init__(self, f: BinaryIO):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.sha.update(view)
        self.size += view.nbytes
        return self.f.write(view)

    def flush(self) -> None:
        self.f.flush()


def write_payload(f: BinaryIO, state: dict[str, Any]) -> None:
    """Header and ``torch.save(state)`` into the seekable ``f``, streamed: the header's digest and
    length are written last, over a placeholder."""
    start = f.tell()
    f.write(MAGIC + bytes(40))
    out = _HashingWriter(f)
    torch.save(state, out)
    end = f.tell()
    f.seek(start + len(MAGIC))
    f.write(out.sha.digest() + struct.pack("<Q", out.size))
    f.seek(end)


def encode(state: dict[str, Any]) -> bytes:
    """The bytes of a checkpoint file holding ``state`` (in memory: tests and tools; a save
    streams to its file instead)."""
    buf = io.BytesIO()
    write_payload(buf, state)
    return buf.getvalue()


def _check_header(head: bytes, size: int, name: str) -> tuple[bytes, int]:
    """(digest, payload length) of a header, for a file of ``size`` bytes in all."""
    if len(head) < _HEADER or not head.startswith(MAGIC):
        raise CorruptCheckpoint(
            f"{name}: not a scaleout checkpoint or truncated header ({size} bytes)"
        )
    (length,) = struct.unpack("<Q", head[len(MAGIC) + 32 : _HEADER])
    if size - _HEADER != length:
        raise CorruptCheckpoint(
            f"{name}: truncated, payload has {size - _HEADER} of {length} bytes"
        )
    return head[len(MAGIC) : len(MAGIC) + 32], length


def decode(blob: bytes, name: str = "checkpoint", map_location: Any = "cpu") -> dict[str, Any]:
    """Verify and unpickle (weights_only=True); raise CorruptCheckpoint naming what is wrong."""
    digest, _ = _check_header(blob[:_HEADER], len(blob), name)
    payload = memoryview(blob)[_HEADER:]
    if hashlib.sha256(payload).digest() != digest:
        raise CorruptCheckpoint(f"{name}: sha256 checksum mismatch (file corrupted)")
    return torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)


def read_checkpoint(path: Path, map_location: Any = "cpu") -> dict[str, Any]:
    """:func:`decode` of a file without holding its bytes: the digest is checked block by block,
    then ``torch.load`` reads the tensors from the file (the loaded state is the only copy)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest, _ = _check_header(f.read(_HEADER), size, str(path))
        sha = hashlib.sha256()
        while block := f.read(_BLOCK):
            sha.update(block)
        if sha.digest() != digest:
            raise CorruptCheckpoint(f"{path}: sha256 checksum mismatch (file corrupted)")
        f.seek(_HEADER)  # torch's reader takes the file's position as the archive's start
        return torch.load(f, map_location=map_location, weights_only=True)


class CheckpointWriteFailed(UserError):
    """A background checkpoint write that failed (raised at the next step boundary that waits)."""


class CheckpointDiskFull(CheckpointWriteFailed, DiskFull):
    """A background checkpoint write that found the disk full."""


# A test-only slow writer: ``SCALEOUT_TEST_SLOW_SAVE_S=N`` makes every write of a replicated
# checkpoint file take N more seconds (tests/train/test_async_save.py, ``scaleout bench save``).
SLOW_SAVE_VARIABLE = "SCALEOUT_TEST_SLOW_SAVE_S"


def _slow_writer_delay() -> float:
    raw = os.environ.get(SLOW_SAVE_VARIABLE, "")
    return float(raw) if raw else 0.0


def snapshot(state: Any, reuse: list[torch.Tensor] | None = None) -> tuple[Any, list[torch.Tensor]]:
    """A copy of ``state`` (nested dicts/lists/tuples of tensors and plain values) in host memory
    that the trainer may change its own state under: every tensor copied into a contiguous host
    tensor (pinned when it lives on a GPU, the copy then asynchronous on the current stream: see
    :func:`_ready`), tensors that share memory (tied weights) copied once. ``reuse``: the previous
    snapshot's buffers, used again where shape and dtype match. Returns (copy, its buffers)."""
    buffers: list[torch.Tensor] = []
    old: Iterator[torch.Tensor] = iter(reuse or [])
    seen: dict[tuple, torch.Tensor] = {}

    def copy(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)
            if t.numel() and key in seen:
                return seen[key]
            buf = next(old, None)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
            buf.copy_(t, non_blocking=t.is_cuda)
            buffers.append(buf)
            seen[key] = buf
            return buf
        if isinstance(obj, dict):
            return type(obj)((k, copy(v)) for k, v in obj.items())
        if isinstance(obj, list | tuple):
            return type(obj)(copy(v) for v in obj)
        return obj

    return copy(state), buffers


def _ready(buffers: list[torch.Tensor]) -> Any:
    """An event the background writer waits on before it reads a snapshot of device tensors
    (pinned buffers, copies enqueued on the current stream); None when all came from the host."""
    if any(b.is_pinned() for b in buffers):
        event = torch.cuda.Event()
        event.record()
        return event
    return None


class Checkpointer:
    """Save/load ``ckpt-<step>.pt`` files (and their shard directories) in ``directory``, keeping
    the newest ``keep``; ``asynchronous``: a save snapshots and returns, a background thread
    writes (module docstring).

    ``state`` is whatever the trainer collects, by convention::

        {"step": int, "model": model.state_dict(), "optimizer": opt.state_dict() (sharded: the
        replicated part),
         "schedule": sched.state_dict(), "data_position": int}
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        keep: int = 2,
        rank: int = 0,
        asynchronous: bool = False,
    ):
        if keep < 1:
            raise UserError(f"checkpoint.keep={keep} must be at least 1")
        self.dir = Path(directory)
        self.keep = keep
        self.rank = rank
        self.asynchronous = asynchronous
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        self._pending_step: int | None = None
        self._buffers: list[torch.Tensor] = []
        self._group: Any = None  # the async sharded saves' own gloo group (multi-rank)
        self._lock = threading.Lock()
        self.write_s: list[float] = []  # seconds each background write took (this rank)

    def path(self, step: int) -> Path:
        return self.dir / f"ckpt-{step:08d}.pt"

    def list(self) -> list[tuple[int, Path]]:
        """(step, path) of every checkpoint file, oldest first."""
        if not self.dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.dir.iterdir() if (m := _NAME.match(p.name))]
        return sorted(found)

    def save(
        self,
        step: int,
        state: dict[str, Any],
        world: World | None = None,
        shards: dict[str, Any] | None = None,
    ) -> Path | None:
        """Rank 0 writes the replicated ``state`` (DP weights are identical); with ``shards`` (a
        collective) every rank first writes its pieces of the sharded optimizer state. Prunes
        beyond ``keep``. Returns the path on rank 0 (asynchronous: the path the background write
        will commit; :meth:`wait` for it)."""
        if self.asynchronous:
            return self._save_async(step, state, world, shards)
        record = None
        if shards is not None:
            name = f"{self.path(step).stem}.shards-{_token(world)}"
            try:  # every rank's files are written when it returns
                record = _shards().save_pieces(shards, self.dir / name, world, _group(world))
            except BaseException as exc:
                if not is_disk_full(exc):
                    raise
                raise self._full(step, self.dir / name, state_bytes(shards)) from None
        if self.rank != 0:
            return None
        return self._commit(step, state, record)

    def _commit(self, step: int, state: dict[str, Any], record: dict[str, Any] | None) -> Path:
        """Rank 0: write the replicated file (the commit) and prune."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.path(step)
        full = {**state, "step": step, **({"shards": record} if record else {})}
        delay = _slow_writer_delay()

        def write(f: BinaryIO) -> None:
            if delay:
                time.sleep(delay)
            write_payload(f, full)

        try:
            atomic_write(path, write)  # the commit, streamed to the file
        except Exception as exc:
            if not is_disk_full(exc):
                raise
            raise self._full(step, path, _HEADER + state_bytes(full)) from None
        for old in self.dir.glob(f"{path.stem}.shards-*"):  # an earlier attempt at this step
            if record is None or old.name != record["dir"]:
                _shards().remove_tree(old)
        # Prune only older steps: a higher step in the directory is not this save's to delete (the
        # rerun policy in train/rerun.py keeps other runs out of a run's directory).
        older = [p for s, p in self.list() if s < step]
        for old in older[: max(len(older) - (self.keep - 1), 0)]:
            self._drop(old)
        return path

    def _save_async(
        self,
        step: int,
        state: dict[str, Any],
        world: World | None,
        shards: dict[str, Any] | None,
    ) -> Path | None:
        error = self.wait()  # at most one save in flight
        if error is not None:
            raise error
        pieces = None
        if shards is not None:
            name = f"{self.path(step).stem}.shards-{_token(world)}"
            if self._group is None and world is not None and world.world_size > 1:
                # collective: every rank, here; lazily connected (no world-wide mesh)
                self._group = lazy_gloo_group(world.timeout_s)
            pieces = _shards().async_save_pieces(shards, self.dir / name, world, self._group)
        if self.rank != 0 and pieces is None:
            return None
        snap = None
        if self.rank == 0:
            snap, self._buffers = snapshot(state, self._buffers)
        ready = _ready(self._buffers) if snap is not None else None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="scaleout-ckpt")

        def job() -> None:
            t0 = time.perf_counter()
            try:
                record = pieces.result() if pieces is not None else None  # every rank's shards
            except BaseException as exc:
                if not is_disk_full(exc):
                    raise
                raise self._full(step, self.dir / name, state_bytes(shards)) from None
            if self.rank == 0:
                if ready is not None:
                    ready.synchronize()
                self._commit(step, snap, record)
            self.write_s.append(time.perf_counter() - t0)

        with self._lock:
            self._pending, self._pending_step = self._executor.submit(job), step
        return self.path(step) if self.rank == 0 else None

    @property
    def in_flight(self) -> bool:
        """A background save not finished yet."""
        pending = self._pending
        return pending is not None and not pending.done()

    def wait(self) -> CheckpointWriteFailed | None:
        """Wait for the save in flight (if any); the error a failed one raised, as one line (the
        caller raises it: at a step boundary every rank agrees first), else None."""
        with self._lock:
            pending, step = self._pending, self._pending_step
            self._pending = self._pending_step = None
        if pending is None:
            return None
        error = pending.exception()
        if error is None:
            return None
        if isinstance(error, DiskFull):  # already one line naming the rank, path and bytes
            return CheckpointDiskFull(str(error))
        what = f"{type(error).__name__}: {error}".replace("\n", " ")
        return CheckpointWriteFailed(
            f"rank {self.rank}: the background write of checkpoint step {step} in {self.dir} "
            f"failed: {what}"
        )

    def close(self) -> CheckpointWriteFailed | None:
        """Wait for the save in flight and stop the background thread; its error, if any."""
        error = self.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._buffers = []
        return error

    def _full(self, step: int, path: Path, needed: int) -> DiskFull:
        """The one line for a save that found no room (atomic_write removed its temp file)."""
        kept = [s for s, _ in self.list() if s < step]
        after = f"; checkpoint step {kept[-1]} is kept for resume" if kept else ""
        what = f"checkpoint step {step} to"
        return DiskFull(f"rank {self.rank}: {disk_full(path, needed, what)}{after}")

    def _drop(self, path: Path) -> None:
        path.unlink(missing_ok=True)
        for d in self.dir.glob(f"{path.stem}.shards-*"):
            _shards().remove_tree(d)

    def choose(self, map_location: Any = "cpu") -> tuple[dict[str, Any], Path] | None:
        """Newest complete checkpoint that verifies, or None. Logs every one that had to be
        skipped."""
        for step, path in reversed(self.list()):
            try:
                state = read_checkpoint(path, map_location)
                if "shards" in state:
                    _shards().check_shards(self.dir, state["shards"])
            except (
                CorruptCheckpoint,
                _shards().CorruptShards,
                OSError,
                RuntimeError,
                EOFError,
            ) as e:
                log.warning(
                    "checkpoint %s at step %d is unusable (%s); falling back to the previous one",
                    path,
                    step,
                    e,
                )
                continue
            log.info("resuming from %s (step %d)", path, step)
            return state, path
        return None

    load_latest = choose  # single-process readers (tools, tests)

    def restore(
        self, world: World, shards: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], Path] | None:
        """Collective resume: rank 0 chooses and sends the replicated state; every rank reads its
        own shards into ``shards`` (in place). Returns (state, path), or None on every rank when
        there is nothing to resume. Per rank, the objects that move are O(1) and go through the
        store (:mod:`scaleout.store_share`); the tensors go by ``dist.broadcast`` on the device."""
        multi = world is not None and world.world_size > 1
        found = self.choose() if world is None or world.rank == 0 else None
        state, path = found if found is not None else (None, None)
        if state is not None:
            # Checkpoints written before the RNG streams became per-step (train/rng.py) hold every
            # rank's RNG state: not needed, and not worth broadcasting to every rank.
            state.pop("rng", None)
        head = None if state is None else str(path)
        if multi:
            head = broadcast_object(world, "checkpoint/resume", head)
        if head is None:
            return None
        path = Path(head)
        state = broadcast_state(state, world) if multi else state
        _check_kind(state, shards, path)
        if shards is not None:
            _shards().load_pieces(shards, self.dir, state["shards"], _group(world))
        return state, path


def state_bytes(state: Any) -> int:
    """The bytes of the tensors in ``state`` (each storage once): what its file needs, less
    torch.save's small per-record overhead."""
    seen: set[int] = set()
    total = 0

    def walk(obj: Any) -> None:
        nonlocal total
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen or not storage.nbytes():
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    walk(state)
    return total


def _shards() -> ModuleType:
    """scaleout.checkpoint_dcp, imported on first use: torch.distributed.checkpoint pulls in
    DTensor and sympy (~1.3 s of CPU per process here), which every rank of a run without a
    sharded optimizer would pay at start."""
    import scaleout.checkpoint_dcp  # deferred: torch.distributed.checkpoint, dcp format only

    return scaleout.checkpoint_dcp


def _group(world: World | None) -> Any:
    """The group for object traffic (None: the default group of a one-rank or world-less run)."""
    return world.cpu_group if world is not None and world.world_size > 1 else None


def _token(world: World) -> str:
    """A name shared by every rank for this save's shard directory (rank 0's clock, broadcast)."""
    return broadcast_object(world, "checkpoint/token", f"{time.time_ns():x}")


def _check_kind(state: dict[str, Any], shards: dict[str, Any] | None, path: Path) -> None:
    if shards is not None and "shards" not in state:
        raise ConfigError(
            f"checkpoint {path} holds an unsharded optimizer state: resume it with "
            "optim.sharded=false"
        )
    if shards is None and "shards" in state:
        raise ConfigError(
            f"checkpoint {path} holds a sharded optimizer state: resume it with optim.sharded=true"
        )


class _Slot:
    """Where a tensor sat in a state being broadcast (shape and dtype travel with the skeleton)."""

    def __init__(self, index: int, shape: tuple[int, ...], dtype: torch.dtype):
        self.index, self.shape, self.dtype = index, shape, dtype


def _strip(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _Slot(len(tensors) - 1, tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return type(obj)((k, _strip(v, tensors)) for k, v in obj.items())
    if isinstance(obj, list | tuple):
        return type(obj)(_strip(v, tensors) for v in obj)
    return obj


def _fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _Slot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return type(obj)((k, _fill(v, tensors)) for k, v in obj.items())
    if isinstance(obj, list | tuple):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj


def _slots(obj: Any, out: list[_Slot]) -> list[_Slot]:
    if isinstance(obj, _Slot):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _slots(v, out)
    elif isinstance(obj, list | tuple):
        for v in obj:
            _slots(v, out)
    return out


# Tensors of one dtype travel in flat buffers of at most this size: few collectives, bounded extra
# memory.
BROADCAST_BYTES = 256 << 20


def broadcast_state(state: Any, world: World) -> Any:
    """Rank 0's ``state`` (nested dicts/lists of tensors and plain values) on every rank: the
    structure through the store (:func:`~scaleout.store_share.broadcast_object`), the tensors by
    ``dist.broadcast`` on ``world.device`` (returned on the CPU)."""
    tensors: list[torch.Tensor] = []
    box = [_strip(state, tensors) if world.rank == 0 else None]
    box[0] = broadcast_object(world, "checkpoint/structure", box[0])
    slots = sorted(_slots(box[0], []), key=lambda s: s.index)
    out: list[torch.Tensor] = [None] * len(slots)  # type: ignore[list-item]
    batch: list[_Slot] = []
    for i, slot in enumerate(slots):
        batch.append(slot)
        nxt = slots[i + 1] if i + 1 < len(slots) else None
        size = sum(
            math.prod(s.shape) * torch.empty((), dtype=s.dtype).element_size() for s in batch
        )
        if nxt is None or nxt.dtype != slot.dtype or size >= BROADCAST_BYTES:
            _broadcast_batch(batch, tensors, out, world)
            batch = []
    return _fill(box[0], out)


def _broadcast_batch(
    batch: list[_Slot], tensors: list[torch.Tensor], out: list[torch.Tensor], world: World
) -> None:
    sizes = [math.prod(s.shape) for s in batch]
    dtype = batch[0].dtype
    if world.rank == 0:
        flat = torch.cat([tensors[s.index].reshape(-1).to(dtype) for s in batch]).to(world.device)
    else:
        flat = torch.empty(sum(sizes), dtype=dtype, device=world.device)
    dist.broadcast(flat, src=0)
    flat = flat.cpu()
    for s, piece in zip(batch, flat.split(sizes), strict=True):
        out[s.index] = piece.view(s.shape)
