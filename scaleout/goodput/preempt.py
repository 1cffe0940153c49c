"""Preemption inside a rank: catch the scheduler's signals, agree on a step, checkpoint, requeue.

The contract a training loop follows (docs/launchers.md, "Preemption"):

    guard = preempt.install()                 # once, first thing: before the World is built
    world = scaleout.init()
    for step in ...:
        train_step()
        if guard.should_stop(world):          # every rank, every step (or every k steps, same k on
        all)
            save_checkpoint()                 # rank 0 writes; all ranks hold the same weights after
            a step
            if guard.wants_requeue and world.rank == 0:
                preempt.requeue()             # `scontrol requeue $SLURM_JOB_ID`, BEFORE the barrier
                below
            world.barrier()                   # releases the other ranks only once the requeue is
            recorded
            return preempt.EXIT_PREEMPTED
    guard.uninstall()

Two kinds of signal, because schedulers send two kinds:
- **notice** (SIGUSR2 by default, from ``#SBATCH --signal=USR2@<s>`` or submitit): the job will be
  killed in ``s`` seconds. Ranks receive it at slightly different moments, so
  :meth:`Preemption.should_stop` all-reduces the flag: every rank stops after the *same* step, rank
  0 checkpoints and requeues. USR2, not USR1: NCCL (and some MPI builds) install their own USR1
  handler.
- **terminate** (SIGTERM: scancel, ``scontrol requeue``, the end of the time limit, node drain): the
  job is being killed now (SIGKILL follows after Slurm's KillWait, 30 s by default); rank 0 saves
  the weights of the last completed step. A requeue by the scheduler brings the job back; the
  trainer resumes from the checkpoint (``SLURM_RESTART_COUNT`` says how many times).

A notice followed by the time limit's SIGTERM (the stop and checkpoint outlasted the notice window)
still requeues: Slurm never requeues a job that ends by its time limit, and ``scontrol requeue`` of
a job that is completing after its limit works (checked on Slurm 22.05: the job came back). A notice
followed by any other SIGTERM (scancel during the stop) does not: :func:`time_limit_reached` tells
them apart.

Why rank 0 requeues *before* the barrier that lets the other ranks exit: the production scripts run
``srun --kill-on-bad-exit=1``, so the first rank to exit 75 makes Slurm kill every other task of the
step; a rank 0 that had not yet run ``scontrol requeue`` would be killed with them and the job would
end instead of coming back. Once the requeue is recorded by slurmctld, how the tasks exit no longer
matters.

Handlers only set flags (async-signal safe in Python's sense: they run between bytecodes of the main
thread). Install them before anything slow (the World's rendezvous can take minutes at scale): a
notice that arrives while a signal still has its default action terminates the process.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

from scaleout.errors import UserError
from scaleout.log import print0

if TYPE_CHECKING:
    from scaleout.world import World

# The process exit code after a clean preemption stop (checkpoint written). EX_TEMPFAIL from
# sysexits.h: "temporary failure, the user is invited to retry" -- distinct from success and from a
# crash.
EXIT_PREEMPTED = 75

DEFAULT_NOTICE = "USR2"


def signal_from_name(name: str) -> signal.Signals:
    """'USR2', 'SIGUSR2' or '12' -> signal.SIGUSR2; a one-line UserError otherwise."""
    text = name.strip().upper()
    if text.isdigit():
        try:
            return signal.Signals(int(text))
        except ValueError:
            pass
    else:
        full = text if text.startswith("SIG") else "SIG" + text
        if hasattr(signal.Signals, full):
            return signal.Signals[full]
    raise UserError(
        f"preemption signal {name!r}: expected a signal name such as USR2, USR1, TERM or a number"
    )


class Preemption:
    """Signal flags for one training run. Create with :func:`install`."""

    def __init__(self, notice: Sequence[signal.Signals], terminate: Sequence[signal.Signals]):
        self.notice_signals = tuple(notice)
        self.terminate_signals = tuple(terminate)
        self.received: signal.Signals | None = None
        self.noticed = False
        self.terminating = False
        self._previous: dict[signal.Signals, Any] = {}

    def _handler(self, signum: int, _frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        self.received = sig
        if sig in self.terminate_signals:
            self.terminating = True
        else:
            self.noticed = True

    def _install(self) -> Preemption:
        for sig in (*self.notice_signals, *self.terminate_signals):
            self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def uninstall(self) -> None:
        """Put the previous handlers back (e.g. submitit's own, after training returns)."""
        for sig, prev in self._previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        """This rank has received a notice or a terminate signal."""
        return self.noticed or self.terminating

    @property
    def wants_requeue(self) -> bool:
        """True once a notice was received, even if SIGTERM followed: a time limit's SIGTERM
        after the notice must not cancel the requeue (Slurm does not requeue a TIMEOUT). SIGTERM
        alone: the scheduler decides (``scontrol requeue`` from outside has already requeued;
        ``scancel`` means stop)."""
        return self.noticed

    def should_stop(self, world: World | None = None) -> bool:
        """True on every rank once any rank was signalled (a collective: call it at the same step
        everywhere).

        Under SIGTERM the answer is local and immediate: a collective could hang on a rank that is
        already dead. Without a world (or with one rank) the local flag is the answer.
        """
        if self.terminating or world is None or getattr(world, "world_size", 1) == 1:
            return self.requested
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1.0 if self.noticed else 0.0], device=world.device)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        except RuntimeError:
            # A peer that got the scheduler's SIGTERM first answers locally and leaves; ours may
            # still be on its way (Slurm signals all tasks, not at the same instant). Stop if it
            # comes; else re-raise.
            if self.peer_lost():
                return True
            raise
        if flag.item() > 0:
            self.noticed = True
        return self.requested

    def peer_lost(self, grace_s: float = 5.0) -> bool:
        """After a collective failed because a peer left: wait up to ``grace_s`` for this rank's
        own terminate signal; True if it came (a preemption, stop cleanly), False if not (a real
        failure)."""

        deadline = time.monotonic() + grace_s
        while not self.terminating and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.terminating

    def __enter__(self) -> Preemption:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


