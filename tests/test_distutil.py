"""The test harness's process pools (tests/distutil.py) do not leak: a pool process exits when the
process that made it is killed without its atexit (as the OOM killer or a SIGTERM does), and the
pools one process keeps stay under MAX_POOLED_PROCS processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

HOLDER = """
import sys, time
sys.path[:0] = [{tests!r}, {root!r}]
import distutil
from distutil import run_dist

def pid(world):
    import os
    return os.getpid()

if __name__ == "__main__":
    pids = []
    for shape in [(1, 2), (1, 3), (1, 4), (2, 2)]:  # 13 processes asked for, at most 8 kept
        pids += run_dist(pid, *shape)
    kept = sum(p.world for p in distutil._POOLS.values())
    print(" ".join(map(str, pids)), "|", kept, flush=True)
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone too
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.multi_process
def test_pools_are_capped_and_die_with_the_process_that_made_them(tmp_path: Path) -> None:
    script = tmp_path / "holder.py"
    script.write_text(HOLDER.format(tests=str(TESTS), root=str(ROOT)))
    holder = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = holder.stdout.readline()
        pids_text, kept = line.split("|")
        pids = [int(p) for p in pids_text.split()]
        assert len(pids) == 13 and int(kept) <= 8, line
        live = [p for p in pids if _alive(p)]
        assert 0 < len(live) <= 8, (live, line)  # the evicted pools' processes were closed
        holder.send_signal(signal.SIGKILL)  # no atexit, as the OOM killer
        holder.wait(timeout=10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(p) for p in live):
            time.sleep(0.2)
        assert not [p for p in live if _alive(p)], "pool processes outlived their parent"
    finally:
        if holder.poll() is None:
            holder.kill()
