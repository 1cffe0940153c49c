"""The end of a run cannot hang: every collective in the trainer's ``_finish`` is decided by the
step agreement's flags, never by this rank's own signal state (review gpu-day-two §4)."""

from __future__ import annotations

import os
import signal

import pytest

from tests.distutil import run_dist


def _late_sigterm_on_rank_1(world, out: str) -> dict:
    """A short real run on real gloo ranks; rank 1 gets a real SIGTERM as it enters the end of the
    run (after the last agreement), its peers do not. Both must return."""
    from scaleout.config import load_config
    from scaleout.train.trainer import Trainer
    from tests.train.test_skew import RUN

    cfg = load_config(None, [*RUN, "train.max_steps=2", f"train.output_dir={out}"])
    trainer = Trainer(cfg, world)
    world.set_timeout(30.0, sync=False)  # a mismatched collective fails the test, not CI's clock
    at = trainer._at

    def signalled_at_finish(step: int, phase: str) -> None:
        at(step, phase)
        if phase == "finish" and world.rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler only sets this rank's flag

    trainer._at = signalled_at_finish
    result = trainer.train()
    return {"status": result.status, "code": result.exit_code}


@pytest.mark.multi_process
def test_a_late_sigterm_on_one_rank_does_not_hang_the_end_of_the_run(tmp_path) -> None:
    """Fails on the base commit: rank 1 skipped the end-of-run peak-memory all-reduce on its own
    SIGTERM flag while rank 0 waited in it until the collective timeout."""
    results = run_dist(_late_sigterm_on_rank_1, 1, 2, args=(str(tmp_path),), timeout=90)
    assert [r["status"] for r in results] == ["max_steps", "max_steps"], results
    assert [r["code"] for r in results] == [0, 0], results
