"""Stops a launcher's ranks when the launcher itself dies without stopping them (SIGKILL, OOM
killer, crash).

Started by :class:`launchers.local.LocalJob` as ``python -I launchers/watchdog.py`` in a session of
its own, with a pipe from the launcher on stdin. The launcher writes one line per event:

    grace <seconds>        SIGTERM -> SIGKILL window
    rank <pid> <start>     a rank's process group (its pid) and the start time from /proc/<pid>/stat
    cleanup <json argv>    a command to run after the ranks are gone (e.g. tear down a private netns
    cluster)
    done                   every rank was reaped by the launcher: exit without touching anything

End of input without ``done`` means the launcher is gone (the kernel closes its end of the pipe
however it died): SIGTERM every rank's process group, SIGKILL what is left after the grace period,
run the cleanup commands. A pipe rather than PR_SET_PDEATHSIG on each rank because the death signal
reaches only the rank itself, not the processes it started (DataLoader workers, a shell's children),
and because it fires when the *thread* that forked the rank exits, not the launcher. Its own
session: a signal to the launcher's process group or terminal (Ctrl-C, SIGHUP on logout) does not
reach it. Standard library only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot): with the pid it names one process,
    not a reuse."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _signal(groups: list[int], sig: int) -> None:
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_orphans(ranks: dict[int, str], grace_s: float) -> None:
    # A group whose leader is alive under another start time is a reused pid: not ours. A group
    # whose leader is gone keeps its id while any member lives (Linux does not hand out an id in use
    # as a pgid).
    groups = [
        pid
        for pid, start in ranks.items()
        if start_time(pid) in (start, None) and _group_alive(pid)
    ]
    _signal(groups, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_group_alive(g) for g in groups):
        time.sleep(0.1)
    _signal(groups, signal.SIGKILL)


def main() -> int:
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)  # only the launcher's pipe decides
    grace_s, ranks, cleanup = 30.0, {}, []
    for line in sys.stdin:
        word, _, rest = line.strip().partition(" ")
        if word == "done":
            return 0
        if word == "grace":
            grace_s = float(rest)
        elif word == "rank":
            pid, start = rest.split()
            ranks[int(pid)] = start
        elif word == "cleanup":
            cleanup.append(json.loads(rest))
    stop_orphans(ranks, grace_s)
    for argv in cleanup:
        subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
