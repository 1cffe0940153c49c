"""Per-step agreement between ranks, failed collectives, and fault injection for tests.

One tiny all-reduce (SUM) per step (:func:`agree_on_step`) carries [non-finite gradients here, stop
requested here, preemption notice received here, SIGTERM received here, this rank's loss, some
parameter unused (the reducer's unused-parameter detection), this rank's FLOPs], so every rank takes
the same decision: skip the step if any rank saw NaN/Inf (with the sharded optimizer a rank only
sees its own shard, so the reduced gradients alone cannot tell everyone; with fp16 the same flag
drives the loss scale, scaleout/train/precision.py), stop (checkpoint, exit) if any rank was
signalled, requeue if any rank got a notice, and leave out the optional end-of-run collectives if
any rank got SIGTERM. The end of the run uses these agreed flags, never a rank's own: a SIGTERM that
reached some ranks only, or after the agreement, must not send ranks into different collectives. The
flags are 0/1 counts, so SUM > 0 is "any rank" exactly as MAX would be, and the same reduction gives
the mean loss over ranks.

Its result must be read on the host (the decision is Python control flow): that read is the step's
one device -> host synchronisation. The finiteness check stays on the device until then.

The same all-reduce also carries, when the trainer passes them, this rank's phase times and the
fingerprint of its gradient collectives, in a world-sized block of its own column: every rank then
learns the slowest and fastest rank of each phase, and a rank whose collectives differ is named at
the step boundary instead of hanging a later collective (scaleout/train/skew.py: design and cost,
66 KB per step at 2,048 ranks).

On the replicated path the trainer does not send it as a collective of its own after the step's
gradients: :func:`start_agreement` writes it ``into`` the last gradient bucket's rider (summed with
the gradients; uncompressed wire) or launches it before the backward, and non-finite gradients
are read from the reduced gradients, alike on every rank (docs/faults.md, "Stragglers and desync").
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

import torch
import torch.distributed as dist

from scaleout.comm.handles import CommFailed
from scaleout.errors import UserError
from scaleout.fsutil import atomic_write
from scaleout.goodput.preempt import Preemption
from scaleout.goodput.verdict import verdict_line
from scaleout.train.liveness import PHASES as PROGRESS_PHASES
from scaleout.train.liveness import describe_rank, unresponsive
from scaleout.train.skew import (
    INTER,
    LINK,
    PHASES,
    ROWS,
    CollectiveDesync,
    StepSkew,
    desync_message,
)
from scaleout.world import World


@dataclass(frozen=True)
class StepFlags:
    """A step's outcome as every rank agreed it (the same values on every rank)."""

    skip: bool  # some rank saw non-finite gradients: every rank skips the update
    stop: bool  # some rank was asked to stop (preemption): every rank checkpoints and stops
    loss: float | None = None  # mean over ranks of the step's loss, when one was given
    unused_params: bool = False  # some parameter got no gradient on any rank
    notice: bool = False  # some rank received a preemption notice (so far)
    terminate: bool = False  # some rank received SIGTERM (so far)
    flops: float = (
        0.0  # training FLOPs of the step summed over ranks (each counts its micro-batches)
    )
    skew: StepSkew | None = None  # phase times over the ranks, when the trainer sent its own


def nonfinite(grads: list[torch.Tensor]) -> torch.Tensor | bool:
    """1.0 on the device if any of ``grads`` holds NaN/Inf, else 0.0: one fused pass, no host
    read."""
    if not grads:
        return False
    # NaN/Inf anywhere makes its tensor's norm non-finite; accumulated in fp32, so that a long
    # fp16/bf16 tensor of finite values cannot overflow into a false alarm
    norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
    return (~torch.isfinite(torch.stack(norms)).all()).float()


_STAGING: dict[tuple[str, int | None, int], torch.Tensor] = {}


def _staging(dev: torch.device, n: int) -> torch.Tensor:
    """The agreement's host buffer for ``n`` float32 values to ``dev``, made once and pinned when
    ``dev`` is CUDA (a copy from pageable memory is a synchronous staging copy that may wait for
    the stream). Reusing it is safe: every agreement ends by reading its result on the host, and
    that read waits for the copy out of the buffer."""
    key = (dev.type, dev.index, n)
    buf = _STAGING.get(key)
    if buf is None:
        buf = _STAGING[key] = torch.empty(n, dtype=torch.float32, pin_memory=dev.type == "cuda")
    return buf


