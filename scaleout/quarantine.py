"""A run's quarantined nodes: ``runs/<name>/quarantine.json``, kept across requeues and
resubmissions.

Schema: ``{"nodes": {host: [{"reason": str, "source": str, "time": float}, ...]}}`` -- one entry
per verdict (a dead or hung node from a failed step, ``scaleout doctor``, a straggler, ...), newest
last. Every writer goes through :func:`add` (read, merge, atomic replace under an advisory lock), so
the batch script's supervisor and ``scaleout doctor`` may both write the same file. A node leaves
quarantine when its entry is deleted from the file (or the file is removed).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from scaleout.checkpoint import atomic_write
from scaleout.errors import UserError

FILE = "quarantine.json"

Verdicts = dict[str, list[dict[str, Any]]]


def path_for(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / FILE


def load(path: str | os.PathLike[str]) -> Verdicts:
    """host -> verdicts; {} when the file does not exist. A file that is not this schema is a
    one-line error (it would otherwise silently stop excluding nodes)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise UserError(f"{p}: unreadable quarantine file ({exc}); fix or remove it") from exc
    nodes = data.get("nodes") if isinstance(data, dict) else None
    if not isinstance(nodes, dict) or not all(isinstance(v, list) for v in nodes.values()):
        raise UserError(
            f'{p}: expected {{"nodes": {{host: [{{"reason", "source", "time"}}, ...]}}}}; '
            "fix or remove it"
        )
    return nodes


def merge(a: Verdicts, b: Verdicts) -> Verdicts:
    """The union of two quarantines: every host of either, its verdicts in time order, exact
    duplicates dropped."""
    out: Verdicts = {}
    for src in (a, b):
        for host, entries in src.items():
            have = out.setdefault(host, [])
            have.extend(e for e in entries if e not in have)
    for entries in out.values():
        entries.sort(key=lambda e: float(e.get("time", 0.0)))
    return out


def save(path: str | os.PathLike[str], nodes: Verdicts) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(p, (json.dumps({"nodes": nodes}, indent=2, sort_keys=True) + "\n").encode())


def add(
    path: str | os.PathLike[str],
    hosts: Iterable[str],
    reason: str,
    source: str,
    when: float | None = None,
) -> Verdicts:
    """Quarantine ``hosts`` with one verdict each (read-merge-replace under a lock on
    ``<path>.lock``); returns the whole quarantine."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    entry = {"reason": reason, "source": source, "time": time.time() if when is None else when}
    with open(p.with_name(p.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        nodes = merge(load(p), {h: [dict(entry)] for h in hosts})
        save(p, nodes)
    return nodes


def exclude_list(nodes: Verdicts | str | os.PathLike[str]) -> list[str]:
    """The quarantined hosts, sorted (for ``srun --exclude`` / ``ExcNodeList``, joined by ',')."""
    if not isinstance(nodes, dict):
        nodes = load(nodes)
    return sorted(h for h, entries in nodes.items() if entries)
