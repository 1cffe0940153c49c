"""Atomic, checksummed checkpoints with fall-back to the previous one.

File layout (one file per checkpoint, ``ckpt-<step:08d>.pt``)::

    b"SCALEOUTCKPT1\\n" | sha256(payload) (32 bytes) | payload length (8 bytes, little endian) | payload

where the payload is ``torch.save(state)``. A save writes ``<name>.<pid>-<random>.tmp``, fsyncs it, renames it over the
final name and fsyncs the directory, so a crash leaves either the old set or the new set of files, never
a half-written checkpoint under a real name. ``load_latest`` verifies magic, length and digest before
unpickling; a truncated or corrupted latest checkpoint is reported and the previous one is used.

Everything stored is a tensor or a plain Python value, so ``torch.load(weights_only=True)`` works: RNG
states are converted (numpy's state array becomes a list). Data-parallel ranks hold identical weights, so
rank 0 writes; per-rank RNG states are gathered first (``gather_rng_states``) so every rank resumes its
own dropout/noise stream exactly.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import random
import re
import secrets
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scaleout.errors import UserError

log = logging.getLogger("scaleout.checkpoint")

MAGIC = b"SCALEOUTCKPT1\n"
_HEADER = len(MAGIC) + 32 + 8
_NAME = re.compile(r"^ckpt-(\d{8,})\.pt$")


class CorruptCheckpoint(UserError):
    """A checkpoint whose header, length or checksum does not match its contents."""


# -- RNG states ---------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """This process's python, numpy, torch (and CUDA) RNG states as weights_only-loadable values."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),  # (version, tuple of 625 ints, gauss or None): plain types
        "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def gather_rng_states(world: Any = None) -> list[dict[str, Any]]:
    """Every rank's RNG state, indexed by rank (a collective: call on all ranks)."""
    mine = rng_state()
    if world is None or world.world_size == 1:
        return [mine]
    import torch.distributed as dist

    out: list[Any] = [None] * world.world_size
    dist.all_gather_object(out, mine)
    return out


# -- files -------------------------------------------------------------------------------------------
def encode(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    return MAGIC + hashlib.sha256(payload).digest() + struct.pack("<Q", len(payload)) + payload


def decode(blob: bytes, name: str = "checkpoint", map_location: Any = "cpu") -> dict[str, Any]:
    """Verify and unpickle (weights_only=True); raise CorruptCheckpoint naming what is wrong."""
    if len(blob) < _HEADER or not blob.startswith(MAGIC):
        raise CorruptCheckpoint(f"{name}: not a scaleout checkpoint or truncated header ({len(blob)} bytes)")
    digest = blob[len(MAGIC) : len(MAGIC) + 32]
    (length,) = struct.unpack("<Q", blob[len(MAGIC) + 32 : _HEADER])
    payload = blob[_HEADER:]
    if len(payload) != length:
        raise CorruptCheckpoint(f"{name}: truncated, payload has {len(payload)} of {length} bytes")
    if hashlib.sha256(payload).digest() != digest:
        raise CorruptCheckpoint(f"{name}: sha256 checksum mismatch (file corrupted)")
    return torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``path`` via a temporary file and a rename. The temporary name is unique per writer (pid and
    a random part): two runs writing the same name never write into one file."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write (disk full, quota) leaves the old file and no debris
        raise
    _fsync_dir(path.parent)


class Checkpointer:
    """Save/load ``ckpt-<step>.pt`` files in ``directory``, keeping the newest ``keep``.

    ``state`` is whatever the trainer collects, by convention::

        {"step": int, "model": model.state_dict(), "optimizer": opt.state_dict(),
         "schedule": sched.state_dict(), "data_position": int, "rng": gather_rng_states(world)}
    """

    def __init__(self, directory: str | os.PathLike[str], keep: int = 2, rank: int = 0):
        if keep < 1:
            raise UserError(f"checkpoint.keep={keep} must be at least 1")
        self.dir = Path(directory)
        self.keep = keep
        self.rank = rank

    def path(self, step: int) -> Path:
        return self.dir / f"ckpt-{step:08d}.pt"

    def list(self) -> list[tuple[int, Path]]:
        """(step, path) of every checkpoint file, oldest first."""
        if not self.dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.dir.iterdir() if (m := _NAME.match(p.name))]
        return sorted(found)

    def save(self, step: int, state: dict[str, Any]) -> Path | None:
        """Write on rank 0 only (DP weights are identical); prune beyond ``keep``. Returns the path."""
        if self.rank != 0:
            return None
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.path(step)
        atomic_write(path, encode({**state, "step": step}))
        # Prune only older steps: a higher step in the directory is not this save's to delete (the rerun
        # policy in train/rerun.py keeps other runs out of a run's directory).
        older = [p for s, p in self.list() if s < step]
        for old in older[: max(len(older) - (self.keep - 1), 0)]:
            old.unlink(missing_ok=True)
        return path

    def load_latest(self, map_location: Any = "cpu") -> tuple[dict[str, Any], Path] | None:
        """Newest checkpoint that verifies, or None. Logs every one that had to be skipped."""
        for step, path in reversed(self.list()):
            try:
                state = decode(path.read_bytes(), str(path), map_location)
            except (CorruptCheckpoint, OSError, RuntimeError, EOFError) as e:
                log.warning("checkpoint %s at step %d is unusable (%s); falling back to the previous one", path, step, e)
                continue
            log.info("resuming from %s (step %d)", path, step)
            return state, path
        return None
