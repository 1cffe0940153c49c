"""Named step-time spans: ``with timers("forward"): ...`` accumulated per step.

The trainer wraps each phase (data, forward, backward, comm, optimizer) in a span; the report turns the
totals into a breakdown table. On CUDA a span synchronises the device at both ends, otherwise the wall
time would only measure kernel *launches* (asynchronous) and attribute the real cost to whichever span
happens to block next. "comm" should time only the *exposed* communication: the wait on the reducer's
handles after backward, not the all-reduces that overlap with it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from scaleout.profile import prange

# The order of the step-time breakdown in the report (issue 6 item 5).
PHASES = ("data", "forward", "backward", "comm", "optimizer")


class Timers:
    """Accumulates seconds per named span; ``step()`` closes a step and keeps per-step history."""

    def __init__(self, device: Any = None, sync: bool | None = None):
        import torch

        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.sync = (self.device.type == "cuda") if sync is None else sync
        self.totals: dict[str, float] = {}
        self.current: dict[str, float] = {}
        self.steps = 0

    def _synchronize(self) -> None:
        if self.sync:
            import torch

            torch.cuda.synchronize(self.device)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self._synchronize()
        t0 = time.perf_counter()
        try:
            with prange(f"phase.{name}"):  # a torch.profiler range too, when train.profile records
                yield
        finally:
            self._synchronize()
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        """Add an externally measured span (e.g. a reducer's exposed wait)."""
        self.current[name] = self.current.get(name, 0.0) + seconds

    def step(self) -> dict[str, float]:
        """Close the current step; returns its spans and folds them into the totals."""
        done, self.current = self.current, {}
        for k, v in done.items():
            self.totals[k] = self.totals.get(k, 0.0) + v
        self.steps += 1
        return done

    def mean(self) -> dict[str, float]:
        """Mean seconds per step of each span over the closed steps."""
        return {k: v / max(self.steps, 1) for k, v in self.totals.items()}

    def reset(self) -> None:
        self.totals.clear()
        self.current.clear()
        self.steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"totals": dict(self.totals), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.totals = {str(k): float(v) for k, v in state["totals"].items()}
        self.steps = int(state["steps"])