def skew_summary(
    times: torch.Tensor, credit: torch.Tensor | None = None
) -> tuple[tuple[str, ...], torch.Tensor]:
    """(row names, per row: max, argmax, min, argmin, median over ranks, in blocks of one value
    per row) of the gathered phase times (``len(PHASES) x world``, on the device, nothing read).
    With ``credit`` (skew.py ``link_credit``) a :data:`~scaleout.train.skew.LINK` row,
    ``inter_allreduce`` x credit, is added last: the rule that names a slow link's node."""
    names: tuple[str, ...] = PHASES
    if credit is not None:  # no byte on the wire: formed from the gathered block
        times = torch.cat([times, (times[INTER] * credit).unsqueeze(0)])
        names = (*PHASES, LINK)
    mx, amx = times.max(dim=1)
    mn, amn = times.min(dim=1)
    med = times.median(dim=1).values
    return names, torch.cat([mx, amx.float(), mn, amn.float(), med])


def agree_on_step(world: World, *args: Any, **kwargs: Any) -> StepFlags:
    """The step's agreement (module docstring), synchronously: :func:`start_agreement` (its
    arguments) and its result."""
    return start_agreement(world, *args, **kwargs).result()


def start_agreement(
    world: World,
    nonfinite_grads: bool | torch.Tensor,
    stop_requested: bool,
    loss: torch.Tensor | None = None,
    unused_params: torch.Tensor | None = None,
    *,
    notice: bool = False,
    terminate: bool = False,
    flops: float = 0.0,
    phases: list[float] | None = None,
    fingerprint: int = 0,
    step: int | None = None,
    describe: str = "",
    credit: torch.Tensor | None = None,
    with_skew: bool = True,
    into: torch.Tensor | None = None,
) -> PendingAgreement:
    """The step's agreement (module docstring), launched asynchronously: its
    :meth:`PendingAgreement.result` waits and reads. The trainer launches it before the step's
    backward (``Trainer._arm_agreement``), so it needs no round trip of its own after it.

    ``unused_params``: the gradient sync's flag of parameters that got no gradient
    (GradientSync.unused_flag), read with the others; ``flops``: this rank's training FLOPs of
    the step (summed, they give the global batch's). ``phases``: this rank's seconds per
    :data:`scaleout.train.skew.PHASES` with ``fingerprint`` its collectives' (every rank passes
    them or none: they size the all-reduce); then the result's ``skew`` holds them over the
    ranks, and a fingerprint that differs between ranks raises
    :class:`~scaleout.train.skew.CollectiveDesync` on every rank, naming the odd ones (``step``
    and ``describe``, this rank's collectives in words, go into its message). ``credit``: the
    link credit of every rank (a world-sized float32 tensor on the device,
    :func:`scaleout.train.skew.link_credit`): the skew then also holds
    :data:`~scaleout.train.skew.LINK`, ``inter_allreduce`` x credit, formed on the device.
    ``with_skew=False``: the block goes on the wire (it carries the fingerprint) but the phase
    times are not summarised (the first step, whose block holds no earlier step's times).
    ``into``: write the values there instead (a float32 view of :func:`agreement_size` elements
    that another all-reduce sums: the last gradient bucket's rider) and issue nothing;
    :meth:`PendingAgreement.result` then takes the summed view."""
    dev = torch.device(world.device)
    p = world.world_size
    parts = [
        nonfinite_grads,
        stop_requested,
        notice,
        terminate,
        0.0 if loss is None else loss,
        0.0 if unused_params is None else unused_params,
        flops,
    ]
    head = len(parts)
    assert head == HEAD, parts
    size = agreement_size(p, phases is not None)
    if into is not None and (into.numel() != size or into.dtype != torch.float32):
        raise ValueError(f"agreement into {into.dtype} x {into.numel()}: expected float32 x {size}")
    # The Python values go up in one copy from a preallocated (on CUDA pinned) host buffer, an
    # asynchronous DMA; the device values join with device -> device copies.
    host = _staging(dev, size)
    host[:head].copy_(
        torch.tensor([0.0 if isinstance(x, torch.Tensor) else float(x) for x in parts])
    )
    if phases is not None:  # this rank's column of the ROWS x world block, zeros elsewhere
        block = host[head:].view(ROWS, p)
        block.zero_()
        block[:, world.rank].copy_(torch.tensor([*phases, float(fingerprint)]))
    flags = torch.empty(size, dtype=torch.float32, device=dev) if into is None else into
    flags.copy_(host, non_blocking=True)
    for i, x in enumerate(parts):
        if isinstance(x, torch.Tensor):
            flags[i : i + 1].copy_(x.detach().reshape(1))
    work = dist.all_reduce(flags, async_op=True) if p > 1 and into is None else None
    return PendingAgreement(
        rode=into is not None,
        world=world,
        flags=flags,
        work=work,
        head=head,
        phases=phases is not None,
        with_skew=with_skew,
        has_loss=loss is not None,
        fingerprint=fingerprint,
        step=step,
        describe=describe,
        credit=credit,
    )


