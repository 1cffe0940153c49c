"""A rank-0 progress line: step, loss, throughput, last eval, ETA. Redraws in place on a terminal,
prints every ``every`` steps otherwise (logs, srun output)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, enabled: bool, start: int = 0, every: int = 25):
        self.total, self.enabled, self.start, self.every = total, enabled, start, every
        self.tty = sys.stdout.isatty()
        self.t0 = time.perf_counter()

    def update(self, step: int, loss: float, samples_per_s: float, metric: str = "") -> None:
        if not self.enabled:
            return
        done = step + 1 - self.start
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(done, 1) * (self.total - step - 1)
        width = 24
        filled = int(width * (step + 1) / max(self.total, 1))
        bar = "#" * filled + "." * (width - filled)
        line = (
            f"[{bar}] step {step + 1}/{self.total} loss {loss:.4f} {samples_per_s:,.0f} samples/s"
            # a run stops at the target, usually well before max_steps: an upper bound
            f"{' ' + metric if metric else ''} <= {eta:,.0f}s to max_steps"
        )
        if self.tty:
            sys.stdout.write("\r" + line[:160].ljust(100))
            sys.stdout.flush()
        elif (step + 1) % self.every == 0 or step + 1 == self.total:
            print(line, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stdout.write("\n")
            sys.stdout.flush()
