"""Helper processes that end with the rank that started them.

The forkserver, the resource tracker and the workers run with the preemption signals blocked
(prefetch.py), so when a rank dies by SIGKILL (OOM killer, a failed step's cleanup, Slurm's
KillWait) nothing tells them: the forkserver is reparented to init and it and its workers live on,
holding memory, file handles and pinned pages on a node the next step may reuse (seen on the local
Slurm, whose proctrack/linuxproc loses reparented processes; a cgroup proctrack would catch them).
``PR_SET_PDEATHSIG`` makes the kernel SIGKILL this process when the thread that started it exits;
the workers do the same in their init (:func:`die_with_parent`), so the chain rank -> forkserver
-> workers ends with the rank. Linux only; elsewhere a no-op."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGKILL this process when its parent (thread) exits; exit now if it already has."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return  # best effort: a kernel that refuses leaves the old behaviour
    if parent == 1 or os.getppid() != parent:  # the parent died before the prctl
        os._exit(0)
