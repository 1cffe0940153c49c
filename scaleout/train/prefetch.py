"""Background input pipeline: build each step's micro-batches ahead of time in worker processes.

    pf = Prefetcher(task, global_batch=64, grad_accum=1, start_step=resume_step,
                    stop_step=max_steps, num_workers=2, prefetch=4, pin_memory=True,
                    device=world.device, start_method="forkserver")
    mbs = pf.get(step)  # the MicroBatches task.micro_batches(step * global_batch, ...) returns
    pf.close()

Design, and why:

- **Steps are the unit.** Item i of the underlying dataset is the whole micro-batch list of step
  ``start_step + i`` for this rank, built by the task's batch builder
  (``task.batches.micro_batches``, the same code ``task.micro_batches`` runs, minus the copy to the
  device). Data order is already a pure function of the data position
  (``scaleout/families/task.py``), so the background batches are *the same* batches as the
  synchronous path, in the same order, and resume is just "start at another step": nothing about the
  prefetcher goes in a checkpoint.
- **Worker processes, via ``torch.utils.data.DataLoader``** (``num_workers`` processes,
  ``batch_size=None``): batch building is Python + numpy (BERT collation) or PIL (JPEG decode +
  augmentation), which holds the GIL, so threads would not add cores. DataLoader already gives
  ordered results from N workers, bounded prefetch per worker, worker death detection and a
  pin-memory thread; re-implementing that would be more code with the same behaviour.
- **Workers are never forked from the rank** (``start_method="forkserver"``,
  ``data.worker_start``). By the time the prefetcher starts, a rank is multi-threaded: gloo's IO and
  work threads, the TCPStore client, scaleout's CommThread, the OpenMP/MKL pools. ``fork()`` copies
  only the calling thread, with every lock other threads held at that instant still held and any
  half-updated allocator or runtime state frozen mid-update; POSIX allows only async-signal-safe
  calls in such a child, while a worker runs numpy, PIL and ATen. That is a rare, load-dependent
  abort or hang in the worker (the intermittent SIGABRT of tests/train/test_prefetch.py), and why
  Python
  3.12 warns about fork in a threaded process and 3.14 made forkserver the default. Workers
  therefore fork from multiprocessing's *forkserver*, a clean single-threaded process the rank
  starts once (fork + exec), with torch, numpy and scaleout's batch code preloaded, so a worker
  start is a fork of a warm process, not a fresh interpreter (``spawn``). The start method is
  explicit because the inherited default differs by launcher: ``fork`` in ranks started by
  ``scaleout launch``/srun/mpirun, ``spawn`` in ranks started by a spawn context (tests).
- **Workers get data only.** The DataLoader pickles its dataset into each worker, so the dataset
  holds the task's batch builder (``task.batches``: sequences, packs, sampler; or the image set),
  never the task: that would drag in the ``World`` (process groups do not pickle, so
  hierarchical/torus runs could not start workers) and the model, whose parameter storages torch's
  multiprocessing pickler moves into shared memory under the live model. Cost: each worker unpickles
  the batch builder once at start-up (``scaleout bench data`` includes it;
  ``docs/step-optimizations.md`` has the numbers).
- **Queue depth** ``prefetch`` = micro-batch lists in flight in total; DataLoader counts per
  worker, so it gets ``ceil(prefetch / num_workers)``.
- **CUDA**: batches are pinned by DataLoader's pin thread and copied with ``non_blocking=True`` on
  a side stream; the task's ``prepare_inputs`` (ResNet: uint8 NHWC -> normalised float NCHW) runs on
  that stream right after the copy; the compute stream waits on that stream only when it uses the
  batch, so copy and preparation overlap the kernels of the previous step still queued on the device
  (the host runs ahead of the GPU).
- **Preemption signals do not reach the workers.** Slurm delivers ``--signal=USR2@T`` (without
  ``B:``), scancel's and ``scontrol requeue``'s SIGTERM to *every* process of the step, workers,
  forkserver and multiprocessing's resource tracker included. At their default action (USR1/USR2:
  terminate; SIGTERM: torch's worker handler exits unless the parent sent it, and a forkserver
  worker's parent is the forkserver) they would die, and a rank waiting for its next batch would
  crash instead of reaching the step at which every rank stops and checkpoints. So the workers are
  started with USR1/USR2/TERM blocked: a blocked mask survives fork and exec (the stdlib starts its
  resource tracker the same way for SIGINT/SIGTERM), so the forkserver, the resource tracker and
  every worker forked from them never act on these signals; the worker init also sets them to
  SIG_IGN (a forkserver started earlier by someone else). The rank's own handlers
  (scaleout/goodput/preempt.py) are untouched: other threads of the rank receive the signals
  meanwhile.
  SIGKILL still ends the helpers, and :meth:`Prefetcher.close` uses it for a worker that outlives
  the DataLoader's shutdown. A rank that dies without closing (SIGKILL) takes them along: the
  forkserver and the workers ask the kernel for SIGKILL when their parent dies
  (``PR_SET_PDEATHSIG``, scaleout/train/orphans.py).
- **No data before the clock** (MLPerf Training rules, "Run Results": the clock must start before
  any part of the system touches the dataset). Constructing a Prefetcher reads nothing: the workers
  start, and are handed their first steps, at :meth:`Prefetcher.start` (or the first
  :meth:`~Prefetcher.get`), which the trainer calls right after ``run_start``. What holds no data is
  started at construction, off the clock: the forkserver (a fresh interpreter importing torch,
  seconds) and the resource tracker, so starting the workers on the clock costs a fork and the
  unpickling of the data source (milliseconds).
- ``num_workers=0`` is the synchronous path (no background work), the baseline the benchmarks
  compare against.

The time the trainer spends in :meth:`Prefetcher.get` is the time it *waited* for data: that is what
the "data" phase of the step-time breakdown reports.
"""