def install(
    notice: str | Sequence[str] | None = None, terminate: Sequence[str] = ("TERM",)
) -> Preemption:
    """Install flag-setting handlers. ``notice`` defaults to $SCALEOUT_PREEMPT_SIGNAL or USR2."""
    if notice is None:
        notice = os.environ.get("SCALEOUT_PREEMPT_SIGNAL", DEFAULT_NOTICE)
    names = [notice] if isinstance(notice, str) else list(notice)
    notice_sigs = [signal_from_name(n) for n in names if n]
    term_sigs = [signal_from_name(n) for n in terminate]
    clash = set(notice_sigs) & set(term_sigs)
    if clash:
        raise UserError(
            f"signal {sorted(s.name for s in clash)} cannot be both a notice and a terminate signal"
        )
    return Preemption(notice_sigs, term_sigs)._install()


def slurm_job_id(env: Mapping[str, str] | None = None) -> str | None:
    """The job to requeue: for an array task its own id (SLURM_JOB_ID), not the array's."""
    env = os.environ if env is None else env
    return env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or None


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How many times Slurm has requeued this job (0 on the first run)."""
    env = os.environ if env is None else env
    value = env.get("SLURM_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def _slurm_seconds(text: str) -> int | None:
    """Slurm durations: ``[D-]HH:MM:SS``, ``MM:SS`` or ``MM`` -> seconds; UNLIMITED and the like
    -> None."""
    days, _, clock = text.rpartition("-")
    parts = clock.split(":")
    if not (days.isdigit() or days == "") or not all(p.isdigit() for p in parts) or len(parts) > 3:
        return None
    if len(parts) == 1:  # minutes
        parts = [parts[0], "0"]
    seconds = 0
    for p in parts:
        seconds = seconds * 60 + int(p)
    return seconds + int(days or 0) * 86400


def time_limit_reached(
    env: Mapping[str, str] | None = None, timeout_s: float = 30.0, tries: int = 3
) -> bool:
    """True when this Slurm job has run for its whole time limit (``scontrol show job``: RunTime >=
    TimeLimit).

    Tells the time limit's SIGTERM (requeue after a notice: Slurm never requeues a TIMEOUT) from
    a scancel, a drain or an outside ``scontrol requeue`` (the scheduler or the user decided: do
    not requeue). Outside a job: False. When slurmctld does not answer (a loaded controller times
    out exactly when many jobs end), it asks ``tries`` times and then answers True: after a
    notice the time limit is by far the likelier cause, and a job that was cancelled is not
    requeued by Slurm anyway."""

    job = slurm_job_id(env)
    scontrol = shutil.which("scontrol")
    if job is None or scontrol is None:
        return False
    for attempt in range(tries):
        try:
            proc = subprocess.run(
                [scontrol, "show", "job", "-o", job],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            proc = None
        fields = dict(
            part.split("=", 1) for part in (proc.stdout if proc else "").split() if "=" in part
        )
        run, limit = (
            _slurm_seconds(fields.get("RunTime", "")),
            _slurm_seconds(fields.get("TimeLimit", "")),
        )
        if run is not None and "TimeLimit" in fields:
            return limit is not None and run >= limit  # limit None: UNLIMITED
        if fields.get("Reason") == "TimeLimit" or fields.get("JobState") == "TIMEOUT":
            return True
        if attempt + 1 < tries:
            time.sleep(min(2.0 * (attempt + 1), 5.0))
    print(
        f"scontrol show job {job} did not answer ({tries} tries): taking the SIGTERM for the time "
        "limit",
        file=sys.stderr,
        flush=True,
    )
    return True


def requeue(env: Mapping[str, str] | None = None, timeout_s: float = 30.0) -> bool:
    """Ask Slurm to requeue this job (call from rank 0 only, after the checkpoint is on disk).

    Returns False when not inside a Slurm job (nothing to requeue: the caller just exits). The job
    must be requeueable (``#SBATCH --requeue``; submitit sets it). Slurm then kills every task
    (SIGTERM, then SIGKILL after KillWait), puts the job back in the queue and restarts the batch
    script with SLURM_RESTART_COUNT + 1; the new run resumes from the checkpoint.
    """
    job = slurm_job_id(env)
    if job is None:
        return False
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        raise UserError(f"cannot requeue Slurm job {job}: scontrol is not on PATH in this task")
    proc = subprocess.run(
        [scontrol, "requeue", job], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if proc.returncode != 0:
        raise UserError(f"scontrol requeue {job} failed: {(proc.stderr or proc.stdout).strip()}")
    return True


log = logging.getLogger("scaleout.train")


def release_after_stop(
    world: World,
    guard: Preemption,
    notice: bool,
    terminate: bool,
    checkpointing: bool,
    before_requeue: Callable[[Preemption], None] | None = None,
) -> int:
    """After a preemption stop (checkpoint written): rank 0 requeues the Slurm job if some rank got
    a notice, then every rank passes one barrier; returns the exit code (75, or 1 if the requeue
    failed). ``notice``/``terminate``: the step's agreed flags (scaleout/train/agreement.py), never
    a rank's own.

    The barrier comes after the requeue because under ``srun --kill-on-bad-exit=1`` the first
    rank to exit 75 makes Slurm kill the others: a rank 0 still on its way to ``scontrol
    requeue`` would die with them and the job would end, not come back. Once slurmctld has
    recorded the requeue, its SIGTERM only sets flags here (handlers stay installed until
    run_training returns). ``before_requeue``: a test hook (scaleout.train.faults.RequeueDelay),
    None in a real run."""
    code = EXIT_PREEMPTED
    if not notice:
        pass  # SIGTERM only: the scheduler decides (its own requeue is done; scancel means stop)
    elif not checkpointing:
        print0(
            "preemption notice, but checkpoint.dir is not set: nothing was saved, so the job is "
            "not "
            "requeued (it would start again from step 0)",
            rank=world.rank,
        )
    elif world.rank == 0:
        if before_requeue is not None:
            before_requeue(guard)
        try:
            if (terminate or guard.terminating) and not time_limit_reached():
                print(
                    "preemption notice, then SIGTERM before the time limit (scancel?): not "
                    "requeueing",
                    flush=True,
                )
            elif requeue():
                print(f"requeued Slurm job {slurm_job_id()}", flush=True)
        except (UserError, OSError, subprocess.SubprocessError) as exc:
            print(f"rank 0: {exc}", file=sys.stderr, flush=True)
            code = 1
    try:
        world.barrier()
    except (
        RuntimeError
    ) as exc:  # a peer already gone (killed at the end of KillWait): nothing to wait for
        log.warning("rank %d: final barrier after the preemption stop failed: %s", world.rank, exc)
    return code
