"""Quarantine files: the nodes a verdict said to keep a job off, and why.

One JSON schema for every writer (``scaleout doctor --quarantine FILE``, the trainer's
``runs/<name>/quarantine.json``)::

    {"nodes": {"gpu017": [{"reason": "inter-node bandwidth 11 MB/s, 0.10x the median ...",
                           "source": "doctor", "time": "2026-12-04T16:20:05Z"}]}}

A node's entries are appended, never replaced, so a file is the history of verdicts about it.
:func:`load` checks the schema (a corrupt file is one line naming it, not a traceback),
:func:`add` / :func:`merge` are pure, :func:`save` writes atomically (temporary file + rename), and
:func:`record` does load + add + save under an exclusive lock so that concurrent writers (the ranks
of two jobs, doctor and a trainer) never lose each other's entries. :func:`hosts` lists the nodes a
file quarantines, for ``sbatch --exclude`` (:func:`scaleout.env.nodelist.compress_hostlist`);
:func:`exclude_list` the same from a file. A node leaves quarantine when its entries are deleted
from the file (or the file is removed).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from scaleout.errors import UserError
from scaleout.fsutil import atomic_write, file_lock

FIELDS = ("reason", "source", "time")
FILE = "quarantine.json"  # a run's: runs/<name>/quarantine.json (the Slurm supervisor's)


def path_for(run_dir: str | os.PathLike[str]) -> Path:
    """A run's quarantine file."""
    return Path(run_dir) / FILE


def empty() -> dict[str, Any]:
    return {"nodes": {}}


def now() -> str:
    """UTC time stamp of an entry, ISO 8601 to the second."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def validate(data: Any, where: str = "quarantine") -> dict[str, Any]:
    """``data`` if it follows the schema, else UserError naming what is wrong."""
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), dict):
        raise UserError(f'{where}: expected an object {{"nodes": {{host: [entries]}}}}')
    for host, entries in data["nodes"].items():
        if not host or not isinstance(entries, list):
            raise UserError(f"{where}: node {host!r}: expected a non-empty name and a list")
        for e in entries:
            if not isinstance(e, dict) or not all(isinstance(e.get(k), str) for k in FIELDS):
                raise UserError(
                    f"{where}: node {host!r}: entry {e!r} needs string fields {', '.join(FIELDS)}"
                )
    return data


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The file's contents; an absent or empty file is an empty quarantine."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        return empty()
    except OSError as exc:
        raise UserError(f"quarantine file {str(p)!r}: cannot read it ({exc.strerror})") from None
    if not text.strip():
        return empty()
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise UserError(f"quarantine file {str(p)!r}: not JSON ({exc})") from None
    return validate(data, f"quarantine file {str(p)!r}")


def add(
    data: Mapping[str, Any], host: str, reason: str, source: str, when: str | None = None
) -> dict[str, Any]:
    """A copy of ``data`` with one entry appended to ``host``'s list."""
    if not host:
        raise UserError(f"quarantine: empty node name for the verdict {reason!r}")
    out = merge(data)
    out["nodes"].setdefault(host, []).append(
        {"reason": reason, "source": source, "time": when or now()}
    )
    return out


def merge(*datas: Mapping[str, Any]) -> dict[str, Any]:
    """One quarantine holding every entry of ``datas``, in order, without exact duplicates."""
    out = empty()
    for data in datas:
        for host, entries in validate(data)["nodes"].items():
            mine = out["nodes"].setdefault(host, [])
            for e in entries:
                entry = {k: e[k] for k in FIELDS} | {k: v for k, v in e.items() if k not in FIELDS}
                if entry not in mine:
                    mine.append(entry)
    return out


def hosts(data: Mapping[str, Any]) -> list[str]:
    """The quarantined nodes, sorted."""
    return sorted(validate(data)["nodes"])


def exclude_list(data: Mapping[str, Any] | str | os.PathLike[str]) -> list[str]:
    """The quarantined nodes of a quarantine or of a file, sorted (``srun --exclude``,
    ``ExcNodeList``: joined by ',')."""
    return hosts(data if isinstance(data, Mapping) else load(data))


def save(path: str | os.PathLike[str], data: Mapping[str, Any]) -> None:
    """Write atomically: a reader sees the old file or the new one, never half of one."""
    p = Path(path)
    validate(data, f"quarantine for {str(p)!r}")
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(p, json.dumps(data, indent=1, sort_keys=True) + "\n")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(path.with_name(f".{path.name}.lock")):
        yield


def record(
    path: str | os.PathLike[str], verdicts: Iterable[tuple[str, str]], source: str
) -> dict[str, Any]:
    """Append ``(host, reason)`` verdicts from ``source`` to the file (load + add + save under an
    exclusive lock); returns what the file now holds."""
    p = Path(path)
    with _locked(p):
        data = load(p)
        when = now()
        for host, reason in verdicts:
            data = add(data, host, reason, source, when)
        save(p, data)
    return data
