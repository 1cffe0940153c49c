"""Failed collectives, crash and verdict records, and fault injection for tests.

A failed or hung collective becomes one line naming the rank (:func:`exit_on_comm_failure`); a
rank's crash and the replicas' vote are left for ``scaleout slurm run`` (:func:`write_crash`,
:func:`write_replica_vote`). The test-only injections sit behind one :class:`Injections`, built from
their variables at the start of a run. The per-step agreement between ranks is
:mod:`scaleout.train.agreement`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Self

import torch
import torch.distributed as dist

from scaleout.comm.handles import CommFailed
from scaleout.errors import UserError
from scaleout.fsutil import atomic_write
from scaleout.goodput.preempt import Preemption
from scaleout.goodput.verdict import verdict_line
from scaleout.train.liveness import PHASES as PROGRESS_PHASES
from scaleout.train.liveness import describe_rank, unresponsive
from scaleout.world import World


# -- fault injection for tests: installed at the start of a run only when its variable is set
# -----------
class StepInjection:
    """A test-only fault a rank injects at given steps: ``$VARIABLE="STEP:RANK[,STEP:RANK...]"``
    (steps 0-based). Applied to the reduced gradients (:meth:`Injections.damage_gradients`) between
    unscaling and the step's agreement; subclasses say what the fault is."""

    VARIABLE = ""

    def __init__(self, steps: set[int]):
        self.steps = steps

    @classmethod
    def from_env(cls, rank: int, env: Mapping[str, str] | None = None) -> Self | None:
        spec = (os.environ if env is None else env).get(cls.VARIABLE, "")
        steps = set()
        for item in filter(None, spec.split(",")):
            step, _, at = item.partition(":")
            if at == str(rank):
                steps.add(int(step))
        return cls(steps) if steps else None

    def __call__(self, step: int, params: list[torch.nn.Parameter]) -> None:
        if step in self.steps:
            self.inject(step, params)

    def inject(self, step: int, params: list[torch.nn.Parameter]) -> None:
        raise NotImplementedError


