"""The untimed start of a run, split: from the allocation to MLPerf's ``run_start`` (report.json's
``untimed_start``), beside MLPerf's clock from ``run_start`` to the target.

MLPerf times ``run_start`` -> ``run_stop`` only. What comes before is paid for by the allocation
and, at record scale, is 13-17x the timed run (NVIDIA's BERT on 3,472 H100: 94 s from
``init_start`` to ``run_start`` against 7.1 s timed): the planner counts it
(scaleout.sim.startup), and this is the measurement to check that model against.

Phases, each the wall time from the previous mark (unix clock, this rank):

- ``launch``: the allocation (Slurm's ``SLURM_JOB_START_TIME``) or the local launcher's spawn
  (``SCALEOUT_LAUNCH_UNIX``) to this process's start: scheduler, container, interpreter;
- ``imports``: the process's start to the first line of the training entry point;
- ``rendezvous``: the World: the store, the process groups (``scaleout.init``);
- ``model_and_data``: the model build and the data set's index and packing (the task);
- ``communicators``: the gradient reducer or sharded optimizer, their first collectives (the
  weights' broadcast, link exchange);
- ``checkpoint``: the resume load (0 for a new run);
- ``to_run_start``: the all-reduce probe (``comm.algorithm=auto``), MLPerf's ``init_stop``, the
  garbage collector's freeze and the barrier before ``run_start``.

torch.compile and CUDA-graph capture are lazy here (scaleout/train/capture.py: the first steps of
each shape warm up and capture): they run after ``run_start``, inside MLPerf's clock, so they are
in ``time_to_train_s`` and not in this split.

``init_start`` (MLPerf's) falls after ``rendezvous``: ``to_init_start_s`` is the part of the start
that no MLPerf log shows.
"""

from __future__ import annotations

import os
import time
from typing import Any

PHASES = (
    "launch",
    "imports",
    "rendezvous",
    "model_and_data",
    "communicators",
    "checkpoint",
    "to_run_start",
)
# Where the allocation's or the launch's start comes from, in order (unix seconds).
LAUNCH_VARS = ("SLURM_JOB_START_TIME", "SCALEOUT_LAUNCH_UNIX")
# A process's start read from /proc is up to 1 s early (the boot time there is whole seconds), so a
# launch up to this much after it is the same moment, not a clock skewed between hosts.
SLACK_S = 2.0


def launch_unix(env: dict[str, str] | None = None, before: float | None = None) -> float | None:
    """The allocation's (or the launcher's) start, if a launcher says it and it is not after
    ``before`` (+ :data:`SLACK_S`; a clock skewed between hosts would make the launch negative)."""
    env = os.environ if env is None else env
    for name in LAUNCH_VARS:
        try:
            t = float(env.get(name, ""))
        except ValueError:
            continue
        if t > 0 and (before is None or t <= before + SLACK_S):
            return t
    return None


class StartClock:
    """Marks the untimed start's phases on one rank; ``section()`` is report.json's
    ``untimed_start``."""

    def __init__(self, process_start: float, entry: float | None = None) -> None:
        self.process_start = process_start
        self.launched = launch_unix(before=process_start)
        self.marks: dict[str, float] = {}
        self.last = process_start
        self.mark("imports", entry)

    def mark(self, phase: str, now: float | None = None) -> None:
        """The phase ``phase`` ends now (seconds add up when a phase is marked twice)."""
        now = time.time() if now is None else now
        self.marks[phase] = self.marks.get(phase, 0.0) + max(now - self.last, 0.0)
        self.last = now

    def section(self, run_start: float, init_start: float | None = None) -> dict[str, Any]:
        """The split up to ``run_start`` (unix): phases in order, their total, and the part
        before MLPerf's ``init_start``."""
        self.mark("to_run_start", run_start)
        phases: dict[str, float | None] = {p: 0.0 for p in PHASES}
        phases["launch"] = None
        if self.launched:
            phases["launch"] = max(self.process_start - self.launched, 0.0)
        phases.update((k, round(v, 4)) for k, v in self.marks.items())
        start = min(self.launched or self.process_start, self.process_start)
        return {
            "phases_s": phases,
            "total_s": run_start - start,
            "to_init_start_s": (init_start - start) if init_start else None,
            "from": "allocation" if self.launched else "process start (launch time unknown)",
        }


def describe(section: dict[str, Any], time_to_train_s: float) -> str:
    """One line: the untimed start, its phases, and MLPerf's clock after it."""
    parts = [
        f"{k.replace('_', ' ')} {v:.2f}"
        for k, v in section["phases_s"].items()
        if v is not None and v >= 0.005
    ]
    total = section["total_s"]
    return (
        f"untimed start: {total:.2f} s from the {section['from']} to run_start "
        f"({', '.join(parts)} s), then time to train {time_to_train_s:.2f} s "
        f"(launch to target {total + time_to_train_s:.2f} s)"
    )
