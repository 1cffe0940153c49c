"""Background input pipeline: build each step's micro-batches ahead of time in worker processes.

    pf = Prefetcher(task, global_batch=64, grad_accum=1, start_step=resume_step, stop_step=max_steps,
                    num_workers=2, prefetch=4, pin_memory=True, device=world.device)
    mbs = pf.get(step)      # the same MicroBatches task.micro_batches(step * global_batch, ...) returns
    pf.close()

Design, and why:

- **Steps are the unit.** Item i of the underlying dataset is the whole micro-batch list of step
  ``start_step + i`` for this rank, built by the task itself (``task.micro_batches(..., device="cpu")``).
  Data order is already a pure function of the data position (``scaleout/train/tasks.py``), so the
  background batches are *the same* batches as the synchronous path, in the same order, and resume is
  just "start at another step": nothing about the prefetcher goes in a checkpoint.
- **Worker processes, via ``torch.utils.data.DataLoader``** (``num_workers`` processes,
  ``batch_size=None``): batch building is Python + numpy (BERT collation) or PIL (JPEG decode +
  augmentation), which holds the GIL, so threads would not add cores. DataLoader already gives ordered
  results from N workers, bounded prefetch per worker, worker death detection and a pin-memory thread;
  re-implementing that would be more code with the same behaviour. Workers are forked (Linux default),
  so they inherit the task's tokenized data copy-on-write instead of pickling it.
- **Queue depth** ``prefetch`` = micro-batch lists in flight in total; DataLoader counts per worker, so
  it gets ``ceil(prefetch / num_workers)``.
- **CUDA**: batches are pinned by DataLoader's pin thread and copied with ``non_blocking=True`` on a
  side stream; the compute stream waits on that stream only when it uses the batch, so the copy
  overlaps the kernels of the previous step still queued on the device (the host runs ahead of the GPU).
- ``num_workers=0`` is the synchronous path (no background work), the baseline the benchmarks compare
  against.

The time the trainer spends in :meth:`Prefetcher.get` is the time it *waited* for data: that is what the
"data" phase of the step-time breakdown reports.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from scaleout.errors import UserError


class StepBatches(torch.utils.data.Dataset):
    """Item i = this rank's micro-batches of step ``start_step + i`` as plain CPU tuples (picklable,
    pinnable by DataLoader): ``(inputs, target, samples, tokens)`` per micro-batch."""

    def __init__(self, task: Any, global_batch: int, grad_accum: int, start_step: int, stop_step: int):
        self.task, self.global_batch, self.grad_accum = task, global_batch, grad_accum
        self.start_step, self.stop_step = start_step, stop_step

    def __len__(self) -> int:
        return max(self.stop_step - self.start_step, 0)

    def __getitem__(self, i: int) -> list[tuple[Any, Any, int, int]]:
        step = self.start_step + i
        mbs = self.task.micro_batches(step * self.global_batch, self.grad_accum, device=torch.device("cpu"))
        return [(mb.inputs, mb.target, mb.samples, mb.tokens) for mb in mbs]


def _to(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to(v, device) for v in x)
    return x


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


class Prefetcher:
    """Ordered background producer of the trainer's per-step micro-batches (see the module docstring).

    ``get(step)`` must be called with consecutive steps from ``start_step``; anything else is a bug in
    the caller and raises (a silently skipped or repeated batch would break exact resume)."""

    def __init__(self, task: Any, global_batch: int, grad_accum: int, start_step: int, stop_step: int,
                 num_workers: int = 2, prefetch: int = 2, pin_memory: bool = True,
                 device: torch.device | str = "cpu", timeout_s: float = 0.0):
        if num_workers < 0:
            raise UserError(f"data.num_workers={num_workers}: expected >= 0 (0 = build batches on the main thread)")
        if prefetch < 1:
            raise UserError(f"data.prefetch={prefetch}: expected >= 1 micro-batch lists in flight")
        if stop_step < start_step:
            raise UserError(f"stop_step={stop_step} is before start_step={start_step}")
        from scaleout.train.tasks import MicroBatch

        self._mb = MicroBatch
        self.device = torch.device(device)
        cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.pin = bool(pin_memory and cuda)
        self.num_workers, self.prefetch = num_workers, prefetch
        self.dataset = StepBatches(task, global_batch, grad_accum, start_step, stop_step)
        kw: dict[str, Any] = {}
        if num_workers > 0:
            kw = dict(prefetch_factor=max(1, math.ceil(prefetch / num_workers)), timeout=timeout_s,
                      worker_init_fn=_worker_init)
        self.loader = torch.utils.data.DataLoader(self.dataset, batch_size=None, shuffle=False,
                                                  num_workers=num_workers, pin_memory=self.pin,
                                                  collate_fn=_identity,
                                                  # its own generator: drawing the workers' base seed from
                                                  # torch's global RNG would shift the model's dropout masks
                                                  # and break "same run with or without workers"
                                                  generator=torch.Generator().manual_seed(0), **kw)
        self._it: Iterator[Any] | None = iter(self.loader)
        self.next_step = start_step
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None

    def get(self, step: int) -> list[Any]:
        """This rank's micro-batches of ``step``, on the device."""
        if step != self.next_step:
            raise UserError(f"prefetcher asked for step {step} but the next prepared step is {self.next_step}; "
                            "steps must be consumed in order (build a new Prefetcher to jump)")
        if self._it is None:
            raise UserError("prefetcher is closed")
        try:
            raw = next(self._it)
        except StopIteration:
            raise UserError(f"prefetcher asked for step {step}, past its stop_step={self.dataset.stop_step}") from None
        self.next_step += 1
        if self.copy_stream is not None:
            with torch.cuda.stream(self.copy_stream):
                moved = _to(raw, self.device)
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(self.copy_stream)
            _record(moved, compute)
        else:
            moved = _to(raw, self.device)
        return [self._mb(inputs, target, samples, tokens) for inputs, target, samples, tokens in moved]

    def close(self) -> None:
        """Stop the workers (they are daemonic, so a crash never leaves them behind either)."""
        it, self._it = self._it, None
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _identity(x: Any) -> Any:
    return x


def _worker_init(_worker_id: int) -> None:
    # One thread per worker: the workers' parallelism is the processes; torch/OpenMP threads on top would
    # oversubscribe the cores the training step itself uses.
    torch.set_num_threads(1)


def build_prefetcher(cfg: Any, task: Any, world: Any, start_step: int) -> Prefetcher | None:
    """The trainer's prefetcher from ``data.num_workers / prefetch / pin_memory``; None = synchronous."""
    d = cfg.data
    if d.num_workers == 0:
        return None
    return Prefetcher(task, cfg.train.global_batch, cfg.train.grad_accum, start_step, cfg.train.max_steps,
                      num_workers=d.num_workers, prefetch=d.prefetch, pin_memory=d.pin_memory, device=world.device)