class NanInjection(StepInjection):
    """``SCALEOUT_INJECT_NAN``: this rank's loss is NaN at the step, so are its gradients before
    the reduction (a bad batch, an overflow): the all-reduce carries the NaN to every rank and
    every rank skips the step (tests/train/test_train.py, test_faults.py, test_precision.py). Not a
    gradient hook: the trainer multiplies the step's loss (:meth:`poison`)."""

    VARIABLE = "SCALEOUT_INJECT_NAN"

    def poison(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * float("nan") if step in self.steps else loss


class ReducedNanInjection(StepInjection):
    """``SCALEOUT_INJECT_NAN_REDUCED``: one NaN in this rank's gradients *after* the reduction,
    where the others' are finite (a corrupted copy). With the replicated optimizer each rank
    decides "non-finite" from its own reduced gradients, so this rank alone skips; the steps
    skipped so far go into the next agreement's fingerprint, which names it
    (:class:`~scaleout.train.skew.CollectiveDesync`, tests/train/test_faults.py). With the sharded
    LAMB the agreement's flag makes every rank skip."""

    VARIABLE = "SCALEOUT_INJECT_NAN_REDUCED"

    def inject(self, step: int, params: list[torch.nn.Parameter]) -> None:
        params[0].grad.view(-1)[0] = float("nan")


class CorruptInjection(StepInjection):
    """``SCALEOUT_INJECT_CORRUPT``: add 1e-3 to one element of this rank's reduced gradient, a
    finite silent corruption (a bad GPU's) that no agreement sees: this replica drifts from the
    others and the end-of-run replica vote (scaleout.train.replicas) names it."""

    VARIABLE = "SCALEOUT_INJECT_CORRUPT"

    def inject(self, step: int, params: list[torch.nn.Parameter]) -> None:
        params[0].grad.view(-1)[0] += 1e-3


class HangInjection:
    """``SCALEOUT_TEST_HANG="STEP:RANK:PHASE[:stop][,...]"``: this rank stops making progress when
    it enters PHASE (scaleout.train.liveness PHASES: data, forward, ...) of step STEP (0-based):
    it sleeps forever, its heartbeat thread still beating (an alive rank stuck in its data loader
    or in a forward that never ends: the case a stopped heartbeat cannot name), or with ``:stop``
    it SIGSTOPs itself (a frozen process or node: no heartbeat either). Called at the trainer's
    phase marks (``Trainer._at``); tests/train/test_faults.py drives both."""

    VARIABLE = "SCALEOUT_TEST_HANG"

    def __init__(self, points: dict[tuple[int, str], bool]):
        self.points = points  # (step, phase) -> SIGSTOP (else sleep)

    @classmethod
    def from_env(cls, rank: int, env: Mapping[str, str] | None = None) -> HangInjection | None:
        spec = (os.environ if env is None else env).get(cls.VARIABLE, "")
        points = {}
        for item in filter(None, spec.split(",")):
            step, at, phase, *how = item.split(":") + ([] if item.count(":") >= 2 else ["", ""])
            if (
                phase not in PROGRESS_PHASES
                or not step.isdigit()
                or not at.isdigit()
                or how not in ([], ["stop"])
            ):
                raise UserError(
                    f"{cls.VARIABLE}={spec!r}: expected STEP:RANK:PHASE or STEP:RANK:PHASE:stop "
                    f"with PHASE one of {', '.join(PROGRESS_PHASES)}"
                )
            if int(at) == rank:
                points[(int(step), phase)] = how == ["stop"]
        return cls(points) if points else None

    def __call__(self, step: int, phase: str) -> None:
        stop = self.points.get((step, phase))
        if stop is None:
            return
        sys.stdout.flush()
        if stop:
            os.kill(os.getpid(), signal.SIGSTOP)
        while True:  # until the launcher's SIGKILL
            time.sleep(3600)


class DelayInjection:
    """``SCALEOUT_TEST_DELAY="RANK:PHASE:MS[,...]"``: this rank sleeps MS milliseconds in every
    step's PHASE (``data``: while waiting for its batches; ``compute``: in its forward, a slow
    device as scaleout.train.devicetime times it), a straggler for tests/train/test_skew.py and
    `scaleout bench agreement`. Test-only: a real run leaves the variable unset and installs
    nothing."""

    VARIABLE = "SCALEOUT_TEST_DELAY"
    PHASES = ("data", "compute")

    def __init__(self, seconds: dict[str, float]):
        self.seconds = seconds

    @classmethod
    def from_env(cls, rank: int, env: Mapping[str, str] | None = None) -> DelayInjection | None:
        spec = (os.environ if env is None else env).get(cls.VARIABLE, "")
        seconds: dict[str, float] = {}
        for item in filter(None, spec.split(",")):
            at, phase, ms = (item.split(":") + ["", ""])[:3]
            if phase not in cls.PHASES or not at.isdigit():
                raise UserError(
                    f"{cls.VARIABLE}={spec!r}: expected RANK:PHASE:MS items with PHASE one of "
                    f"{', '.join(cls.PHASES)}, got {item!r}"
                )
            if int(at) == rank:
                seconds[phase] = seconds.get(phase, 0.0) + float(ms) / 1e3
        return cls(seconds) if seconds else None

    def __call__(self, phase: str) -> None:
        if phase in self.seconds:
            time.sleep(self.seconds[phase])


class RequeueDelay:
    """``SCALEOUT_TEST_REQUEUE_DELAY_S=N``: rank 0 waits up to N s before ``scontrol requeue``,
    less if its SIGTERM comes first (a stop that outlasted the notice window and met the time
    limit). tests/goodput/test_preempt_slurm.py uses it to show that the other ranks wait for the
    requeue
    under ``srun --kill-on-bad-exit=1``, and that the time limit's SIGTERM after a notice still
    requeues. Passed as ``before_requeue`` to
    :func:`scaleout.goodput.preempt.release_after_stop`."""

    VARIABLE = "SCALEOUT_TEST_REQUEUE_DELAY_S"

    def __init__(self, seconds: float):
        self.seconds = seconds

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RequeueDelay | None:
        raw = (os.environ if env is None else env).get(cls.VARIABLE, "")
        return cls(float(raw)) if raw else None

    def __call__(self, guard: Preemption) -> None:
        deadline = time.monotonic() + self.seconds
        while time.monotonic() < deadline and not guard.terminating:
            time.sleep(0.05)


# Markers of a failed collective in gloo's / c10d's error text (torch 2.13 raises plain
# RuntimeError): a timeout, a peer that closed or reset its connection.
_COMM_MARKERS = (
    "Timed out waiting",
    "Connection closed by peer",
    "Connection reset by peer",
    "gloo/transport",
    "DistBackendError",
    "NCCL error",
)


def is_comm_failure(exc: BaseException) -> bool:
    """A failed collective (timeout, dead peer), as opposed to a bug or bad input."""
    if isinstance(exc, CommFailed | dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _COMM_MARKERS)


def exit_on_comm_failure(world: World, exc: BaseException, code: int = 1) -> None:
    """Print one line naming this rank and the error, then the verdict (the ranks whose heartbeat
    stopped, else the rank that is behind: scaleout/train/liveness.py), then end
    the process at once (``os._exit``): the collective sequence is broken, peers are being
    stopped by the launcher, and an orderly shutdown could block on a group whose peer is gone.
    NCCL's watchdog tears a process down for the same reason (TORCH_NCCL_ASYNC_ERROR_HANDLING=3)."""
    first = next(
        (line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__
    )
    verdict_and_exit(
        world, f"a collective failed (collective timeout {world.timeout_s:g} s): {first}", code
    )


# One verdict per process: a gloo timeout (main thread) and the hang watch
# (scaleout/train/hangwatch.py) can notice the same hang together; the second waits for the first
# to end the process.
_VERDICT_ONCE = threading.Lock()


def verdict_and_exit(world: World, what: str, code: int = 1) -> None:
    """``exit_on_comm_failure``'s body for any way a rank learns of a hang (``what``: one line
    saying how): the line naming this rank, the verdict, its file, then ``os._exit``."""
    if not _VERDICT_ONCE.acquire(blocking=False):
        while True:  # the other caller is writing the verdict and ends the process
            time.sleep(3600)
    print(f"scaleout: {describe_rank(world, world.rank)}: {what}", file=sys.stderr, flush=True)
    verdict, stale = (
        unresponsive(world, world.timeout_s) if world.world_size > 1 else ("single rank", [])
    )
    # the launcher reads this line back (scaleout/goodput/verdict.py) to name the root cause last
    print(verdict_line(describe_rank(world, world.rank), verdict), file=sys.stderr, flush=True)
    write_verdict(world, verdict, stale)
    logging.shutdown()  # flush the MLPerf log and other file handlers
    sys.stdout.flush()
    kill_descendants()
    os._exit(code)


def kill_descendants() -> int:
    """SIGKILL every descendant of this process (the data workers' forkserver and its workers,
    multiprocessing's resource tracker) before an ``os._exit``: they block SIGTERM
    (scaleout/train/prefetch.py), and orphaned they hold the step's stdout/stderr open, so srun
    waits for them (Slurm 22.05 on the local cluster: "Abandoning IO 60 secs after job shutdown"
    on every node) and a step tracked by proctrack/linuxproc never reaps them. Returns how many
    were signalled (Linux /proc; 0 elsewhere)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return 0
    for d in entries:
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d))
    todo, found = [os.getpid()], []
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue
    return len(found)


VERDICT_DIR = "SCALEOUT_VERDICT_DIR"


def write_verdict(
    world: World, text: str, stale: list[int], env: Mapping[str, str] | None = None
) -> None:
    """When ``$SCALEOUT_VERDICT_DIR`` is set (by ``scaleout slurm run``, one folder per attempt),
    leave the hang verdict there as ``rank<r>.json``: {"rank", "node" (this rank's), "stale_ranks",
    "stale_nodes" (node indices = SLURM_NODEID), "text", "time"}. The supervisor maps the node
    indices to hosts and quarantines them; parsing the printed sentence would break with its
    wording."""
    nodes = sorted({world.node_of[r] for r in stale if r < len(world.node_of)})
    _leave(world, {"stale_ranks": stale, "stale_nodes": nodes, "text": text}, env)


def write_crash(world: World, exc: BaseException, env: Mapping[str, str] | None = None) -> None:
    """The same folder, from a rank about to die of an exception of its own (not a failed
    collective): {"rank", "node", "crashed": the error's first line, "time"}. Written before
    anything else, it tells the supervisor the step died of a software error -- the peers'
    verdicts that follow name this rank's node only because its heartbeat ended with it."""
    first = next((x.strip() for x in str(exc).splitlines() if x.strip()), "")
    _leave(world, {"crashed": f"{type(exc).__name__}: {first}"[:300]}, env)


def write_replica_vote(
    world: World, text: str, odd_ranks: list[int], env: Mapping[str, str] | None = None
) -> None:
    """The same folder, from rank 0 after a replica vote named ranks whose weights differ from
    the majority's (:mod:`scaleout.train.replicas`): {"odd_ranks", "odd_nodes" (node indices),
    "text"}, as ``rank0-replicas.json`` (a hang verdict of the same rank is kept)."""
    nodes = sorted({world.node_of[r] for r in odd_ranks if r < len(world.node_of)})
    fields = {"odd_ranks": odd_ranks, "odd_nodes": nodes, "text": text}
    _leave(world, fields, env, suffix="-replicas")


def _leave(world: World, fields: dict, env: Mapping[str, str] | None, suffix: str = "") -> None:
    folder = (os.environ if env is None else env).get(VERDICT_DIR)
    if not folder:
        return
    node = world.node_of[world.rank] if world.rank < len(world.node_of) else None
    record = {"rank": world.rank, "node": node, **fields, "time": time.time()}
    name = f"rank{world.rank}{suffix}.json"
    try:
        atomic_write(os.path.join(folder, name), json.dumps(record))
    except OSError as exc:  # a diagnosis must never be what fails: say so and go on exiting
        print(f"scaleout: cannot write the verdict to {folder}: {exc}", file=sys.stderr)


class CrashInjection(StepInjection):
    """``SCALEOUT_INJECT_CRASH``: this rank raises at those steps, every attempt again: the
    deterministic crash the crash-loop guard of ``scaleout slurm run`` must stop
    (tests/goodput/test_spares_slurm.py)."""

    VARIABLE = "SCALEOUT_INJECT_CRASH"

    def inject(self, step: int, params: list[torch.nn.Parameter]) -> None:
        raise RuntimeError(f"injected crash at step {step} ({self.VARIABLE})")


@dataclass(frozen=True)
class Injections:
    """Every test-only fault of this rank, read once from its variable (:meth:`from_env`); a real
    run sets none, and every field is None. The trainer holds one and asks it by name."""

    nan: NanInjection | None = None  # SCALEOUT_INJECT_NAN: poisons the loss
    reduced_nan: ReducedNanInjection | None = None  # SCALEOUT_INJECT_NAN_REDUCED
    crash: CrashInjection | None = None  # SCALEOUT_INJECT_CRASH
    corrupt: CorruptInjection | None = None  # SCALEOUT_INJECT_CORRUPT
    hang: HangInjection | None = None  # SCALEOUT_TEST_HANG: at a phase mark
    delay: DelayInjection | None = None  # SCALEOUT_TEST_DELAY: a straggler
    requeue_delay: RequeueDelay | None = None  # SCALEOUT_TEST_REQUEUE_DELAY_S (rank 0's requeue)
    # those of the above that act on the reduced gradients, in the order they are applied
    gradient_faults: tuple[StepInjection, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        faults = (self.reduced_nan, self.crash, self.corrupt)
        object.__setattr__(self, "gradient_faults", tuple(f for f in faults if f is not None))

    @classmethod
    def from_env(cls, rank: int, env: Mapping[str, str] | None = None) -> Injections:
        """This rank's injections from their variables (``env``: os.environ)."""
        return cls(
            nan=NanInjection.from_env(rank, env),
            reduced_nan=ReducedNanInjection.from_env(rank, env),
            crash=CrashInjection.from_env(rank, env),
            corrupt=CorruptInjection.from_env(rank, env),
            hang=HangInjection.from_env(rank, env),
            delay=DelayInjection.from_env(rank, env),
            requeue_delay=RequeueDelay.from_env(env),
        )

    @property
    def active(self) -> bool:
        """Whether any injection is set (a real run: False)."""
        return any(getattr(self, f.name) is not None for f in fields(self) if f.init)

    def damage_gradients(self, step: int, params: list[torch.nn.Parameter]) -> None:
        """Apply the gradient faults due at ``step`` to this rank's reduced gradients (between
        unscaling and the step's agreement)."""
        for fault in self.gradient_faults:
            fault(step, params)


# Exit code of a run stopped because it diverged (train.max_consecutive_skips): a plain failure.
EXIT_ABORTED = 1
