"""torch.profiler on a schedule (``train.profile``), and the communication timeline as profiler
ranges.

``train.profile: {wait: 1, warmup: 1, active: 3}`` profiles steps wait+warmup+1 ..
wait+warmup+active of every rank (``ranks`` limits that) with ``torch.profiler.schedule`` and writes
one Chrome trace per rank and cycle through ``tensorboard_trace_handler``:
``<dir>/rank<R>.<ns>.pt.trace.json``, which Perfetto (ui.perfetto.dev), chrome://tracing,
TensorBoard's profiler plugin and Holistic Trace Analysis open.

The spans of scaleout's own communication timeline (scaleout/parallel/timeline.py) are profiler
ranges in the same trace, so kernels, c10d/NCCL calls and scaleout's schedule line up:

- ``scaleout.backward``       first gradient hook -> end of backward (the reducer's "backward"
  track)
- ``scaleout.bucket <b>``     bucket b's all-reduce, launch -> completion (async: ends when its
  future does)
- ``scaleout.wait``           end of backward -> every bucket reduced (exposed communication)
- ``scaleout.all_reduce[..]`` every scaleout.comm.all_reduce call
- ``scaleout.reduce_scatter`` / ``scaleout.all_gather``: the sharded optimizer's collectives
- ``scaleout.phase.<name>``   the trainer's step phases (data, forward, backward, optimizer)

Every helper here costs one flag check when no profiler is recording
(``torch.autograd._profiler_enabled``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

# An annotation only: comm imports this module, and the config schema reads comm's registry.
if TYPE_CHECKING:
    from scaleout.config.schema import ProfileConfig

PREFIX = "scaleout."


def recording() -> bool:
    return torch.autograd._profiler_enabled()


@contextlib.contextmanager
def prange(name: str) -> Iterator[None]:
    """A profiler range around a block (nothing when no profiler records)."""
    if not recording():
        yield
        return
    with torch.profiler.record_function(PREFIX + name):
        yield


def enter(name: str) -> Any:
    """Open a range that another callback closes (:func:`leave`); None when no profiler records."""
    if not recording():
        return None
    return torch.ops.profiler._record_function_enter_new(PREFIX + name, None)


def leave(handle: Any) -> None:
    if handle is not None:
        torch.ops.profiler._record_function_exit._RecordFunction(handle)


def until_done(name: str, future: Any) -> None:
    """A range from now until ``future`` completes (an async collective: launch -> completion)."""
    if future is None or not recording():
        return
    rf = torch.autograd.profiler.record_function(PREFIX + name)
    rf.__enter__()
    # closes the range from the future's completion callback
    rf._call_end_callbacks_on_future(future)


def traced(name: str, fn: Callable[..., Any] | None = None) -> Any:
    """``fn`` (a collective) inside a range; with ``async_op=True`` the range lasts until the
    returned handle's future completes (or, for a Work without one, until it is waited for). Wrap
    a library's entry points once (``traced("all_gather", dist.all_gather_into_tensor)``, or
    ``@traced("all_reduce")`` on a definition): the callers stay as they are."""
    if fn is None:
        return functools.partial(traced, name)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not recording():
            return fn(*args, **kwargs)
        if not kwargs.get("async_op"):
            with torch.profiler.record_function(PREFIX + name):
                return fn(*args, **kwargs)
        handle = enter(name)
        try:
            work = fn(*args, **kwargs)
        except BaseException:
            leave(handle)
            raise
        try:
            fut = getattr(work, "future", None) or work.get_future()
        # gloo's reduce_scatter Work has no future: end at wait()
        except (AttributeError, RuntimeError):
            return _WaitCloses(work, handle)
        fut.add_done_callback(lambda _f: leave(handle))
        return work

    return wrapper


class _WaitCloses:
    """A collective's Work whose range ends when it is waited for (for Works without a future)."""

    def __init__(self, work: Any, handle: Any):
        self._work, self._handle = work, handle

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            handle, self._handle = self._handle, None
            leave(handle)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class StepProfiler:
    """``torch.profiler.profile`` with a schedule; :meth:`step` after every training step."""

    def __init__(self, cfg: ProfileConfig, out_dir: str | Path, rank: int):
        self.dir = Path(cfg.dir) if cfg.dir else Path(out_dir) / "profile"
        self.dir.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self.prof = profile(
            activities=activities,
            schedule=schedule(
                wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=cfg.repeat
            ),
            on_trace_ready=tensorboard_trace_handler(str(self.dir), worker_name=f"rank{rank}"),
            record_shapes=cfg.record_shapes,
            profile_memory=cfg.profile_memory,
            with_stack=cfg.with_stack,
        )
        self.prof.__enter__()

    def step(self) -> None:
        self.prof.step()

    def close(self) -> list[Path]:
        """Stop (a cycle cut short by the end of the run is written too); the traces written so
        far."""
        self.prof.__exit__(None, None, None)
        return sorted(self.dir.glob("*.pt.trace.json"))


def build_profiler(cfg: ProfileConfig, out_dir: str | Path, rank: int) -> StepProfiler | None:
    """The profiler of ``train.profile`` (None when it is not set or this rank is not in
    ``ranks``)."""
    if cfg is None or (cfg.ranks is not None and rank not in cfg.ranks):
        return None
    return StepProfiler(cfg, out_dir, rank)
