"""This rank's own compute time, the measure that names a slow GPU rather than its peers.

Wall-clock phase times cannot name a compute straggler on a GPU: the host only *launches* forward
and backward, and waits for the device at the step agreement's read, where every rank waits for the
slowest. Under an overlapped all-reduce the backward times equalise too: the fast ranks' last
buckets cannot complete before the slow rank's. So each rank times its own compute on the device:
a timing event on the compute stream before each micro-batch's forward, and one at the end of its
backward, *before* the gradient sync's end-of-backward wait (a callback queued from a hook on the
loss, which runs before the reducer's own end callback: the engine runs them in the order queued,
and the loss's gradient is the first of the backward). The events bracket this rank's kernels and
none of its waits for peers (the collectives run on the comm stream; the compute stream waits for
them only in the reducer's callback, after the end event).

**Read one step late.** ``elapsed_time`` of an event not yet reached would be a host sync (or an
error); the events of step s-1 were passed before step s-1's agreement read returned (that read
waits for the compute stream behind them), so step s reads step s-1's, without a sync. ``query()``
confirms it, and an event not done yet is simply not counted (None). On CPU there is no device to
wait for: the same regions are timed with the host clock in the step itself.

The value is the ``compute`` row of the step's phase block (scaleout/train/skew.py), which rides in
the step's one agreement all-reduce: every rank learns the slowest rank's compute against the
median, and the report names it as a slow device (``slow_devices``). Cost: two events per
micro-batch, one ``elapsed_time`` each a step late.

What it cannot separate: a synchronous collective *inside* forward or backward on the compute
stream (group BN's all-reduce, ResNet with ``bn_group > 1``) is a wait the events include; such a
rank's peers then share its time. The graphed step (``train.cuda_graphs``) is one replay and is not
timed here (its host time stays the measure).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.autograd import Variable


class ComputeClock:
    """Times forward + backward of each micro-batch (module docstring). Per micro-batch:
    :meth:`begin` before its forward, :meth:`arm` with its loss before its backward; once per
    step :meth:`take`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.on_device = device.type == "cuda"
        self._open: Any = None  # the running micro-batch's start (event or perf_counter)
        self._spans: list[tuple[Any, Any]] = []  # this step's (start, end)
        self._late: list[tuple[Any, Any]] = []  # the step before's, on the device

    def _mark(self) -> Any:
        if not self.on_device:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def begin(self) -> None:
        """Before a micro-batch's forward."""
        self._open = self._mark()

    def arm(self, loss: torch.Tensor) -> None:
        """After the forward, with the tensor its backward starts from: the end mark is taken at
        the start of the engine's final callbacks (module docstring)."""
        start, self._open = self._open, None
        if start is None:
            return
        if not loss.requires_grad:  # no backward follows: the forward was the compute
            self._spans.append((start, self._mark()))
            return

        def queue(grad: torch.Tensor) -> torch.Tensor:
            Variable._execution_engine.queue_callback(
                lambda: self._spans.append((start, self._mark()))
            )
            return grad

        loss.register_hook(queue)

    def take(self) -> float | None:
        """Seconds of compute: on CPU this step's, on a GPU the step before's (None for the first
        step, or when one of its events is not done yet)."""
        spans, self._spans = self._spans, []
        if not self.on_device:
            return sum(end - start for start, end in spans) if spans else None
        late, self._late = self._late, spans
        if not late or not all(end.query() for _, end in late):
            return None
        return sum(start.elapsed_time(end) for start, end in late) / 1e3


def compute_timing(device: torch.device | str, graphed: bool) -> str:
    """How the ``compute`` row is timed on ``device``: "device" (this clock's events), or "host"
    (on CPU; and the graphed step, one replay timed on the host)."""
    return "device" if torch.device(device).type == "cuda" and not graphed else "host"
