"""How a collective goes out: :func:`dispatch` (this thread, the comm thread or one native work, in
call order) and the handles of native works. The collectives themselves:
:mod:`scaleout.comm.collective`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from scaleout.comm import handles
from scaleout.errors import UserError

if TYPE_CHECKING:
    from scaleout.world import World


def op_name(op: Any, what: str = "all_reduce") -> str:
    if op in ("sum", dist.ReduceOp.SUM):
        return "sum"
    if op in ("avg", "mean", getattr(dist.ReduceOp, "AVG", None)):
        return "avg"
    raise UserError(f"{what} op={op!r}: expected 'sum' or 'avg'")


def dispatch(
    world: World,
    result: torch.Tensor,
    job: Callable[[], None],
    native: Callable[[], Any] | None,
    finish: Callable[[], None] | None,
    async_op: bool,
) -> Any:
    """Run one collective schedule in call order: ``job`` does everything (all phases, then
    ``finish``); ``native`` (single-collective algorithms) starts one torch.distributed async work
    instead, or returns None when there is nothing to send. Returns ``result`` (sync) or a Handle
    completing with it. ``finish`` None: the native work's result needs nothing done on the host
    (a sum in place), so its handle waits for the work itself: no Python callback runs on the
    backend's completion thread (one per bucket would take the GIL from the training thread).

    On a CUDA device: always in this thread (see :mod:`scaleout.comm.handles`, the stream/thread
    rule), a multi-phase ``job`` on the comm stream (async phases chained by stream waits), a
    native work as it is. On the host: in this thread when the World's communication thread has
    nothing queued (launch order is still the call order), else queued behind it: c10d matches
    collectives by their order on a group, so a call must never overtake an earlier one that shares
    its groups.
    """
    thread = handles.existing_thread(world)
    idle = thread is None or thread.idle
    if result.is_cuda:
        if not idle:  # host work queued earlier goes out first (call order)
            thread.submit(lambda: None, result).wait()
            idle = True
        if native is None:
            handle = handles.on_comm_stream(result, job, cuda_future=async_op)
            return handle if async_op else handle.wait()
    if not async_op:
        if idle:  # nothing queued: run in this thread (no hand-off)
            job()
            return result
        return thread.submit(job, result).wait()
    if native is not None and idle:
        work = native()  # one native async collective: no thread needed
        if work is None:
            if finish is not None:
                finish()
            return handles.completed(result)
        if finish is None:
            return NativeHandle(work, result)
        try:
            future = work.get_future()
        except RuntimeError:  # gloo's reduce_scatter / all_gather works have no future (torch 2.13)
            return WorkHandle(work, finish, result)
        return handles.Handle(future.then(lambda _f: (finish(), result)[1]), result)
    return handles.comm_thread(world).submit(job, result)


class NativeHandle(handles.Handle):
    """A native async work with nothing left to do on the host: ``wait()`` waits for the work (on
    CUDA: the caller's stream waits for it), ``is_completed()`` asks it. ``future`` (a DDP
    communication hook's result: completes with the tensor) is made on first use only."""

    def __init__(self, work: Any, result: torch.Tensor):
        self.work, self.tensor = work, result
        self._future: torch.futures.Future | None = None

    @property  # type: ignore[override]
    def future(self) -> torch.futures.Future:
        if self._future is None:
            tensor = self.tensor
            self._future = self.work.get_future().then(lambda _f: tensor)
        return self._future

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.tensor

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())


class WorkHandle(handles.Handle):
    """A native work without a future: ``wait()`` waits for it, then runs ``finish`` once."""

    def __init__(self, work: Any, finish: Callable[[], None], result: torch.Tensor):
        self.work, self._finish, self.tensor = work, finish, result
        self.future = None  # type: ignore[assignment]  (not usable as a DDP hook's future)
        self._done = False

    def wait(self) -> torch.Tensor:
        if not self._done:
            self.work.wait()
            self._finish()
            self._done = True
        return self.tensor

    def is_completed(self) -> bool:
        return self._done or self.work.is_completed()
