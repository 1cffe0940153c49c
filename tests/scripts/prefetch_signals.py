"""Prefetch workers under the scheduler's signals: run in a process group of its own, signal the
whole group (as Slurm does every process of a step), then keep reading batches.

python tests/scripts/prefetch_signals.py [forkserver|spawn|fork]

Prints one JSON line: which helper processes are still alive, what the rank's guard saw, how many
batches it read after the signals. Used by tests/goodput/test_preempt_slurm.py.
"""

from __future__ import annotations

import json
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
import sys
import time

import torch

from scaleout.data.batches import MicroBatch
from scaleout.goodput import preempt
from scaleout.train.prefetch import Prefetcher


class SlowSource:
    """A data source whose batches take a while, so the signals land while workers are building
    them."""

    def micro_batches(self, position: int, grad_accum: int) -> list[MicroBatch]:
        time.sleep(0.2)
        return [MicroBatch(torch.full((2,), float(position)), torch.zeros(1), 1, 0)]


def alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except OSError:
        return False


def main() -> int:
    method = sys.argv[1] if len(sys.argv) > 1 else "forkserver"
    guard = preempt.install()
    pf = Prefetcher(
        SlowSource(),
        global_batch=1,
        grad_accum=1,
        start_step=0,
        stop_step=12,
        num_workers=2,
        prefetch=2,
        start_method=method,
    )
    pf.get(0)
    helpers = {f"worker{i}": w.pid for i, w in enumerate(pf._it._workers)}
    if method == "forkserver":
        helpers["forkserver"] = multiprocessing.forkserver._forkserver._forkserver_pid
    helpers["resource_tracker"] = multiprocessing.resource_tracker._resource_tracker._pid
    for sig in (signal.SIGUSR2, signal.SIGTERM):  # the notice, then the time limit's SIGTERM
        os.killpg(0, sig)
        time.sleep(0.5)
    read, error = 0, None
    try:
        for step in range(1, 12):
            mbs = pf.get(step)
            assert float(mbs[0].inputs[0]) == step
            read += 1
    except Exception as exc:  # noqa: BLE001 -- reported, the test asserts on it
        error = f"{type(exc).__name__}: {exc}"
    print(
        json.dumps(
            {
                "alive": {k: alive(v) for k, v in helpers.items()},
                "noticed": guard.noticed,
                "terminating": guard.terminating,
                "read": read,
                "error": error,
            }
        ),
        flush=True,
    )
    pf.close()
    guard.uninstall()
    return 0


if __name__ == "__main__":
    sys.exit(main())
