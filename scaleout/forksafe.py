"""Threads that may be running when a launcher forks a rank from its own process.

A fork copies only the thread that calls it. A lock that another thread held at that moment stays
held in the child forever, so the local launcher forks ranks (launchers/forkrank.py) only when no
other thread runs, or when each one that does is *parked*: it registers here and holds
:func:`busy` whenever it does anything but wait. The forker holds the same lock across ``fork()``,
so such a thread is always between two waits at that moment. The run-directory lease's renewal
thread (scaleout.runlock) is the one in the launcher today.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_parked: set[int] = set()


def park() -> None:
    """The calling thread takes :func:`busy` around all it does but wait (call it first)."""
    _parked.add(threading.get_ident())


def unpark() -> None:
    _parked.discard(threading.get_ident())


@contextlib.contextmanager
def busy() -> Iterator[None]:
    """Held by a parked thread while it works: a fork waits for it to end."""
    with _lock:
        yield


@contextlib.contextmanager
def forking() -> Iterator[None]:
    """Held across ``os.fork()`` (both processes leave it: each releases its own copy)."""
    with _lock:
        yield


def after_fork_in_child() -> None:
    """In the child: the parked threads were not copied."""
    _parked.clear()


def unparked_threads() -> list[threading.Thread]:
    """Threads other than the caller that are neither parked nor finished."""
    me = threading.current_thread()
    return [t for t in threading.enumerate() if t is not me and t.ident not in _parked]
