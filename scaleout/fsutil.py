"""File-system helpers every layer shares, standard library only: an atomic write (a reader sees
the old file or the new one, never half of one, and a crash leaves no debris) and an exclusive
file lock between processes (ranks and tools on one shared file system)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (best effort: some file systems refuse)."""
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


def atomic_write(
    path: str | os.PathLike[str], data: bytes | str | Callable[[BinaryIO], None]
) -> None:
    """Write ``path`` atomically: ``data`` (text is UTF-8), or what ``data(f)`` writes into the
    open binary file (:func:`atomic_write_path` says how)."""

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)

    atomic_write_path(path, write)


def atomic_write_path(
    path: str | os.PathLike[str], write: Callable[[Path], None], keep_suffix: bool = False
) -> None:
    """Write ``path`` atomically with a writer that takes a file name (h5py, numpy, or a plain
    open): ``write(tmp)`` writes a temporary file beside it (ending ``.tmp``, or with
    ``keep_suffix`` in ``path``'s suffix, which numpy's writers need); that file is fsynced and
    renamed onto ``path``, then the folder is fsynced. The temporary name is unique per writer
    (pid and a random part): two writers of one name never write into one file. A failed write
    (disk full, quota) leaves the old file and no debris. The folder is created if missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    end = ".tmp" + (path.suffix if keep_suffix else "")
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}{end}")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the ``with`` block: one
    process at a time, across processes of one host or of a file system that honours flock."""
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