from __future__ import annotations

import contextlib
import functools
import math
import multiprocessing
import os
import signal
from collections.abc import Iterator
from multiprocessing import resource_tracker
from typing import Any

import torch

from scaleout.config.schema import Config
from scaleout.data.batches import MicroBatch, to_device
from scaleout.errors import UserError
from scaleout.train.orphans import die_with_parent
from scaleout.world import World

START_METHODS = ("forkserver", "spawn", "fork")
# What schedulers send to every process of a job step; the rank handles them, its helper processes
# ignore them.
PREEMPTION_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
# Imported once by the forkserver, so a worker forked from it starts with them loaded. A worker
# still re-runs a *script* main module as __mp_main__, as under spawn ("__main__" here would run it
# once in the server instead, but CPython 3.11 never passes it the path); the `scaleout` entry point
# only imports scaleout.cli (preloaded) and `python -m scaleout` is skipped, so that costs
# milliseconds.
_PRELOAD = [
    "scaleout.train._orphan_guard",  # first: the server dies with the rank (its docstring)
    "__main__",
    "numpy",
    "torch",
    "scaleout.train.prefetch",
    "scaleout.data.batches",
    "scaleout.families.bert.data.bert_batch",
    "scaleout.families.resnet.data",
    "scaleout.data.sampler",
    "scaleout.cli",
]


class StepBatches(torch.utils.data.Dataset):
    """Item i = this rank's micro-batches of step ``start_step + i`` as plain CPU tuples
    (picklable, pinnable by DataLoader): ``(inputs, target, samples, tokens, flops)`` per
    micro-batch. ``batches`` is the task's data-only batch builder (``task.batches``), which is
    what gets pickled into the workers."""

    def __init__(
        self, batches: Any, global_batch: int, grad_accum: int, start_step: int, stop_step: int
    ):
        self.batches, self.global_batch, self.grad_accum = batches, global_batch, grad_accum
        self.start_step, self.stop_step = start_step, stop_step

    def __len__(self) -> int:
        return max(self.stop_step - self.start_step, 0)

    def __getitem__(self, i: int) -> list[tuple[Any, Any, int, int, float]]:
        step = self.start_step + i
        mbs = self.batches.micro_batches(step * self.global_batch, self.grad_accum)
        return [(mb.inputs, mb.target, mb.samples, mb.tokens, mb.flops) for mb in mbs]


def _record(x: Any, stream: Any) -> None:
    """Tell the caching allocator the compute stream uses tensors allocated on the copy stream."""
    if isinstance(x, torch.Tensor):
        x.record_stream(stream)
    elif isinstance(x, dict):
        for v in x.values():
            _record(v, stream)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _record(v, stream)


