"""Shared by the bad-input tests by class: run the real CLI, and check that it ended in one
line on stderr naming the value, exit 2, no traceback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_LEAKY = re.compile(
    r"^(SLURM_.*|SCALEOUT_.*|RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|MASTER_ADDR|"
    r"MASTER_PORT|TORCHELASTIC_.*|OMPI_.*|PMIX_.*|PMI_.*|HOROVOD_.*)$"
)
# An error line is a line: it names a value by an excerpt, never by megabytes.
MAX_LINE = 600


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(folder)): (p.lstat().st_size, p.lstat().st_mtime_ns)
        for p in folder.rglob("*")
    }


def run_cli(
    argv: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 60
) -> tuple[subprocess.CompletedProcess, float]:
    full = {k: v for k, v in os.environ.items() if not _LEAKY.match(k)}
    full.update(env or {}, PYTHONPATH=str(ROOT) + os.pathsep + full.get("PYTHONPATH", ""))
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "scaleout", *argv],
        cwd=cwd,
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return r, time.monotonic() - t0


def assert_one_line(r: subprocess.CompletedProcess, *named: str) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stdout[-1500:], r.stderr[-1500:])
    assert len(lines) == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert len(lines[0]) <= MAX_LINE, lines[0][:MAX_LINE]
    for n in named:
        assert n in lines[0], (n, lines[0])
    return lines[0]
