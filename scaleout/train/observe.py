"""What the trainer tells the world: one :class:`Observer` protocol and the typed records it passes.

The trainer (scaleout/train/trainer.py) holds one list of observers and calls each hook on every one
of them, in order; it never talks to a reporting channel directly. The channels (the MLPerf log, the
metrics file, the progress line, console messages, the profiler, the end-of-run report) are
observers in scaleout/train/observers.py. A new channel is one more class with the hooks it needs:
subclass :class:`Observer` (every hook a no-op) and append it to ``Trainer.observers``.

The order of a run's calls: ``on_init_end`` (all state built; before the barrier that starts the
clock), ``on_run_start`` (the clock runs), ``on_step`` after every step, ``on_eval_start`` /
``on_eval`` around every evaluation, ``on_run_stop`` (the clock stops), ``on_run_end`` (after the
final checkpoint). Collectives: an observer may run one inside ``on_run_end`` only (every rank holds
the same list).

Torch-free on purpose: the records are plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from scaleout.train.skew import StepSkew

# How a run ended. "success": the target was reached; "max_steps": train.max_steps were taken;
# "preempted": every rank agreed to stop on a signal (checkpointed); "aborted": diverged
# (train.max_consecutive_skips); "finished": nothing to do, an earlier run of this directory
# finished.
RunStatus = Literal["success", "max_steps", "preempted", "aborted", "finished"]


def eval_due(steps_done: int, every: int, first: int = 0) -> bool:
    """Evaluate after ``steps_done`` steps? Every ``every`` steps, from step ``first`` on (0: from
    ``every``), as NVIDIA's eval_iter_start_samples / eval_iter_samples in steps."""
    return steps_done >= first and (steps_done - first) % every == 0 and steps_done > 0


def next_eval(steps_done: int, every: int, first: int = 0) -> int:
    """The first step count after ``steps_done`` at which :func:`eval_due` holds."""
    if steps_done < first:
        return first
    return steps_done + every - (steps_done - first) % every


@dataclass(frozen=True)
class InitEnd:
    """Everything is built (and resumed): the end of MLPerf's initialization."""

    benchmark: str  # MLPerf benchmark name of the task ("bert", "resnet")
    hyperparameters: dict[str, Any]  # MLPerf hyper-parameter events (scaleout/train/hparams.py)
    resumed_from: int | None  # the checkpoint's step, None for a fresh start
    steps_per_epoch: int = 1  # optimizer steps per pass over the training set
    train_set_size: int | None = None  # samples in the training set (ResNet's train_samples)


@dataclass(frozen=True)
class RunStart:
    """The clock started (MLPerf run_start): all ranks passed the barrier."""

    start_step: int  # the first step this run takes (a resumed run starts at its checkpoint's)
    samples: int  # samples trained before this run (a resumed run's checkpoint)
    epoch: int  # MLPerf's epoch of ``samples``


@dataclass(frozen=True)
class StepRecord:
    """One finished optimizer step, with every rank's agreed outcome."""

    step: int  # steps done, counting this one (from 1)
    samples: int  # samples trained in total, this step included
    loss: float | None  # mean over ranks
    lr: float  # the learning rate this step used
    seconds: float  # wall time of the step
    step_samples: int  # samples in this step's global batch
    step_tokens: int = 0  # real (non-padding) tokens of the global batch; 0 for images
    breakdown_s: dict[str, float] = field(default_factory=dict)  # {} on unsampled steps
    skipped: bool = False  # non-finite gradients on some rank: every rank skipped the update
    stop: bool = False  # every rank agreed to stop (preemption): the run checkpoints and ends
    terminate: bool = False  # the stop comes from a SIGTERM (not only a notice)
    flush: bool = False  # the last step, an evaluation step or a stop: write what accumulated
    skew: StepSkew | None = None  # phase times over the ranks (scaleout/train/skew.py)
    # wall time of the step ``skew`` describes: the step before, when the agreement went out
    # with this step's last gradient bucket (its phase times were not all known yet); None: this
    skew_seconds: float | None = None

    @property
    def samples_per_s(self) -> float:
        return self.step_samples / max(self.seconds, 1e-9)


@dataclass(frozen=True)
class EvalStart:
    step: int  # steps done
    samples: int
    epoch: int


@dataclass(frozen=True)
class EvalRecord:
    step: int  # steps done
    samples: int
    epoch: int
    metric: str  # its name (the task's metric_name)
    value: float
    target: float | None
    continues: bool  # training goes on after it (neither the target nor max_steps was reached)


@dataclass(frozen=True)
class RunStop:
    """The clock stopped (MLPerf run_stop)."""

    status: RunStatus
    time_to_train_s: float
    samples: int  # in total (a resumed run's included)
    eval_samples: int  # the evaluation set's size
    reason: str = ""  # why a run stopped early, one line ("" when it did not)


@dataclass(frozen=True)
class Throughput:
    """Totals over a span of steps."""

    steps: int = 0
    samples: int = 0
    tokens: int = 0
    seconds: float = 0.0
    flops: float = 0.0

    def plus(self, samples: int, tokens: int, seconds: float, flops: float = 0.0) -> Throughput:
        return Throughput(
            self.steps + 1,
            self.samples + samples,
            self.tokens + tokens,
            self.seconds + seconds,
            self.flops + flops,
        )


@dataclass(frozen=True)
class RunEnd:
    """After the final checkpoint: what the run's report needs."""

    status: RunStatus
    time_to_train_s: float
    this_run: Throughput  # every step of this run (a resumed run's own, not the checkpoint's)
    timed: Throughput  # the steps after train.timing_skip_steps
    metric: float | None  # the last evaluation's value
    skipped: int  # steps skipped in total (non-finite gradients)
    resumed_from: int | None
    run_id: str | None
    weights_consistent: bool | None  # None: not checked (a peer may be gone)
    terminating: bool  # an agreed SIGTERM (every rank alike): leave out optional collectives
    goodput: dict[str, Any] | None = (
        None  # report.json's goodput (scaleout.telemetry.report.goodput_section)
    )
    # the ranks the replica vote found odd (scaleout.train.replicas); empty: none named
    odd_ranks: list[int] = field(default_factory=list)
    comm_auto: dict[str, Any] | None = None  # comm.algorithm=auto's decision (parallel/autotune.py)
    # more top-level sections of report.json: untimed_start (scaleout.telemetry.startup), gc
    sections: dict[str, Any] = field(default_factory=dict)


class Observer:
    """The hooks the trainer calls; each a no-op here, so an observer overrides only what it
    uses."""

    def on_init_end(self, init: InitEnd) -> None:
        pass

    def on_run_start(self, start: RunStart) -> None:
        pass

    def on_step(self, record: StepRecord) -> None:
        pass

    def on_eval_start(self, at: EvalStart) -> None:
        pass

    def on_eval(self, record: EvalRecord) -> None:
        pass

    def on_run_stop(self, stop: RunStop) -> None:
        pass

    def on_run_end(self, end: RunEnd) -> None:
        pass
