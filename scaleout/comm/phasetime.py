"""Per-rank time of the row and column phases of the row x column all-reduce, per step, for the
straggler attribution (scaleout/train/skew.py: ``intra`` and ``inter_allreduce``).

The row phases (reduce-scatter and all-gather along a node's ranks, or a torus row) and the column
phase (the all-reduce of each shard among the same-local-rank peers of every node, or a torus
column) of :mod:`scaleout.comm.grid` and the sharded optimizer's two-phase reduce-scatter /
all-gather (:mod:`scaleout.comm.shard`) add their time here while :data:`CLOCK` is enabled (the
trainer enables it when the step's agreement carries phase times); :meth:`PhaseClock.take` returns
the seconds since the last take and starts the next step's.

* gloo (host-synchronous work): ``time.perf_counter`` around the host's waits. In the chunk
  pipeline the column phase is the time spent waiting for column all-reduces, the row phases the
  rest of the schedule (posting, waiting for the point-to-point row transfers, the adds), so the
  two add up to the schedule's wall time.
* NCCL (on the comm stream, the host never waits): timing CUDA events recorded on the comm stream
  between the phases, read **one step late**: a take reads the events recorded before the previous
  take, which that step's agreement (its one host read, after the compute stream waited for the
  comm stream) has completed, so ``elapsed_time`` never blocks; an event not yet complete is
  dropped, never waited for. No events are recorded while a stream is being captured into a CUDA
  graph (timing events cannot be captured).

The flat algorithm is one torch.distributed collective over every rank: its intra- and inter-node
hops interleave inside gloo's or NCCL's ring, so it has no phases to time (its wait is the step's
``sync_wait``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

ROW, COL = 0, 1  # the intra-node (row) phases, the inter-node (column) phase


class PhaseClock:
    """Seconds per phase kind (:data:`ROW`, :data:`COL`) accumulated since the last :meth:`take`
    (module docstring). Thread-safe: the communication thread adds, the trainer takes."""

    def __init__(self) -> None:
        self.enabled = False
        self._lock = threading.Lock()
        self._host = [0.0, 0.0]
        self._spans: list[tuple[int, Any, Any]] = []  # CUDA (kind, start, end) since the last take
        self._late: list[tuple[int, Any, Any]] = []  # ... recorded before the last take
        self._pool: list[Any] = []

    def add(self, kind: int, seconds: float) -> None:
        with self._lock:
            self._host[kind] += seconds

    @contextmanager
    def timed(self, kind: int) -> Iterator[None]:
        """Host wall time of the block (gloo, blocking)."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(kind, time.perf_counter() - t)

    def mark(self, device: torch.device) -> Any:
        """A timing event recorded now on the current (comm) stream, or None while capturing."""
        if _capturing():
            return None
        with self._lock:
            event = self._pool.pop() if self._pool else None
        if event is None:
            event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    def span(self, kind: int, start: Any, end: Any) -> None:
        """Time from ``start`` to ``end`` (two :meth:`mark` events) belongs to ``kind``."""
        if start is not None and end is not None:
            with self._lock:
                self._spans.append((kind, start, end))

    def take(self) -> tuple[float, float]:
        """(row seconds, column seconds) of the step: the host time since the last take, plus on
        CUDA the events of the step before (module docstring). Never blocks on the device."""
        with self._lock:
            out, self._host = self._host, [0.0, 0.0]
            ready, self._late, self._spans = self._late, self._spans, []
        free = []
        for kind, start, end in ready:
            if end.query() and start.query():
                out[kind] += start.elapsed_time(end) / 1e3
                free += [start, end]
        with self._lock:
            self._pool.extend(free[: 256 - len(self._pool)])
        return out[ROW], out[COL]

    def reset(self) -> None:
        with self._lock:
            self._host, self._spans, self._late = [0.0, 0.0], [], []


def _capturing() -> bool:
    """A stream of this thread is being captured into a CUDA graph."""
    if not torch.cuda.is_available():
        return False
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except (RuntimeError, AttributeError):  # a build or an emulation without the query
        return False


CLOCK = PhaseClock()  # one per process: a process trains on one World
