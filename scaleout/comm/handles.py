"""Async handles, the per-World communication thread (gloo) and the comm stream (NCCL).

**The stream/thread rule.** On a CUDA device every collective is issued from the caller's thread
(the thread that produced the tensor: on a GPU, the autograd thread running the reducer's hooks and
group BN's backward), in call order, and never from the comm thread. A schedule of several phases
(hierarchical, torus2d) runs on one dedicated *comm stream* per device (:func:`on_comm_stream`): the
comm stream first waits for the caller's current stream (the gradients exist), every phase is an
``async_op=True`` collective whose ``work.wait()`` makes the comm stream wait for it (a stream
wait, not a host block), and an event recorded at the end is what :class:`StreamHandle.wait` makes
the *waiting* stream wait for. So the compute stream never carries communication (overlap), the
phases of one call are ordered by the device, and one thread issues every collective of a rank in
one order (no cross-communicator deadlock with group BN, whose backward all-reduce is issued by the
same thread). Why not the comm thread on a GPU: since PyTorch #150398 a synchronous NCCL collective
runs on the *issuing thread's current stream*, which for a fresh thread is the default (compute)
stream, and a second issuing thread makes the order of a rank's collectives rank-dependent.

Why a thread on gloo: a hierarchical or torus all-reduce is a *schedule* of many small operations on
several process groups (chunked reduce-scatter, all-reduce, all-gather) whose later phases depend on
earlier ones. gloo has no device streams to express those dependencies, so something on the host has
to wait for phase 1 of chunk c before it launches phase 2 of chunk c. One daemon thread per World
runs the schedules, one call after another, in submission order. That keeps the launch order of
every collective identical on all ranks (c10d matches collectives by their order on a group), so
several calls can be in flight at once (e.g. one per gradient bucket) without any risk of cross-
matching, and ``async_op=True`` costs one queue put. The heavy lifting (gloo IO, tensor adds)
releases the GIL.

A :class:`Handle` wraps a ``torch.futures.Future`` that completes with the reduced tensor after
*every* phase has run, so it can also be returned from a DDP communication hook.
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from scaleout.world import World


class Handle:
    """Result of ``all_reduce(..., async_op=True)``: ``wait()`` returns the reduced tensor."""

    def __init__(self, future: torch.futures.Future, tensor: torch.Tensor):
        self.future = future
        self.tensor = tensor

    def wait(self) -> torch.Tensor:
        self.future.wait()  # re-raises the failure of any phase
        return self.tensor

    def is_completed(self) -> bool:
        return self.future.done()


class StreamHandle(Handle):
    """A schedule enqueued on the comm stream (NCCL): ``wait()`` makes the caller's current stream
    wait for its end event and returns the tensor, without blocking the host. ``future`` is a
    CUDA-aware future of the same point (on a real GPU), usable as a DDP communication hook's
    result."""

    def __init__(self, future: torch.futures.Future, tensor: torch.Tensor, event: Any, device: Any):
        super().__init__(future, tensor)
        self.event, self.device = event, device

    def wait(self) -> torch.Tensor:
        torch.cuda.current_stream(self.device).wait_event(self.event)
        return self.tensor

    def is_completed(self) -> bool:
        return bool(self.event.query())


# One comm stream per CUDA device index (tests/fakecuda.py swaps this dict for its own).
_COMM_STREAMS: dict[Any, Any] = {}


def comm_stream(device: torch.device, lane: str | None = None) -> Any:
    """The device's comm stream (created on first use); ``lane``: another stream of the device for
    a phase that must not hold the comm stream up (the grid's column phase: "col")."""
    key = device.index if lane is None else (device.index, lane)
    stream = _COMM_STREAMS.get(key)
    if stream is None:
        stream = _COMM_STREAMS[key] = torch.cuda.Stream(device)
    return stream


_ENDS = threading.local()  # the stream a running on_comm_stream job ends on (finish_on)


def finish_on(stream: Any) -> None:
    """Called from an :func:`on_comm_stream` job: the job's last work is on ``stream``, so its
    handle's event and future mark that stream's point, not the comm stream's."""
    _ENDS.stream = stream


def ending_stream() -> Any:
    """The stream the running :func:`on_comm_stream` job's last work is on (None: the comm
    stream itself): what finishes a bucket (the staging copy back, the average) runs there."""
    return getattr(_ENDS, "stream", None)


def on_comm_stream(
    tensor: torch.Tensor, job: Callable[[], Any], cuda_future: bool = True
) -> StreamHandle:
    """Run ``job`` (which issues async collectives and chains them with ``work.wait()``) in this
    thread with the comm stream current, after the comm stream waited for this thread's current
    stream; the handle's event marks its end (module docstring). ``cuda_future=False`` (a call
    waited for at once, e.g. inside a CUDA-graph capture): ``future`` is a plain completed one."""
    device = tensor.device
    comm = comm_stream(device)
    comm.wait_stream(torch.cuda.current_stream(device))
    _ENDS.stream = None
    with torch.cuda.stream(comm):
        job()
    end = _ENDS.stream or comm
    _ENDS.stream = None
    with torch.cuda.stream(end):
        event = torch.cuda.Event()
        event.record(end)
        # its waiter's stream waits for this point (not inside a CUDA-graph capture: a waiter
        # there waits on the event, StreamHandle.wait)
        if (
            cuda_future
            and torch.cuda.is_available()
            and not torch.cuda.is_current_stream_capturing()
        ):
            future = torch.futures.Future(devices=[device])
        else:  # tests/fakecuda.py: no CUDA runtime behind the emulated device
            future = torch.futures.Future()
        future.set_result(tensor)
    return StreamHandle(future, tensor, event, device)


def completed(tensor: torch.Tensor) -> Handle:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(tensor)
    return Handle(fut, tensor)


class CommFailed(RuntimeError):
    """A schedule was not run because an earlier one on this World failed (timeout, dead peer)."""


class CommThread:
    """A FIFO of schedules executed by one daemon thread (see module docstring).

    After a schedule fails (a collective timed out, a peer died) every later schedule fails at once
    with :class:`CommFailed` naming the first error, without touching the network: the groups'
    collective sequence is broken (c10d matches collectives by order), so running more would only
    wait out one timeout per queued bucket or cross-match with peers. NCCL's watchdog aborts a
    communicator for the same reason.
    """

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._lock = threading.Lock()
        self.error: BaseException | None = None  # the first failure, if any
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def idle(self) -> bool:
        """Nothing queued or running (False once a schedule failed: callers then get the
        failure)."""
        with self._lock:
            return self._pending == 0 and self.error is None

    def submit(self, job: Callable[[], Any], tensor: torch.Tensor) -> Handle:
        fut: torch.futures.Future = torch.futures.Future()
        with self._lock:
            if self.error is not None:
                fut.set_exception(self._after(self.error))
                return Handle(fut, tensor)
            self._pending += 1
        self._jobs.put((job, fut, tensor))
        return Handle(fut, tensor)

    @staticmethod
    def _after(error: BaseException) -> CommFailed:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return CommFailed(f"not run: an earlier collective on this rank failed ({first})")

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, fut, tensor = item
            error = self.error
            if error is None:
                try:
                    job()
                except BaseException as exc:  # noqa: BLE001 -- handed to whoever waits
                    with self._lock:
                        self.error = error = exc
                    self._pending_done()
                    fut.set_exception(exc)
                    continue
            self._pending_done()
            if error is None:
                fut.set_result(tensor)
            else:
                fut.set_exception(self._after(error))

    def _pending_done(self) -> None:
        with self._lock:
            self._pending -= 1

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        self._jobs.put(None)

    def shutdown(self, timeout_s: float = 60.0) -> bool:
        """Finish queued work and join the thread (World.close calls this before destroying
        groups). Returns whether the thread ended (False: it is still inside a collective after
        ``timeout_s``)."""
        self.close()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()


# One CommThread per World, dropped with the World (weak keys: no state outlives its World).
_THREADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_THREADS_LOCK = threading.Lock()


def existing_thread(world: World) -> CommThread | None:
    with _THREADS_LOCK:
        return _THREADS.get(world)


def thread_idle(world: World) -> bool:
    """Nothing queued on ``world``'s comm thread (or it has none): a collective started now in the
    caller's thread cannot overtake an earlier one (c10d matches collectives by order)."""
    thread = existing_thread(world)
    return thread is None or thread.idle


def comm_thread(world: World) -> CommThread:
    with _THREADS_LOCK:
        t = _THREADS.get(world)
        if t is None:
            t = _THREADS[world] = CommThread(f"scaleout-comm-r{world.rank}")
            weakref.finalize(world, t.close)
            if hasattr(world, "add_close_hook"):
                world.add_close_hook(t.shutdown)
        return t


def prioritize_communication(world: World, nice: int = 10) -> bool:
    """Lower the calling (compute) thread's CPU priority below the communication threads
    (CPU/gloo).

    GPUs give collectives their own engines and high-priority streams; on CPU, gloo's IO threads,
    the scaleout comm thread and the kernel's network work share cores with the forward/backward
    thread. When those cores are oversubscribed (several ranks per core, as on the emulated
    cluster) a bucket's all-reduce waits for a time slice behind compute and the overlap is lost.
    This creates the groups and the comm thread first (so they keep the normal priority), then
    raises the calling thread's nice value (per-thread on Linux; needs no privilege). Threads and
    processes started later by the calling thread inherit it. No-op on CUDA (NCCL has its own
    streams) and where unsupported; returns whether it applied. Every rank must call it (it may
    create process groups).
    """
    if world.device.type == "cuda" or world.world_size < 2 or not hasattr(os, "setpriority"):
        return False
    if world.uniform and world.num_nodes > 1 and world.local_size > 1:
        # gloo groups (and their worker threads) exist before the renice
        _ = (world.intra, world.inter)
    comm_thread(world)
    tid = threading.get_native_id()
    try:
        cur = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, cur + max(0, int(nice))))
    except OSError:
        return False
    return True
