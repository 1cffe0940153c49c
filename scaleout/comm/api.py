"""``all_reduce(tensor, world, algorithm=..., op=..., async_op=...)`` over the algorithm registry
(:mod:`scaleout.comm.algorithm`; ``reduce_scatter`` / ``all_gather``:
:mod:`scaleout.comm.shard`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from scaleout.comm import handles
from scaleout.comm.algorithm import get_algorithm
from scaleout.errors import UserError
from scaleout.telemetry.profiler import traced

if TYPE_CHECKING:
    from scaleout.world import World


def op_name(op: Any, what: str = "all_reduce") -> str:
    if op in ("sum", dist.ReduceOp.SUM):
        return "sum"
    if op in ("avg", "mean", getattr(dist.ReduceOp, "AVG", None)):
        return "avg"
    raise UserError(f"{what} op={op!r}: expected 'sum' or 'avg'")


@traced("all_reduce")
def all_reduce(
    tensor: torch.Tensor,
    world: World,
    algorithm: str = "flat",
    op: Any = "sum",
    async_op: bool = False,
    **options: Any,
) -> Any:
    """Reduce ``tensor`` over every rank of ``world``, in place.

    Returns ``tensor`` (``async_op=False``) or a :class:`~scaleout.comm.handles.Handle` whose
    ``wait()`` returns it once every phase has completed. Any shape, element count and strides; any
    dtype gloo/NCCL can add (fp32, bf16, fp16, integers; ``avg`` needs floating point). ``avg`` is
    the sum divided by the world size, exactly as for ``flat``, so results match bit for bit on
    integer-valued data. All ranks must issue their all-reduces in the same order (as for
    torch.distributed); several may be in flight.

    ``options``: the algorithm's ``Options`` (e.g. ``chunk_bytes`` and ``composition`` of the
    row/column algorithms, ``x``/``y`` of the torus grid); an option it does not have is a one-line
    UserError.
    """
    alg = get_algorithm(algorithm)
    opname = op_name(op)
    opts = alg.options(**options)
    if opname == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise UserError(f"all_reduce op='avg' needs a floating-point tensor, got {tensor.dtype}")

    # Groups are resolved here, in the caller's thread, so that a bad grid fails at the call
    # (one-line TopologyError) and group creation happens in call order on every rank.
    prepared = alg.prepare(world, opts)

    contiguous = tensor.is_contiguous()
    buf = tensor.view(-1) if contiguous else tensor.contiguous().view(-1)
    p = world.world_size

    def finish() -> None:
        if opname == "avg":
            buf.div_(p)
        if not contiguous:
            tensor.copy_(buf.view(tensor.shape))

    def job() -> None:
        alg.all_reduce(buf, world, opts, prepared)
        finish()

    native = (lambda: alg.start(buf, world, opts)) if alg.single_collective else None
    # a sum in place needs no finishing: a native work is then waited for as it is
    done = None if opname != "avg" and contiguous else finish
    return dispatch(world, tensor, job, native, done, async_op)


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
