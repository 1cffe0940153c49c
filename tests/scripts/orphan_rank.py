"""A rank that starts the prefetcher's forkserver and one worker the way Prefetcher does, prints
their PIDs and sleeps (tests/train/test_prefetch.py kills it with SIGKILL)."""

import time
from multiprocessing import forkserver

from scaleout.train import prefetch


def work() -> None:
    prefetch._worker_init(0, forkserver=True)
    time.sleep(600)


if __name__ == "__main__":
    ctx = prefetch._context("forkserver")
    with prefetch._signals_blocked(prefetch.PREEMPTION_SIGNALS):
        prefetch._warm_forkserver(ctx)
        worker = ctx.Process(target=work, daemon=True)
        worker.start()
    print(forkserver._forkserver._forkserver_pid, worker.pid, flush=True)
    time.sleep(600)
