"""When a run saves a checkpoint, beside what saves it (:class:`scaleout.checkpoint.Checkpointer`).

``checkpoint.every_steps=N`` saves at multiples of N (the same steps before and after a resume);
``auto`` saves after one step, measures what the save stalled training, and from then on saves
every Young/Daly interval (``scaleout.telemetry.report.young_daly_interval_s``) after the previous
save, in
steps of the run's mean step time. Stall and step time are agreed (MAX over the ranks), so every
rank picks the same step. An asynchronous save (``checkpoint.async``) is settled before the next
one, at the end of the run and at a preemption: the write in flight is waited for, and one small
all-reduce agrees whether any rank's write failed. The trainer asks :meth:`SaveSchedule.due` after
each step and calls :meth:`SaveSchedule.save` with the function that writes its state.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist

from scaleout.checkpoint import Checkpointer, CheckpointWriteFailed
from scaleout.log import print0
from scaleout.telemetry.report import young_daly_interval_s

if TYPE_CHECKING:
    from scaleout.train.liveness import Progress
    from scaleout.world import World


class SaveSchedule:
    """The save cadence of one run, and its saves' accounting (stall, agreed failures)."""

    checkpointer: Checkpointer
    world: World
    auto: bool  # checkpoint.every_steps=auto: Young/Daly from the measured stall
    every: int  # steps between saves (0: never; auto: 1 until the first save measured the stall)
    mtbf_h: float  # a node's mean time between failures (checkpoint.mtbf_h), for auto
    settle_timeout_s: float  # the collective timeout while a background write is waited for
    start_step: int  # this run's first step (auto counts from it until the first save)
    saved_step: int | None  # the step of this run's latest save

    def __init__(
        self,
        checkpointer: Checkpointer,
        world: World,
        every_steps: int | Literal["auto"],
        mtbf_h: float,
        settle_timeout_s: float,
        start_step: int = 0,
    ):
        self.checkpointer, self.world = checkpointer, world
        self.auto = every_steps == "auto"
        self.every = 1 if self.auto else int(every_steps)
        self.mtbf_h, self.settle_timeout_s = mtbf_h, settle_timeout_s
        self.start_step, self.saved_step = start_step, None

    def due(self, step: int) -> bool:
        """Whether to save after ``step`` steps: every_steps=N at multiples of N (as before a
        resume); auto: ``every`` steps after this run's previous save (or its start)."""
        if not self.every:
            return False
        if not self.auto:
            return step % self.every == 0
        return step - (self.saved_step or self.start_step) >= self.every

    def save(
        self, step: int, write: Callable[[], None], step_s: float, progress: Progress
    ) -> float:
        """Collective: every rank calls ``write`` (its state into the checkpointer). Synchronous:
        then a barrier (rank 0 wrote). Asynchronous: the previous save is settled first, and
        ``write`` only snapshots (a background thread writes). ``step_s``: the run's mean step
        time, for auto. Returns the seconds the save stalled training."""
        t0, self.saved_step = time.perf_counter(), step
        if self.checkpointer.asynchronous:
            stall, step_s = self.settle(step_s, then=write, t0=t0)  # agreed by the settle
        else:
            error: Exception | None = None
            try:
                write()
            except Exception as exc:  # noqa: BLE001 -- agreed below, then raised
                error = exc
            progress.collectives += 1  # a rank still writing is then behind the others
            # the agreement is the barrier: a failed write stops every rank now, not at a timeout
            failed = self._failed_rank(error, agree=True)
            if error is not None:
                raise error
            self._raise_peer_failure(failed)
            stall = time.perf_counter() - t0
        self._next_interval(stall, step_s)
        return stall

    def _next_interval(self, stall: float, step_s: float) -> None:
        """every_steps=auto: the next interval (Young/Daly) from the stall and step time, both
        agreed (MAX over ranks), so every rank picks the same step."""
        if not self.auto:
            return
        world = self.world
        if not self.checkpointer.asynchronous and world.world_size > 1:  # agreed nothing yet
            box = torch.tensor([stall, step_s], dtype=torch.float64, device=world.device)
            dist.all_reduce(box, op=dist.ReduceOp.MAX)
            stall, step_s = box.tolist()
        nodes = max(1, world.world_size // max(world.local_size, 1))
        mtbf_s = self.mtbf_h * 3600.0 / nodes
        tau = young_daly_interval_s(stall, mtbf_s)
        self.every = max(1, round(tau / max(step_s, 1e-9)))
        print0(
            f"checkpoint.every_steps=auto: save stall {stall:.3f} s, job MTBF "
            f"{mtbf_s / 3600:.1f} h, step {step_s * 1e3:.1f} ms -> every {self.every} steps "
            f"(Young/Daly {tau:.0f} s)",
            rank=world.rank,
        )

    def settle(
        self,
        step_s: float,
        then: Callable[[], None] | None = None,
        agree: bool = True,
        t0: float | None = None,
    ) -> tuple[float, float]:
        """Wait for the background save in flight (the next save, the end of the run or a
        preemption must not outrun it), run ``then`` (the next save's snapshot), and agree with
        one all-reduce whether any rank's write failed: then every rank raises (the failed rank
        its error, the others one naming it). The wait can outlast train.step_timeout_s, so every
        rank runs this under the longer of the two timeouts (set locally, no barrier). Returns
        the agreed (stall, mean step time): this rank's when ``agree`` is false (a peer may be
        gone: no collective), and (0, ``step_s``) for synchronous saves (nothing in flight)."""
        t0 = time.perf_counter() if t0 is None else t0
        ck, world = self.checkpointer, self.world
        if not ck.asynchronous:
            return 0.0, step_s
        multi = agree and world.world_size > 1 and dist.is_initialized()
        before = world.timeout_s
        if multi:
            world.set_timeout(max(before, self.settle_timeout_s), sync=False)
        try:
            error = ck.wait()
            failed = float(world.rank + 1) if error is not None else 0.0
            if then is not None:  # no save starts after one that failed, on any rank
                failed = float(self._failed_rank(error, agree=multi) + 1)
                if not failed:
                    then()
            stall = time.perf_counter() - t0
            agreed = [failed, stall, step_s]
            if multi:
                box = torch.tensor(agreed, dtype=torch.float64, device=world.device)
                dist.all_reduce(box, op=dist.ReduceOp.MAX)
                agreed = box.tolist()  # a host read at a save boundary, once per save
        finally:
            if multi:
                world.set_timeout(before, sync=False)
        if error is not None:
            raise error
        self._raise_peer_failure(int(agreed[0]) - 1)
        return agreed[1], agreed[2]

    def _failed_rank(self, error: BaseException | None, agree: bool) -> int:
        """The highest rank whose write failed (-1: none), agreed by one small all-reduce."""
        mine = float(self.world.rank + 1) if error is not None else 0.0
        if agree and self.world.world_size > 1 and dist.is_initialized():
            box = torch.tensor([mine], dtype=torch.float64, device=self.world.device)
            dist.all_reduce(box, op=dist.ReduceOp.MAX)
            mine = box.item()
        return int(mine) - 1

    def _raise_peer_failure(self, failed: int) -> None:
        """A bystander's line: it names the rank whose write failed (that rank's own line, and
        the launcher's last, say why)."""
        if failed >= 0:
            raise CheckpointWriteFailed(
                f"rank {self.world.rank}: stopping because rank {failed}'s checkpoint write "
                "failed (its own line names the cause)"
            )
