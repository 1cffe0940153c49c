"""The background thread that makes scaleout.horovod behave like Horovod: negotiation, fusion, join.

Horovod does not require ranks to issue collectives in the same order: every operation is queued
with a name, and a background thread agrees with the other ranks, once per cycle, on which names
every rank has queued (the coordinator), then runs those (fused into buffers) and leaves the rest
for a later cycle. That is what lets a parameter that got no gradient on some ranks be all-reduced
at ``step()`` there and during backward elsewhere, lets a rank ``join()`` and contribute zeros while
the others go on, and turns a mismatched shape or dtype into an error on every rank instead of a
hang.

This module does the same on torch.distributed. One daemon thread per :class:`Engine`:

1. waits until something is queued (or this rank joined, or shutdown was asked), then up to
   ``HOROVOD_CYCLE_TIME`` so that a cycle's worth of requests accumulates (that is what gets fused),
   or less if the program is already blocked waiting for one of them (nothing more will come
   meanwhile),
2. negotiates (:mod:`scaleout.horovod.negotiate`): normally one small MAX all-reduce of a
   response-cache bit vector, a full metadata exchange only when a request is new,
3. runs the agreed operations in the agreed order (:mod:`scaleout.horovod.execute`), then delivers
   results or errors to the handles.

A rank only enters a negotiation when it has something queued (or joined), and a negotiation
completes only when every rank has entered, so an idle rank costs nothing and a rank whose peers
have not caught up blocks in the collective, not in a busy loop.

All communication of this API is issued by this one thread, on a process group of its own (created
at ``hvd.init``), so it cannot interleave with the program's other collectives on the World's
groups.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from scaleout.horovod.errors import HorovodInternalError, HorovodValueError
from scaleout.horovod.execute import Executor
from scaleout.horovod.negotiate import Kind, Negotiator
from scaleout.horovod.settings import Settings
from scaleout.parallel.timeline import Timeline

if TYPE_CHECKING:
    from scaleout.horovod.basics import ReduceOp
    from scaleout.world import World

log = logging.getLogger("scaleout.horovod")


class Handle:
    """What the ``*_async`` functions return; pass it to ``hvd.synchronize`` or ``hvd.poll``."""

    def __init__(self, n: int, finish: Callable[[list[Any]], Any] | None = None):
        self._event = threading.Event()
        self._results: list[Any] = [None] * n
        self._left = n
        self._error: BaseException | None = None
        self._finish = finish
        # e.g. per-rank first dimensions of an allgather (for autograd)
        self.extra: dict[str, Any] = {}
        # tells the engine that someone is blocked on us
        self._waker: Callable[[], None] | None = None
        if n == 0:
            self._event.set()

    def _set(self, slot: int, value: Any) -> None:
        self._results[slot] = value
        self._left -= 1
        if self._left == 0:
            self._event.set()

    def _fail(self, exc: BaseException) -> None:
        if not self._event.is_set():
            self._error = exc
            self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self) -> Any:
        if not self._event.is_set() and self._waker is not None:
            self._waker()
        self._event.wait()
        if self._error is not None:
            raise self._error
        return self._finish(self._results) if self._finish else self._results[0]


@dataclass(eq=False)
class Request:
    """One tensor's part of a collective, as queued on this rank."""

    kind: Kind
    name: str | None
    tensor: torch.Tensor | None
    meta: tuple  # what every rank must agree on (see negotiate.FIELDS)
    handle: Handle
    slot: int = 0
    inplace: bool = False
    op: ReduceOp | None = None
    prescale: float = 1.0
    postscale: float = 1.0
    root: int = 0
    splits: list[int] | None = None
    algorithm: str = "flat"
    enqueued: float = field(default_factory=time.time)
    warned: bool = False

    @property
    def label(self) -> str:
        return f"{self.kind}.{self.name if self.name is not None else 'noname'}"