def _nbytes(x: Any) -> int:
    """Bytes of the tensors in ``x`` (nested lists, tuples, dicts)."""
    if isinstance(x, torch.Tensor):
        return x.nbytes
    if isinstance(x, dict):
        return sum(_nbytes(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return 0


class Prefetcher:
    """Ordered background producer of the trainer's per-step micro-batches (see the module
    docstring).

    ``get(step)`` must be called with consecutive steps from ``start_step``; anything else is a
    bug in the caller and raises (a silently skipped or repeated batch would break exact resume)."""

    def __init__(
        self,
        task: Any,
        global_batch: int,
        grad_accum: int,
        start_step: int,
        stop_step: int,
        num_workers: int = 2,
        prefetch: int = 2,
        pin_memory: bool = True,
        device: torch.device | str = "cpu",
        timeout_s: float = 0.0,
        start_method: str = "forkserver",
    ):
        if num_workers < 0:
            raise UserError(
                f"data.num_workers={num_workers}: expected >= 0 (0 = build batches on the main "
                "thread)"
            )
        if prefetch < 1:
            raise UserError(f"data.prefetch={prefetch}: expected >= 1 micro-batch lists in flight")
        if stop_step < start_step:
            raise UserError(f"stop_step={stop_step} is before start_step={start_step}")
        if start_method not in START_METHODS:
            raise UserError(
                f"data.worker_start={start_method!r}: expected one of {', '.join(START_METHODS)}"
            )
        self.device = torch.device(device)
        cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.pin = bool(pin_memory and cuda)
        self.num_workers, self.prefetch = num_workers, prefetch
        self.start_method = start_method
        self.dataset = StepBatches(
            getattr(task, "batches", task), global_batch, grad_accum, start_step, stop_step
        )
        # the task's device-side input hook (Task.prepare_inputs); None when given a bare builder
        self.prepare = getattr(task, "prepare_inputs", None) if hasattr(task, "batches") else None
        self.h2d_bytes = 0  # bytes of host tensors handed to the device so far (what crosses H2D)
        kw: dict[str, Any] = {}
        if num_workers > 0:
            kw = dict(
                prefetch_factor=max(1, math.ceil(prefetch / num_workers)),
                timeout=timeout_s,
                worker_init_fn=functools.partial(
                    _worker_init, forkserver=start_method == "forkserver"
                ),
                multiprocessing_context=_context(start_method),
            )
        self.loader = torch.utils.data.DataLoader(
            self.dataset,
            batch_size=None,
            shuffle=False,
            num_workers=num_workers,
            pin_memory=self.pin,
            collate_fn=_identity,
            # its own generator: drawing the workers' base seed from
            # torch's global RNG would shift the model's dropout masks
            # and break "same run with or without workers"
            generator=torch.Generator().manual_seed(0),
            **kw,
        )
        self._it: Iterator[Any] | None = None  # start(): the workers and their first steps
        self._closed = False
        if num_workers > 0 and start_method == "forkserver":
            # the server and the tracker inherit the mask
            with _signals_blocked(PREEMPTION_SIGNALS):
                _warm_forkserver(kw["multiprocessing_context"])
        self.next_step = start_step
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None

    def start(self) -> None:
        """Start the workers and hand them their first steps: the first touch of the training
        data (so after MLPerf's run_start). Idempotent; :meth:`get` calls it if nobody did."""
        self._iterator()

    def _iterator(self) -> Iterator[Any]:
        if self._closed:
            raise UserError("prefetcher is closed")
        if self._it is None:
            with _signals_blocked(PREEMPTION_SIGNALS if self.num_workers > 0 else ()):
                self._it = iter(self.loader)
        return self._it

    def get(self, step: int) -> list[Any]:
        """This rank's micro-batches of ``step``, on the device."""
        if step != self.next_step:
            raise UserError(
                f"prefetcher asked for step {step} but the next prepared step is {self.next_step}; "
                "steps must be consumed in order (build a new Prefetcher to jump)"
            )
        it = self._iterator()
        try:
            raw = next(it)
        except StopIteration:
            raise UserError(
                f"prefetcher asked for step {step}, past its stop_step={self.dataset.stop_step}"
            ) from None
        self.next_step += 1
        self.h2d_bytes += _nbytes(raw)
        if self.copy_stream is not None:
            # copy and prepare (ResNet: uint8 NHWC -> normalised float NCHW) on the side stream;
            # the compute stream waits for both, and the caching allocator learns that the
            # compute stream uses what the side stream allocated
            with torch.cuda.stream(self.copy_stream):
                moved = self._prepare(to_device(raw, self.device))
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(self.copy_stream)
            _record(moved, compute)
        else:
            moved = self._prepare(to_device(raw, self.device))
        return [MicroBatch(*fields) for fields in moved]

    def _prepare(self, moved: list[Any]) -> list[Any]:
        if self.prepare is None:
            return moved
        return [(self.prepare(fields[0]), *fields[1:]) for fields in moved]

    def worker_cpu_s(self) -> float:
        """CPU seconds (user + system) the live workers have used so far, from /proc (Linux).
        Forkserver workers are children of the forkserver, not of this process, so
        RUSAGE_CHILDREN never sees them; read this before :meth:`close`."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0.0
        for w in getattr(self._it, "_workers", []):
            try:
                fields = open(f"/proc/{w.pid}/stat").read().rsplit(")", 1)[1].split()
            except OSError:  # already gone
                continue
            total += (
                int(fields[11]) + int(fields[12])
            ) / tick  # utime, stime (fields 14 and 15 of stat)
        return total

    def close(self) -> None:
        """Stop the workers (they are daemonic, so a crash never leaves them behind either)."""
        it, self._it, self._closed = self._it, None, True
        workers = list(getattr(it, "_workers", []))
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        for w in workers:  # ignores SIGTERM, so DataLoader's terminate() cannot end a stuck one
            if w.is_alive():
                os.kill(w.pid, signal.SIGKILL)
                w.join(timeout=5)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _identity(x: Any) -> Any:
    return x


def _context(start_method: str) -> Any:
    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        # Takes effect when this process first starts its forkserver; later prefetchers reuse that
        # server.
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _ready() -> None:
    pass


def _warm_forkserver(ctx: Any) -> None:
    """Start the forkserver and wait until it has imported ``_PRELOAD``: it serves a fork only
    after its imports, so one empty child started and joined does both. ``ensure_running`` alone
    returns while the server is still importing torch (14 s on a loaded 2-core machine), which
    the first worker start, on the clock, would then wait for."""
    child = ctx.Process(target=_ready, daemon=True)
    child.start()
    child.join()


@contextlib.contextmanager
def _signals_blocked(signals: tuple[signal.Signals, ...]) -> Iterator[None]:
    """Block ``signals`` in this thread while child processes start: they inherit the mask
    (module docstring). Nothing is lost meanwhile: a process-directed signal goes to another
    thread of the rank (gloo's, the comm thread) or stays pending until the mask is restored."""
    if not signals:
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        # The stdlib starts its tracker with SIGINT/SIGTERM blocked and then *unblocks* them in this
        # thread, which would let the forkserver started next inherit SIGTERM: start it first, then
        # block again.
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _worker_init(_worker_id: int, forkserver: bool = False) -> None:
    if forkserver:  # the parent is the (single-threaded) forkserver, which dies with the rank
        die_with_parent()
    # One thread per worker: the workers' parallelism is the processes; torch/OpenMP threads on top
    # would oversubscribe the cores the training step itself uses.
    torch.set_num_threads(1)
    for (
        sig
    ) in PREEMPTION_SIGNALS:  # the rank handles them; a worker must live on to deliver its batches
        signal.signal(sig, signal.SIG_IGN)


def build_prefetcher(cfg: Config, task: Any, world: World, start_step: int) -> Prefetcher | None:
    """The trainer's prefetcher from ``data.num_workers / prefetch / pin_memory``; None =
    synchronous. A task with its own input pipeline (``Task.input_pipeline``: ResNet's
    ``data.decode=dali``) gets that instead."""
    d = cfg.data
    own = getattr(task, "input_pipeline", None)
    pipeline = own(start_step, cfg.train.max_steps) if own is not None else None
    if pipeline is not None:
        return pipeline
    if d.num_workers == 0:
        return None
    return Prefetcher(
        task,
        cfg.train.global_batch,
        cfg.train.grad_accum,
        start_step,
        cfg.train.max_steps,
        num_workers=d.num_workers,
        prefetch=d.prefetch,
        pin_memory=d.pin_memory,
        device=world.device,
        start_method=d.worker_start,
    )
