"""The trainer's one extension point for reporting: a toy Observer, defined here, appended to a
real Trainer, sees every hook in order with typed records; and a normal run installs no
fault-injection hook."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest

from scaleout.train.observe import (
    EvalRecord,
    EvalStart,
    InitEnd,
    Observer,
    RunEnd,
    RunStart,
    RunStop,
    StepRecord,
)

pytestmark = pytest.mark.full_system  # a training run end to end (one rank, in this process)

RUN = [
    "data.source=synthetic",
    "data.eval_samples=8",
    "launch.env=single",
    "train.global_batch=8",
    "train.max_steps=4",
    "train.eval_every=2",
    "train.target=null",
    "train.progress=false",
    "train.metrics=[]",
    "checkpoint.dir=null",
    "checkpoint.every_steps=0",
    "comm.algorithm=flat",
]


class Recorder(Observer):
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def on_init_end(self, init: InitEnd) -> None:
        self.calls.append(("init_end", init))

    def on_run_start(self, start: RunStart) -> None:
        self.calls.append(("run_start", start))

    def on_step(self, record: StepRecord) -> None:
        self.calls.append(("step", record))

    def on_eval_start(self, at: EvalStart) -> None:
        self.calls.append(("eval_start", at))

    def on_eval(self, record: EvalRecord) -> None:
        self.calls.append(("eval", record))

    def on_run_stop(self, stop: RunStop) -> None:
        self.calls.append(("run_stop", stop))

    def on_run_end(self, end: RunEnd) -> None:
        self.calls.append(("run_end", end))


def test_a_toy_observer_sees_the_run_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    from scaleout.config import load_config
    from scaleout.train.trainer import Trainer
    from scaleout.world import init

    monkeypatch.delenv("SCALEOUT_INJECT_NAN", raising=False)
    monkeypatch.delenv("SCALEOUT_TEST_REQUEUE_DELAY_S", raising=False)
    recorder = Recorder()
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config("bert_tiny_cpu", [*RUN, f"train.output_dir={out}"])
        world = init(cfg)
        try:
            trainer = Trainer(cfg, world)
            assert not trainer.injections.active  # a real run: no test-only fault
            trainer.observers.append(recorder)
            result = trainer.train()
        finally:
            world.close()
    names = [name for name, _ in recorder.calls]
    assert names == [
        "init_end",
        "run_start",
        "step",
        "step",
        "eval_start",
        "eval",
        "step",
        "step",
        "eval_start",
        "eval",
        "run_stop",
        "run_end",
    ], names
    steps = [r for name, r in recorder.calls if name == "step"]
    assert [r.step for r in steps] == [1, 2, 3, 4]
    assert [r.samples for r in steps] == [8, 16, 24, 32]
    assert [r.flush for r in steps] == [False, True, False, True]
    evals = [r for name, r in recorder.calls if name == "eval"]
    assert [(r.step, r.continues) for r in evals] == [(2, True), (4, False)]
    end = recorder.calls[-1][1]
    assert result.status == end.status == "max_steps" and result.steps == 4
    assert end.this_run.steps == 4 and end.this_run.samples == 32 and end.weights_consistent
    assert result.report is not None and result.report.steps == 4
    assert trainer.state_dict()["samples"] == 32 and trainer.losses == [r.loss for r in steps]
