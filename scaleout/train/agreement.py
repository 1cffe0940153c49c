"""The per-step agreement between ranks.

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

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

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
    size = agreement_size(p, phases is not None)
    if into is not None and (into.numel() != size or into.dtype != torch.float32):
        raise ValueError(f"agreement into {into.dtype} x {into.numel()}: expected float32 x {size}")
    host = stage_agreement(world, parts, phases, fingerprint)
    head = HEAD
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
LOSS = 4  # the loss's place in the head


def stage_agreement(
    world: World, parts: list[Any], phases: list[float] | None, fingerprint: int
) -> torch.Tensor:
    """The host side of an agreement: its Python values (``parts``: the head, a tensor's place
    left 0 for a device copy) and this rank's column of the phase block, written into the
    preallocated host buffer (pinned on CUDA) that one asynchronous copy takes up. Returns it.
    A CUDA-graph step copies from it in the graph, so the host stages it before every run of the
    step (the trainer's ``_stage_in_graph``)."""
    assert len(parts) == HEAD, parts
    p = world.world_size
    host = _staging(torch.device(world.device), agreement_size(p, phases is not None))
    host[:HEAD].copy_(
        torch.tensor([0.0 if isinstance(x, torch.Tensor) else float(x) for x in parts])
    )
    if phases is not None:  # this rank's column of the ROWS x world block, zeros elsewhere
        block = host[HEAD:].view(ROWS, p)
        block.zero_()
        block[:, world.rank].copy_(torch.tensor([*phases, float(fingerprint)]))
    return host


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