class _DataWorld:
    """The World as scaleout.comm sees it, with this API's own process group as the flat (world)
    group."""

    def __init__(self, world: World, group: Any):
        self._world = weakref.proxy(world)  # no reference cycle through the per-World cache below
        self.group = group

    def __getattr__(self, name: str) -> Any:
        return getattr(self._world, name)


_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Groups:
    control: Any  # gloo, CPU tensors: negotiation, size and split exchanges
    data: Any  # the World's backend (gloo on CPU, NCCL on GPU): the tensors themselves
    data_world: _DataWorld  # the World as scaleout.comm sees it, with ``data`` as its flat group


def private_groups(world: World) -> Groups:
    """This API's process groups over all ranks: created once per World (a collective: at hvd.init,
    which every rank calls at the same point) and kept across shutdown/init (so scaleout.comm's
    communication thread for them is made once too); the World's close destroys them. As in Horovod,
    control messages travel on CPU (gloo) whatever carries the tensors."""
    if world not in _GROUPS:
        ranks = list(range(world.world_size))
        control = dist.new_group(ranks, backend="gloo") if world.world_size > 1 else None
        data = control if world.world_size < 2 or world.backend == "gloo" else dist.new_group(ranks)
        _GROUPS[world] = Groups(control, data, _DataWorld(world, data))
        world.add_close_hook(lambda: _GROUPS.pop(world, None))
    return _GROUPS[world]


