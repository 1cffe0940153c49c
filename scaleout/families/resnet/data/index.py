"""The cached file index of an image data set: built once by rank 0, read by every other rank.

Listing ImageNet's training tree is about 1,000 ``readdir`` calls over 1.28 M entries. Done by every
rank of a 1,024-rank job that is a million metadata operations against one metadata server, so:

- **Lazy.** Nothing is listed when a data set object is made; the index is loaded on the first item
  access (or ``len()``), which the trainer does only after MLPerf ``run_start`` (the prefetcher's
  first batch). A data set is pickled into the prefetch workers with its index already loaded, so a
  worker never touches the file system for it.
- **Built once, by rank 0.** Rank 0 lists the tree and writes one compact ``.npz`` (file names as
  one byte blob + offsets, an integer label per file: a few tens of MB for ImageNet, not 1.28 M
  Python tuples, since every prefetch worker holds a copy).
- **O(1) metadata calls elsewhere.** Every other rank does one ``stat`` of the split directory (its
  ``mtime`` is part of the index's name, so a tree whose class folders changed gets a new index),
  then waits for that one file (one ``stat`` per poll, at most every 2 s) and reads it. A build
  error on rank 0 is written beside the index and raised by the waiting ranks with the same line.

Where (:func:`index_dir`): ``<data.path>/.scaleout-index/`` when ``data.path`` is writable, else
``<train.output_dir>/.scaleout-index/<hash of data.path>/``. A file added inside an existing class
folder does not change the split directory's ``mtime``: delete ``.scaleout-index`` after editing a
tree in place. Node-local copies of the data (staged to each node's disk) need the index written
where every node sees it: keep ``data.path`` read-only there so it goes to ``train.output_dir``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import re
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from scaleout.errors import UserError
from scaleout.fsutil import atomic_write_path

INDEX_VERSION = 1
WAIT_TIMEOUT_S = 3600.0  # rank 0 lists 1.28 M files in minutes even on a slow shared file system


def index_dir(root: str | os.PathLike[str], output_dir: str | os.PathLike[str] | None) -> Path:
    """Where the index of the data set at ``root`` lives (see the module docstring)."""
    root = Path(root)
    if os.access(root, os.W_OK):
        return root / ".scaleout-index"
    base = Path(output_dir) if output_dir else Path.home() / ".cache" / "scaleout"
    digest = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
    return base / ".scaleout-index" / digest


def index_path(idx: Path, name: str, source: Path) -> Path:
    """``<idx>/<name>-<key>.npz``: the key hashes the source's absolute path and ``mtime`` (one
    ``stat``) and the index version."""
    st = source.stat()
    text = f"{source.resolve()}:{st.st_mtime_ns}:{INDEX_VERSION}"
    return idx / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.npz"


def pack_strings(items: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Strings as one uint8 blob + int64 offsets (string i = blob[off[i]:off[i+1]])."""
    encoded = [s.encode() for s in items]
    offsets = np.zeros(len(encoded) + 1, np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    return np.frombuffer(b"".join(encoded), np.uint8).copy(), offsets


def unpack_string(blob: np.ndarray, offsets: np.ndarray, i: int) -> str:
    return blob[offsets[i] : offsets[i + 1]].tobytes().decode()


def load_or_build(
    path: Path,
    build: Callable[[], dict[str, np.ndarray]],
    rank: int,
    timeout_s: float = WAIT_TIMEOUT_S,
) -> dict[str, np.ndarray]:
    """The arrays of the index at ``path``: read it if it exists; else rank 0 runs ``build`` and
    writes it (atomically), and every other rank waits for the file (see the module docstring)."""
    error = path.with_suffix(".error")
    if not path.is_file():
        if rank == 0:
            error.unlink(missing_ok=True)
            try:
                arrays = build()
            except UserError as exc:  # the waiting ranks raise the same line
                message = str(exc)
                _atomic(error, lambda p: p.write_text(message))
                raise
            _atomic(path, lambda p: np.savez(p, **arrays))
            same = re.compile(
                rf"{re.escape(path.name.rsplit('-', 1)[0])}-[0-9a-f]{{12}}\.(npz|error)"
            )
            for old in path.parent.iterdir():  # rank 0 only, a small folder
                if same.fullmatch(old.name) and old.name not in (path.name, error.name):
                    old.unlink(missing_ok=True)  # indexes of an older version of the tree
            return arrays
        _wait(path, error, rank, timeout_s)
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _wait(path: Path, error: Path, rank: int, timeout_s: float) -> None:
    start, wall, delay = time.monotonic(), time.time(), 0.05
    while not path.is_file():
        with contextlib.suppress(OSError):  # an error of an earlier run's build is stale
            if error.stat().st_mtime >= wall - 30:
                raise UserError(error.read_text().strip())
        if time.monotonic() - start > timeout_s:
            raise UserError(
                f"rank {rank}: waited {timeout_s:.0f} s for the data index {path}, which rank 0 "
                "writes; is data.path a node-local copy? (then make it read-only: the index goes "
                "under train.output_dir)"
            )
        time.sleep(delay * (0.5 + random.random()))
        delay = min(delay * 2, 2.0)


def _atomic(path: Path, write: Callable[[Path], None]) -> None:
    atomic_write_path(path, write, keep_suffix=True)  # numpy's writers append a missing suffix
