"""Stage a data directory onto node-local disk: once per node, whatever number of ranks ask.

MLPerf BERT's 4,320 training shards are read at random by every rank; from node-local NVMe a node
reads them without loading the shared file system, which at 2,048 ranks is the first thing to
saturate. The price is paid once, before the run: every node reads the whole data set (N nodes, N
copies), where training alone reads only its ranks' share of it. :func:`stage` copies ``src``
into ``dest``:

- once per node: an exclusive ``flock`` on ``dest/.scaleout-stage.lock`` makes a second caller
  on the same node (another rank, a rerun) wait, then find the files there and copy nothing;
- incrementally: a file whose size and mtime already match is kept, so a requeued job restages in
  seconds and a changed shard is copied again;
- with mtimes kept (``shutil.copy2``): the shard index (``.scaleout-index``, built by ``scaleout
  data index`` on the shared copy) keys each shard by name, size and mtime, so the staged copy
  reuses it instead of re-indexing on every node;
- atomically per file (a temporary name, then ``os.replace``): a job killed mid-copy leaves no
  half file under a real name;
- after checking free space on ``dest`` first (one line naming both sizes), before any copy.

Symlinked folders in ``src`` are followed (``data.path/train`` may link to the reference's
``hdf5_4320_shards_varlength``); the copy holds real files.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from scaleout.errors import UserError

LOCK = ".scaleout-stage.lock"
MARKER = ".scaleout-staged.json"
_OWN = (LOCK, MARKER)


@dataclass
class StageResult:
    """What one call did on this node."""

    copied: int
    kept: int
    bytes_copied: int
    seconds: float


def _files(src: Path) -> list[Path]:
    """Every file under ``src`` (relative), symlinked folders followed, our own bookkeeping left
    out."""
    out = []
    for root, _dirs, names in os.walk(src, followlinks=True):
        for n in names:
            if n not in _OWN and not n.startswith(".scaleout-tmp-"):
                out.append(Path(root, n).relative_to(src))
    return sorted(out)


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return a.st_size == b.st_size and a.st_mtime_ns == b.st_mtime_ns


def stage(src: str | os.PathLike[str], dest: str | os.PathLike[str]) -> StageResult:
    """Copy ``src`` into ``dest`` (see the module docstring); returns what this call copied."""
    s, d = Path(src), Path(dest)
    if not s.is_dir():
        raise UserError(f"{s} is not a directory; expected the data to copy")
    if d.resolve() == s.resolve() or s.resolve() in d.resolve().parents:
        raise UserError(f"{d} is {s} or inside it; expected another disk")
    d.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(d / LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other ranks of this node wait here
        todo, kept = [], 0
        for rel in _files(s):
            st = (s / rel).stat()
            there = d / rel
            if there.is_file() and _same(there.stat(), st):
                kept += 1
            else:
                todo.append((rel, st.st_size))
        need = sum(size for _, size in todo)
        free = shutil.disk_usage(d).free
        if need > free:
            raise UserError(
                f"{d} has {free / 2**30:.1f} GiB free, the copy needs "
                f"{need / 2**30:.1f} GiB more; expected a node-local disk that holds {s}"
            )
        for rel, _ in todo:
            target = d / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".scaleout-tmp-{target.name}")
            shutil.copy2(s / rel, tmp)  # copy2 keeps the mtime: the shard index's key
            os.replace(tmp, target)
        result = StageResult(len(todo), kept, need, time.monotonic() - t0)
        marker = {
            "source": str(s.resolve()),
            "host": socket.gethostname(),
            "files": len(todo) + kept,
            "copied": len(todo),
            "bytes_copied": need,
            "seconds": round(result.seconds, 3),
        }
        (d / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    return result
