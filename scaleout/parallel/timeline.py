"""A Chrome-trace timeline of backward compute and per-bucket communication, per rank.

What Horovod's timeline (HOROVOD_TIMELINE) gives: for every rank, when backward computed and when
each gradient bucket's all-reduce started and finished, so you can see which communication was
hidden behind compute and which was exposed. The file is the Chrome trace-event JSON format
(``{"traceEvents": [...]}``, complete events ``ph: "X"`` with ``ts``/``dur`` in microseconds); it
opens in https://ui.perfetto.dev and chrome://tracing. ``pid`` is the rank (one track group per
rank, named "rank N"); ``tid`` is the activity: ``backward`` (compute spans), ``comm`` (one span per
bucket all-reduce, from launch to completion; overlapping spans are stacked by the viewer), ``wait``
(time the training loop was blocked on communication after backward = exposed communication).

Timestamps are wall-clock (``time.time()``) so that ranks on one host line up exactly and ranks on
NTP-synchronised hosts line up to the clock skew.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scaleout.world import World

TRACKS = ("backward", "comm", "wait")


def now_us() -> float:
    return time.time() * 1e6


class Timeline:
    """Collects spans of one rank; :meth:`write` (collective) merges every rank's into one file."""

    def __init__(self, path: str | Path, rank: int):
        self.path = Path(path)
        self.rank = rank
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()  # bucket completions are recorded from communication threads

    def span(self, name: str, track: str, start_us: float, end_us: float, **args: Any) -> None:
        ev = {
            "name": name,
            "cat": track,
            "ph": "X",
            "pid": self.rank,
            "tid": TRACKS.index(track) if track in TRACKS else track,
            "ts": round(start_us, 3),
            "dur": round(max(0.0, end_us - start_us), 3),
        }
        if args:
            ev["args"] = args
        with self._lock:
            self.events.append(ev)

    def metadata(self) -> list[dict[str, Any]]:
        meta = [
            {
                "name": "process_name",
                "ph": "M",
                "pid": self.rank,
                "args": {"name": f"rank {self.rank}"},
            }
        ]
        meta += [
            {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": i, "args": {"name": t}}
            for i, t in enumerate(TRACKS)
        ]
        meta.append(
            {
                "name": "process_sort_index",
                "ph": "M",
                "pid": self.rank,
                "args": {"sort_index": self.rank},
            }
        )
        return meta

    def local_trace(self) -> list[dict[str, Any]]:
        with self._lock:
            return self.metadata() + list(self.events)

    def write(self, world: World | None = None) -> Path | None:
        """Write the trace. With a multi-rank ``world`` this is a collective: rank 0 gathers
        every rank's events and writes one merged file at ``path`` (returns it; other ranks
        return None). Without one, each rank writes its own events to ``path``."""
        events = self.local_trace()
        if world is not None and world.world_size > 1:
            import torch.distributed as dist

            gathered: list[Any] | None = [None] * world.world_size if world.rank == 0 else None
            dist.gather_object(events, gathered, dst=0)
            if gathered is None:
                return None
            events = [e for rank_events in gathered for e in rank_events]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        return self.path

    def clear(self) -> None:
        with self._lock:
            self.events.clear()


def load_trace(path: str | Path) -> list[dict[str, Any]]:
    """The span events (``ph == 'X'``) of a trace written by :meth:`Timeline.write`."""
    data = json.loads(Path(path).read_text())
    return [e for e in data["traceEvents"] if e.get("ph") == "X"]
