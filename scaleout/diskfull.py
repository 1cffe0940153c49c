"""A full disk said plainly: which path, how many bytes were needed and how many are free.

A write that runs out of space surfaces in many shapes: ``OSError: [Errno 28]`` from a plain
write, a quota's ``EDQUOT``, or torch's ``RuntimeError: [enforce fail at inline_container.cc]
unexpected pos`` from ``torch.save`` (its zip writer hides the ``OSError`` in the exception's
context). :func:`is_disk_full` sees through all of them; :func:`disk_full` turns one into a
:class:`DiskFull`, a one-line :class:`UserError`. Standard library only (no torch): the launcher's
preflight uses it too (:func:`check_room`).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path

from scaleout.errors import UserError

FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class DiskFull(UserError):
    """A write that found no room: names the path, the bytes needed and the bytes free."""


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an exception it was raised from or during, is a full disk or quota."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in FULL_ERRNOS:
            return True
        # torch.distributed.checkpoint's CheckpointException carries each rank's failure as
        # (exception, traceback) in .failures, not as a cause
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict):
            for wrapped in failures.values():
                inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
                if isinstance(inner, BaseException) and is_disk_full(inner):
                    return True
        exc = exc.__cause__ or exc.__context__
    return False


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Bytes free to an unprivileged writer on the file system of ``path`` (its nearest existing
    parent), or None when that cannot be asked."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def human(n: int | None) -> str:
    if n is None:
        return "unknown"
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f} {unit} ({n} bytes)"
    return f"{n} bytes"


def disk_full(path: str | os.PathLike[str], needed: int | None, what: str) -> DiskFull:
    """The one line for a write of ``what`` to ``path`` that found the disk full."""
    free = free_bytes(path)
    need = f"needs {human(needed)}" if needed else "needs more room"
    return DiskFull(f"no space left writing {what} {path}: {need}, {human(free)} free there")


def check_room(directory: str | os.PathLike[str], needed: int, what: str, key: str) -> None:
    """Refuse, in one line naming ``key``, a start whose ``directory`` has less free room than
    ``needed`` bytes for ``what``."""
    free = free_bytes(directory)
    if free is not None and free < needed:
        raise DiskFull(
            f"{key}={directory}: {human(free)} free, but {what} needs {human(needed)}; "
            f"free {human(needed - free)} there or use another directory"
        )


class StrictFileHandler(logging.FileHandler):
    """A log file whose write errors end the run: logging's default prints "--- Logging error
    ---" with a traceback for every record and goes on, so a full disk under the MLPerf log was a
    stream of tracebacks and a log with holes. Here the error (re-raised from within ``emit``'s
    handler) reaches the caller, where it is reported as one line."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 -- logging's name
        raise  # noqa: PLE0704 -- called inside emit's ``except``: the error being handled
