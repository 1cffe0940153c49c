"""scaleout's own hang budget, which runs out before NCCL's watchdog does.

On gloo a hung collective raises in Python at the collective timeout, and the rank that sees it
names the culprit (scaleout.train.faults ``exit_on_comm_failure``: the heartbeat verdict, written
for ``scaleout slurm run``). On NCCL nothing raises: the main thread sits in the step agreement's
host read (a device-to-host copy behind the hung kernel, which never returns), and
ProcessGroupNCCL's watchdog thread, on finding the timed-out work, rethrows in its own thread
(``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``), i.e. ``std::terminate`` and SIGABRT. The process dies
before any Python runs, so no verdict is written, and srun's first "task N: Aborted" line is the
rank whose collective started *earliest*: a rank that waited, not the culprit.

So scaleout keeps the budget itself. :class:`HangWatch` is a daemon thread that reads this rank's
:class:`~scaleout.train.liveness.Progress` (plain attributes the trainer writes at its phase
marks, never the device) once a second; it runs while the main thread is blocked in that host
read, which torch makes with the GIL released (``Tensor.tolist``'s device copy; not yet checked on
a GPU here: no device was lent). When the rank has stood at the same point of a *waiting*
phase (:data:`WAITING`: the gradient sync's wait, the step agreement) for the collective timeout
``world.timeout_s`` (``train.step_timeout_s`` after the first step), it does what a gloo timeout
does: one line naming this rank and where it waited, the flight recorder's dump into the run
directory, the heartbeat verdict (every rank that waits reaches it at about the same time; the
first scans, the others read its answer), the verdict file, exit code 1. The process groups' own
timeout is longer by :func:`verdict_allowance_s` (``World.backend_slack``): the scan takes two
heartbeat windows, and NCCL's watchdog must not abort the rank in the middle of it. NCCL's abort
stays the backstop (a rank whose Python cannot run: the GIL held by a stuck extension), with the
flight recorder dumping on its own timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``, set by
``scaleout.world.nccl_flight_recorder``).

Only waiting phases count. A rank stuck in its data loader or its forward waits for nothing: its
peers' watches name it ("behind"), and the launcher stops it. A long evaluation or checkpoint on
every rank is no hang either (nobody is waiting for a peer), so ``eval``, ``checkpoint``, ``init``
and ``finish`` are left to the backend's own timeout. Cost: one attribute read a second.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from scaleout.train.faults import verdict_and_exit
from scaleout.train.liveness import Progress, period_for

if TYPE_CHECKING:
    from scaleout.world import World

# Phases in which the rank's host waits for its peers' collectives (liveness.PHASES).
WAITING = ("grad-sync", "agreement")
# Seconds left for the flight recorder's dump on top of the scan (a host-side copy of a ring
# buffer of a few thousand entries: well under a second; the rest is margin for a loaded host).
DUMP_S = 5.0


def verdict_allowance_s(timeout_s: float) -> float:
    """Seconds the verdict needs after the hang budget ran out: the liveness scan's own hard
    deadline (``unresponsive``: two windows of two heartbeat periods, plus 10 s), plus the dump.
    The process groups' timeout is ``timeout_s`` plus this (``World.backend_slack``)."""
    window = 2.0 * period_for(timeout_s)
    return 2.0 * window + 10.0 + DUMP_S