class Engine:
    """The queue of one rank and the thread that negotiates and runs it (see the module
    docstring)."""

    def __init__(self, world: World, settings: Settings):
        self.world, self.settings = world, settings
        self.size, self.rank = world.world_size, world.rank
        groups = private_groups(world)
        self.timeline: Any = None
        self.mark_cycles = False
        self.executor = Executor(world, groups, settings.fusion_threshold, self)
        self.negotiator = Negotiator(groups.control, self.size, self.rank, settings.cache_capacity)
        self.negotiator.stall_check_s = settings.stall_check_s
        self._cv = threading.Condition()
        self._pending: list[Request] = []
        self._in_flight: set[tuple[str, str]] = set()
        self._join_handles: list[Handle] = []
        self._joined_round: int | None = None
        self._stop = False
        self._hurry = threading.Event()
        self._dead: BaseException | None = None
        self.rounds = 0
        if settings.timeline:
            self.start_timeline(settings.timeline, settings.mark_cycles)
        self._thread = threading.Thread(
            target=self._loop, name=f"hvd-background-r{self.rank}", daemon=True
        )
        self._thread.start()
        ref = weakref.ref(self)
        world.add_close_hook(lambda: ref() is not None and ref().shutdown())

    # -- called from user threads ------------------------------------------------------------------
    def submit(self, requests: list[Request]) -> None:
        """Queue requests atomically (a grouped operation is negotiated and fused as one)."""
        with self._cv:
            self._check_alive()
            keys = [(r.kind, r.name) for r in requests if r.name is not None]
            for key in keys:
                if key in self._in_flight or keys.count(key) > 1:
                    raise HorovodValueError(
                        f"{key[0]} name {key[1]!r} is already in flight on rank {self.rank}: "
                        "names of concurrent operations must be unique"
                    )
            self._in_flight.update(keys)
            for r in requests:
                r.handle._waker = self._hurry.set
            self._pending.extend(requests)
            self._cv.notify()

    def join(self) -> int:
        handle = Handle(1)
        with self._cv:
            self._check_alive()
            self._join_handles.append(handle)
            self._hurry.set()
            self._cv.notify()
        return handle.wait()

    def start_timeline(self, path: str, mark_cycles: bool = False) -> None:
        self.mark_cycles = mark_cycles
        self.timeline = Timeline(path, self.rank)

    def stop_timeline(self) -> None:
        """Collective: every rank's events are merged into one file by rank 0 (in the background
        thread, at an agreed point, so the gather cannot interleave with other collectives)."""
        handle = Handle(1)
        self.submit([Request("timeline", None, None, (self.timeline is not None,), handle)])
        handle.wait()

    def shutdown(self) -> None:
        if self.timeline is not None and self._dead is None and self._thread.is_alive():
            self.stop_timeline()
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise HorovodInternalError(f"scaleout.horovod background thread stopped: {self._dead}")
        if self._stop:
            raise HorovodInternalError("scaleout.horovod has been shut down")

    # -- the background thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._pending or self._join_handles or self._stop):
                        self._cv.wait()
                # Let a cycle's worth of requests accumulate (that is what gets fused), unless a
                # caller is already blocked on a result: then nothing more is coming from it.
                if self.settings.cycle_time_s > 0:
                    self._hurry.wait(self.settings.cycle_time_s)
                self._hurry.clear()
                if not self._round():
                    return
        except BaseException as exc:  # noqa: BLE001 -- every waiting handle must learn about it
            log.error("scaleout.horovod rank %d: background thread failed: %r", self.rank, exc)
            self._die(
                exc if isinstance(exc, HorovodInternalError) else HorovodInternalError(repr(exc))
            )

    def _round(self) -> bool:
        with self._cv:
            pending = list(self._pending)
            if self._join_handles and self._joined_round is None:
                self._joined_round = self.rounds
            joined, stop = self._joined_round is not None, self._stop
        stamp = self._joined_round * self.size + self.rank if joined else None
        stalled = self._stalled(pending)
        if stalled is None:
            return False
        start = time.time()
        out = self.negotiator.negotiate(pending, joined, stop, stamp, stalled, self.rounds)
        self.rounds += 1
        if self.timeline is not None and self.mark_cycles:
            self.timeline.span("CYCLE_START", "wait", start * 1e6, start * 1e6, round=self.rounds)
        if out.stop:
            self._die(HorovodInternalError("scaleout.horovod has been shut down"), stopping=True)
            return False
        done = {id(r) for *_, r in out.resolved if r is not None}
        # before the results are delivered: a waiter may queue the same name again at once
        with self._cv:
            self._pending = [r for r in self._pending if id(r) not in done]
            self._in_flight.difference_update(
                (r.kind, r.name) for *_, r in out.resolved if r is not None and r.name is not None
            )
        try:
            self.executor.run(out.resolved, joined)
        except BaseException as exc:
            for *_, r in out.resolved:  # _die fails what is still queued; these have left the queue
                if r is not None:
                    r.handle._fail(HorovodInternalError(f"{r.label} failed: {exc!r}"))
            raise
        with self._cv:
            if out.all_joined:
                handles, self._join_handles, self._joined_round = self._join_handles, [], None
            else:
                handles = []
        for h in handles:
            h._set(0, out.last_joined)
        return True

    def _stalled(self, pending: list[Request]) -> list[Request] | None:
        """Requests that have waited longer than HOROVOD_STALL_CHECK_TIME_SECONDS for the other
        ranks (each is logged once; the negotiation then names the ranks that lack them). None: a
        request passed HOROVOD_STALL_SHUTDOWN_TIME_SECONDS and this rank's engine stopped."""
        limit = self.settings.stall_check_s
        now = time.time()
        late = [r for r in pending if limit > 0 and not r.warned and now - r.enqueued > limit]
        for r in late:
            r.warned = True
            log.warning(
                "scaleout.horovod rank %d: %s has waited %.0f s for the other ranks to submit it "
                "(HOROVOD_STALL_CHECK_TIME_SECONDS)",
                self.rank,
                r.label,
                now - r.enqueued,
            )
        cut = self.settings.stall_shutdown_s
        for r in pending:
            if cut > 0 and now - r.enqueued > cut:
                self._die(
                    HorovodInternalError(
                        f"{r.label} stalled for {now - r.enqueued:.0f} s "
                        "(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)"
                    )
                )
                return None
        return late

    def _die(self, exc: BaseException, stopping: bool = False) -> None:
        with self._cv:
            if not stopping:
                self._dead = exc
            self._stop = True
            pending, self._pending = self._pending, []
            joins, self._join_handles = self._join_handles, []
            self._in_flight.clear()
        for r in pending:
            r.handle._fail(exc)
        for h in joins:
            h._fail(exc)
