"""Is a path usable for what a run will write there? Asked before anything is written or spawned.

Standard library only, and read-only: nothing is created to find out (a check that made the folder
would leave debris behind on the bad input it refuses). A folder that does not exist yet is judged
by its nearest existing ancestor: that one must be a folder the user may write into.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from scaleout.errors import UserError, excerpt


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        if p.is_symlink():  # a dangling link: writing through it fails the same way
            break
        p = p.parent
    return p


def check_writable_dir(path: str | os.PathLike[str], what: str, given: str | None = None) -> Path:
    """``path`` is, or can be made as, a folder this process may write into. ``what`` names the
    setting in the error (``train.output_dir``), ``given`` its value when that is not ``path``.
    Returns the nearest existing ancestor."""
    text = os.fspath(path)
    shown = excerpt(text if given is None else given)
    if text == "":
        raise UserError(f"{what}='': expected a folder (use . for the current one)")
    p = Path(text)
    base = _nearest_existing(p)
    if not base.exists():
        raise UserError(f"{what}={shown}: {base} is a dangling link; expected a folder")
    if not base.is_dir():
        raise UserError(f"{what}={shown}: {base} is a file, not a folder; expected a folder path")
    if not os.access(base, os.W_OK | os.X_OK):
        raise UserError(f"{what}={shown}: {base} is not writable by this user")
    return base


def check_writable_file(path: str | os.PathLike[str], what: str) -> None:
    """``path`` can be written as a file: its folder can be, and it is not a folder itself."""
    p = Path(os.fspath(path))
    if p.is_dir():
        raise UserError(f"{what}={excerpt(os.fspath(path))}: is a folder; expected a file path")
    if p.exists() and not os.access(p, os.W_OK):
        raise UserError(f"{what}={excerpt(os.fspath(path))}: not writable by this user")
    check_writable_dir(p.parent, what, os.fspath(path))


def check_room(path: str | os.PathLike[str], need: int, what: str) -> None:
    """The file system of ``path`` (or its nearest existing ancestor) has ``need`` bytes free."""
    base = check_writable_dir(path, what)
    free = shutil.disk_usage(base).free
    if free < need:
        raise UserError(
            f"{what}={excerpt(os.fspath(path))}: {_gib(free)} free on {base}, expected at least "
            f"{_gib(need)} (room for one checkpoint)"
        )


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"