HEAD = 7  # the agreement's values before the phase block (start_agreement's ``parts``)


def agreement_size(world_size: int, phases: bool) -> int:
    """float32 values of one agreement: the head, and the phase block when ``phases``."""
    return HEAD + (ROWS * world_size if phases else 0)


@dataclass
class PendingAgreement:
    """An agreement on the wire (:func:`start_agreement`)."""

    rode: bool  # written ``into`` another all-reduce's buffer: result() takes its sums
    world: World
    flags: torch.Tensor
    work: dist.Work | None
    head: int
    phases: bool
    with_skew: bool
    has_loss: bool
    fingerprint: int
    step: int | None
    describe: str
    credit: torch.Tensor | None

    def result(
        self,
        local: tuple[torch.Tensor | bool | None, ...] = (),
        summed: torch.Tensor | None = None,
    ) -> StepFlags:
        """Wait for the all-reduce and read it (the step's one host read). ``local``: device
        flags every rank computed alike from the *reduced* gradients, folded into that read
        without a collective of their own: (non-finite gradients, unused parameters), OR-ed into
        the agreed ones. ``summed``: the values as another all-reduce summed them (``into``)."""
        if self.work is not None:
            self.work.wait()
        if self.rode and summed is None:
            raise RuntimeError("an agreement that rode in another all-reduce needs its sums")
        flags, head, p = self.flags if summed is None else summed, self.head, self.world.world_size
        read = flags[:head]
        block = flags[head:].view(ROWS, p) if self.phases else None
        if block is not None:  # reduced on the device: the host read stays O(1) in world size
            times, fps = block[: len(PHASES)], block[len(PHASES)]
            tail = [fps.min().reshape(1), fps.max().reshape(1)]
            if self.with_skew:
                names, summary = skew_summary(times, self.credit)
                tail.insert(0, summary)
            read = torch.cat([read, *tail])
        extra = [x.detach().reshape(1).to(read) for x in local if isinstance(x, torch.Tensor)]
        values = torch.cat([read, *extra]).tolist() if extra else read.tolist()
        got = iter(values[len(values) - len(extra) :])
        values = values[: len(values) - len(extra)]
        skip, stop, notice_, term, total, unused, flops_ = values[:head]
        mine = [next(got) if isinstance(x, torch.Tensor) else float(bool(x)) for x in local]
        mine += [0.0] * (2 - len(mine))
        skip, unused = max(skip, mine[0]), max(unused, mine[1])
        skew = None
        if block is not None:
            fp_min, fp_max = values[-2:]
            if fp_min != fp_max:  # the error path: read every rank's fingerprint to name the odd
                odd = [int(f) for f in block[len(PHASES)].tolist()]
                me = self.describe or f"0x{self.fingerprint:06x}"
                raise CollectiveDesync(
                    desync_message(self.step, odd, f"this rank ({self.world.rank}): {me}")
                )
            if self.with_skew:
                skew = StepSkew.from_values(values[head:-2], int(fp_min), names)
        return StepFlags(
            skip=skip > 0,
            stop=stop > 0,
            loss=total / p if self.has_loss else None,
            unused_params=unused > 0,
            notice=notice_ > 0,
            terminate=term > 0,
            flops=flops_,
            skew=skew,
        )


# -- fault injection for tests: installed at the start of a run only when its variable is set
# -----------
class StepInjection:
    """A test-only fault a rank injects at given steps: ``$VARIABLE="STEP:RANK[,STEP:RANK...]"``
    (steps 0-based). A gradient hook of the trainer (``Trainer.gradient_hooks``), called between
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
    it SIGSTOPs itself (a frozen process or node: no heartbeat either). Installed as the trainer's
    ``progress.fault``; tests/train/test_faults.py drives both."""

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
    step's PHASE (``data``: while waiting for its batches; ``compute``: before its forward), a
    straggler for tests/train/test_skew.py and `scaleout bench agreement`. Test-only: a real run
    leaves
    the variable unset and installs nothing."""

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
    print(
        f"scaleout: {describe_rank(world, world.rank)}: a collective failed "
        f"(collective timeout {world.timeout_s:g} s): {first}",
        file=sys.stderr,
        flush=True,
    )
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


# Exit code of a run stopped because it diverged (train.max_consecutive_skips): a plain failure.
EXIT_ABORTED = 1