class HangWatch:
    """A daemon thread that calls ``on_hang(description)`` once, when ``progress`` stood at one
    point of a :data:`WAITING` phase for ``budget()`` seconds (module docstring). ``clock``:
    time.monotonic (tests pass their own)."""

    def __init__(
        self,
        progress: Progress,
        budget: Callable[[], float],
        on_hang: Callable[[str], Any],
        *,
        poll_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.progress, self.budget, self.on_hang = progress, budget, on_hang
        self.poll_s, self.clock = poll_s, clock
        self._point: tuple[Any, ...] | None = None
        self._since = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> HangWatch:
        self._thread = threading.Thread(target=self._loop, name="scaleout-hangwatch", daemon=True)
        self._thread.start()
        return self

    def check(self) -> str | None:
        """One look (the thread's body): the description of a hang, or None."""
        snap = self.progress.snapshot()
        if snap["phase"] not in WAITING:
            self._point = None
            return None
        point = (snap["step"], snap["phase"], snap["seq"])
        now = self.clock()
        if point != self._point:
            self._point, self._since = point, now
            return None
        waited, budget = now - self._since, self.budget()
        if waited < budget:
            return None
        return (
            f"no progress for {waited:.0f} s at step {snap['step']} in {snap['phase']}, "
            f"collective #{snap['seq']} (hang budget {budget:g} s: the collective timeout, "
            "ahead of the backend's own)"
        )

    def _loop(self) -> None:
        while not self._stop.wait(min(self.poll_s, max(0.05, self.budget() / 8.0))):
            found = self.check()
            if found is not None:
                self.on_hang(found)
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self._thread = None


FLIGHT_DIR = "flight-recorder"  # under train.output_dir (scaleout.world.nccl_flight_recorder)


def dump_flight_recorder(output_dir: str, rank: int) -> str | None:
    """Write torch's flight recorder (the last collectives of every process group of this rank:
    sequence numbers, op, sizes, state, timings; on by default on NCCL, on gloo when
    ``TORCH_FR_BUFFER_SIZE`` is set) to ``<output_dir>/flight-recorder/rank_<r>``: the file and
    format of NCCL's own dump on a timeout (``TORCH_FR_DUMP_TEMP_FILE``), which torch's
    ``fr_trace`` reads (``<prefix>_<rank>``). The path, or None when the recorder is off or the
    dump failed: evidence is best effort, never the next failure."""
    if int(os.environ.get("TORCH_FR_BUFFER_SIZE") or 0) <= 0:
        return None
    try:
        from torch._C._distributed_c10d import _dump_fr_trace
    except ImportError:  # older torch: the NCCL-only name
        try:
            from torch._C._distributed_c10d import _dump_nccl_trace as _dump_fr_trace
        except ImportError:
            return None
    try:
        data = _dump_fr_trace()
        folder = os.path.join(output_dir, FLIGHT_DIR)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank_{rank}")
        with open(path, "wb") as f:
            f.write(data)
        return path
    except Exception:  # noqa: BLE001 -- see the docstring
        return None


def exit_on_hang(world: World, description: str, output_dir: str) -> None:
    """What the watch does on NCCL when the budget ran out: the flight recorder's dump, then
    the verdict and its file and exit code 1 (faults.verdict_and_exit, as for a gloo timeout)."""
    path = dump_flight_recorder(output_dir, world.rank)
    if path is not None:
        description += f"; flight recorder: {path}"
    verdict_and_exit(world, description)


class NcclWatchdogEmulation:
    """``SCALEOUT_TEST_NCCL_WATCHDOG=1``, test-only: gloo ranks behave the way NCCL ranks do on a
    hang, so that the NCCL path runs on CPU. A mock of NCCL itself, nothing else: the process
    groups' timeout gets the slack NCCL's gets (a hung collective does not raise in Python before
    the hang watch's budget, as on NCCL), and when a rank stood in a waiting phase for that whole
    backend timeout, it prints ProcessGroupNCCL's watchdog lines and aborts (SIGABRT), as
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` does. ``=abort-only``: no hang watch either, what NCCL
    ranks did before it (the evidence missing). tests/train/test_hang_watch.py drives both."""

    VARIABLE = "SCALEOUT_TEST_NCCL_WATCHDOG"

    @classmethod
    def mode(cls, env: Mapping[str, str] | None = None) -> str:
        """ "" (off), "1" or "abort-only"."""
        value = (os.environ if env is None else env).get(cls.VARIABLE, "")
        return value if value in ("1", "abort-only") else ""

    @staticmethod
    def abort(world: World, description: str) -> None:
        ms = int(world.backend_timeout().total_seconds() * 1000)
        r = world.rank
        print(
            f"[rank{r}]:[E ProcessGroupNCCL.cpp:632] [PG ID 0 PG GUID 0(default_pg) Rank {r}] "
            f"Watchdog caught collective operation timeout: WorkNCCL(OpType=ALLREDUCE, "
            f"Timeout(ms)={ms}) ran for {ms} milliseconds before timing out ({description}).\n"
            "terminate called after throwing an instance of 'c10::DistBackendError'",
            file=sys.stderr,
            flush=True,
        )
        os.abort()


def start(world: World, progress: Progress, output_dir: str) -> list[HangWatch]:
    """The watches of this rank (``run_training``; close them at the end): on NCCL the hang
    watch, with the process groups' timeout lengthened by :func:`verdict_allowance_s`; with
    :class:`NcclWatchdogEmulation` also its abort. On gloo none: a hung collective raises there
    at the collective timeout, and the trainer names the culprit from that exception."""
    emulate = NcclWatchdogEmulation.mode()
    if world.world_size < 2 or (world.backend != "nccl" and not emulate):
        return []
    world.backend_slack = verdict_allowance_s
    world.set_timeout(world.timeout_s, sync=False)  # the groups built so far get the slack too
    watches = []
    if emulate != "abort-only":
        watches.append(
            HangWatch(
                progress,
                lambda: world.timeout_s,
                lambda what: exit_on_hang(world, what, output_dir),
            ).start()
        )
    if emulate:
        watches.append(
            HangWatch(
                progress,
                lambda: world.backend_timeout().total_seconds(),
                lambda what: NcclWatchdogEmulation.abort(world, what),
            ).start()
        )
    return watches
