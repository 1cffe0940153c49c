"""Named step-time spans: ``with timers("forward"): ...`` accumulated per *sampled* step.

The trainer wraps each phase (data, forward, backward, optimizer) in a span; the report turns the
means into a breakdown table. On CUDA a span must synchronise the device at both ends, otherwise the
wall time only measures kernel *launches* (asynchronous) and attributes the real cost to whichever
span happens to block next. Synchronising costs what it measures: the host stops running ahead of
the device, which at small per-GPU batches is a real slowdown. So the breakdown is *sampled*: only
every ``every``-th step (``train.timing_every``, counted from the first timed step) opens spans and
synchronises; on the other steps a span is a no-op. The report gives both the plain step time (every
step, no instrumentation: the trainer's own wall clock) and the sampled breakdown, with the sampled
steps' own mean step time. "exposed_comm" times only the wait on the reducer's handles after
backward, not the all-reduces that overlap with it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from scaleout.telemetry.profiler import prange

# The order of the step-time breakdown in the report.
PHASES = ("data", "forward", "backward", "comm", "optimizer")


class Timers:
    """Accumulates seconds per named span over sampled steps (``begin()`` decides, ``step()``
    closes)."""

    def __init__(self, device: Any = None, sync: bool | None = None, every: int = 1):
        import torch

        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.sync = (self.device.type == "cuda") if sync is None else sync
        self.every = max(1, int(every))
        self.totals: dict[str, float] = {}
        self.current: dict[str, float] = {}
        self.steps = 0  # sampled steps closed
        self.step_seconds = 0.0  # wall time of the sampled steps (with their synchronisation)
        self.seen = 0  # steps begun since the last reset
        self.sampled = True

    def begin(self) -> bool:
        """Start a step; returns whether it is sampled (its spans synchronise and count)."""
        self.sampled = self.seen % self.every == 0
        self.seen += 1
        return self.sampled

    def _synchronize(self) -> None:
        if self.sync:
            import torch

            torch.cuda.synchronize(self.device)

    def __call__(self, name: str) -> contextlib.AbstractContextManager[None]:
        # unsampled: no timing and no synchronisation, but still a profiler range when one records
        return self._span(name) if self.sampled else prange(f"phase.{name}")

    @contextmanager
    def _span(self, name: str) -> Iterator[None]:
        self._synchronize()
        t0 = time.perf_counter()
        try:
            with prange(f"phase.{name}"):  # a torch.profiler range too, when train.profile records
                yield
        finally:
            self._synchronize()
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        """Add an externally measured span (e.g. a reducer's exposed wait); ignored on unsampled
        steps."""
        if self.sampled:
            self.current[name] = self.current.get(name, 0.0) + seconds

    def step(self, seconds: float | None = None) -> dict[str, float]:
        """Close the current step (``seconds``: its wall time); returns its spans ({} when
        unsampled)."""
        done, self.current = self.current, {}
        if not self.sampled:
            return {}
        for k, v in done.items():
            self.totals[k] = self.totals.get(k, 0.0) + v
        self.steps += 1
        self.step_seconds += seconds or 0.0
        return done

    def mean(self) -> dict[str, float]:
        """Mean seconds per sampled step of each span."""
        return {k: v / max(self.steps, 1) for k, v in self.totals.items()}

    def mean_step(self) -> float:
        """Mean wall time of the sampled steps (compare with the plain step time to see their
        cost)."""
        return self.step_seconds / max(self.steps, 1)

    def reset(self) -> None:
        self.totals.clear()
        self.current.clear()
        self.steps, self.step_seconds, self.seen, self.sampled = 0, 0.0, 0, True

    def state_dict(self) -> dict[str, Any]:
        return {"totals": dict(self.totals), "steps": self.steps, "step_seconds": self.step_seconds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.totals = {str(k): float(v) for k, v in state["totals"].items()}
        self.steps = int(state["steps"])
        self.step_seconds = float(state.get("step_seconds", 0.0))
