"""``data.decode=dali``: the training input of an image folder as an NVIDIA DALI pipeline.

DALI (``pip install scaleout[dali]``: ``nvidia-dali-cuda120``, optional) replaces the prefetch
workers and the PIL decode for training batches. Per rank, one pipeline at a time::

    fn.readers.file(files, labels)      this rank's files of the coming steps, the sampler's order
    fn.decoders.image_random_crop       decode + random-resized crop (area data.crop_min_area..1,
                                        aspect 3/4..4/3); device="mixed" (nvJPEG) on CUDA
    fn.resize(S x S)                    bilinear, antialiased
    fn.flip(horizontal=coin_flip)       the MLPerf flip
    -> uint8 NHWC [b, S, S, 3] + labels; ResNetTask.prepare_inputs normalises it on the device

**Order, shards, epochs, resume.** The file list comes from the lazy ImageFolder index (built on
the first access, which is :meth:`DaliInput.start`, after MLPerf ``run_start``) and the task's
:class:`~scaleout.data.sampler.ShardedSampler`: a pipeline is built for a *chunk* of steps (from the
current step to the end of its epoch of the global sample stream, or longer while that is under
CHUNK_FILES = 65,536 files of the rank) with this rank's files of those steps concatenated
(``sampler.local_indices``), read in that order (``random_shuffle=False``, one DALI shard: the
sharding is the sampler's, disjoint across ranks). So a rank trains on exactly the samples, steps
and epochs of ``data.decode=cpu``, and a resume at step s builds its first chunk from step s:
nothing consumed is re-read or skipped, nothing is skipped over. What DALI draws itself are the
crop windows and flips: its generator is seeded by (data.seed, rank, first step of the chunk), so
after a resume the crops and flips are fresh draws, not the uninterrupted run's (the samples, their
order and the epochs are the same; only the augmentation differs).

Cost: a new pipeline per chunk, built on the training thread at the chunk boundary, where DALI's
read-ahead also restarts: ~2.5 CPU-s per million files (0.5 s for the path list, 2 s for DALI's
reader setup; measured here), so ~3 s per epoch for ImageNet on one GPU, ~0.4 s on 8.
Evaluation stays on the PIL path (ImageFolder.get).

Threads: ``data.num_workers`` DALI CPU threads per rank (0 = 1 thread, the synchronous-equivalent),
``data.prefetch`` batches in DALI's queue. Only the class-folder layout: tar shards (data.format
shards) are refused with one line (DALI's webdataset reader cannot follow the node-shard sampler).
"""

from __future__ import annotations

import numpy as np
import torch

from scaleout.data.batches import MicroBatch
from scaleout.errors import ConfigError, UserError

ASPECT = (3.0 / 4.0, 4.0 / 3.0)  # the MLPerf / torchvision random-resized-crop aspect range
CROP_ATTEMPTS = 10  # torchvision's attempts before the center-crop fallback
# A pipeline holds at least this many files of its rank (several epochs of a small set), so a
# small set does not rebuild its pipeline every few steps.
CHUNK_FILES = 1 << 16


def require_dali():
    """The ``nvidia.dali`` module, or one line saying how to install it."""
    try:
        import nvidia.dali as dali  # deferred: optional extra (scaleout[dali])
        import nvidia.dali.fn  # noqa: F401  # deferred: as above
        import nvidia.dali.plugin.pytorch  # noqa: F401  # deferred: as above
        import nvidia.dali.types  # noqa: F401  # deferred: as above
    except Exception as exc:  # noqa: BLE001 -- ImportError, or a wheel whose libraries are missing
        raise ConfigError(
            "data.decode=dali needs nvidia-dali (pip install scaleout[dali]): import nvidia.dali "
            f"failed: {str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__}"
        ) from None
    return dali


def check_dali(device: torch.device) -> None:
    """Refuse ``data.decode=dali`` where it cannot run, in one line (its rules between data.* keys,
    image sources and the folder layout, are the schema's: DataConfig)."""
    if torch.device(device).type not in ("cpu", "cuda"):
        raise ConfigError(
            f"data.decode=dali runs on CPU or CUDA ranks; this rank runs on {torch.device(device)}"
        )
    require_dali()


def chunk_end(step: int, global_batch: int, rows: int, stop_step: int, local_batch: int) -> int:
    """The first step after ``step``'s chunk: the step at which the global stream reaches the end
    of the epoch that step ``step`` is in (a step straddling it belongs to this chunk), or later
    while the chunk would hold fewer than CHUNK_FILES files of this rank; at most ``stop_step``."""
    epoch = step * global_batch // rows
    end = -(-((epoch + 1) * rows) // global_batch)  # ceil
    end = max(end, step + -(-CHUNK_FILES // local_batch))
    return max(min(end, stop_step), step + 1)


class DaliInput:
    """The trainer's input for ``data.decode=dali`` (module docstring): ``start()``,
    ``get(step)`` -> this rank's micro-batches of ``step`` on the device, ``close()`` -- the
    interface of :class:`scaleout.train.prefetch.Prefetcher`."""

    def __init__(
        self,
        task,
        global_batch: int,
        grad_accum: int,
        start_step: int,
        stop_step: int,
        threads: int = 1,
        prefetch: int = 2,
        device: torch.device | str = "cpu",
        rank: int = 0,
    ):
        self.dali = require_dali()
        self.task, self.images, self.sampler = task, task.train_set, task.sampler
        self.global_batch, self.grad_accum = global_batch, grad_accum
        self.local_batch = self.sampler.local_batch
        if self.local_batch < grad_accum:
            raise UserError(
                f"train.grad_accum={grad_accum} is more than this rank's {self.local_batch} images "
                "per step; expected grad_accum <= global_batch / world size"
            )
        self.start_step, self.stop_step = start_step, stop_step
        self.threads, self.prefetch = max(int(threads), 1), max(int(prefetch), 1)
        self.device, self.rank = torch.device(device), rank
        self.cuda = self.device.type == "cuda"
        self.next_step = start_step
        self.h2d_bytes = 0  # bytes copied host -> device (the CPU path; mixed decode: none)
        self._pipe = None
        self._end = start_step  # the first step the current pipeline does not hold
        self._closed = False

    # -- the pipeline of one chunk -------------------------------------------------------------
    def chunk_indices(self, step: int, end: int) -> np.ndarray:
        """This rank's samples of steps [step, end), in order."""
        return np.concatenate(
            [self.sampler.local_indices(s * self.global_batch) for s in range(step, end)]
        )

    def _build(self, step: int) -> None:
        dali = self.dali
        fn, types = dali.fn, dali.types
        rows = max(self.task.rows, 1)
        end = chunk_end(step, self.global_batch, rows, self.stop_step, self.local_batch)
        idx = self.chunk_indices(step, end)
        files = self.images.paths(idx)
        labels = [int(v) for v in self.images.labels[idx]]
        seed = int(np.random.SeedSequence([self.images.seed, self.rank, step]).generate_state(1)[0])
        s = self.images.image_size
        pipe = dali.Pipeline(
            batch_size=self.local_batch,
            num_threads=self.threads,
            device_id=(self.device.index or 0) if self.cuda else None,
            seed=seed & 0x7FFFFFFF,
            prefetch_queue_depth=self.prefetch,
        )
        with pipe:
            encoded, label = fn.readers.file(
                files=files, labels=labels, random_shuffle=False, name="reader"
            )
            images = fn.decoders.image_random_crop(
                encoded,
                device="mixed" if self.cuda else "cpu",
                output_type=types.RGB,
                random_area=[float(self.images.crop_min_area), 1.0],
                random_aspect_ratio=list(ASPECT),
                num_attempts=CROP_ATTEMPTS,
            )
            images = fn.resize(images, resize_x=s, resize_y=s, antialias=True)
            images = fn.flip(images, horizontal=fn.random.coin_flip())
            pipe.set_outputs(images, label)
        pipe.build()
        self._pipe, self._end = pipe, end

    def start(self) -> None:
        """Build the first chunk's pipeline: the first touch of the training data (the index is
        loaded here), so after run_start. Idempotent; :meth:`get` calls it if nobody did."""
        if self._closed:
            raise UserError("the DALI input is closed")
        if self._pipe is None and self.next_step < self.stop_step:
            self._build(self.next_step)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's images of ``step`` as DALI made them, on the device: (uint8 NHWC
        [b, S, S, 3], int64 labels [b])."""
        from nvidia.dali.plugin.pytorch import feed_ndarray  # deferred: optional extra

        if step != self.next_step:
            raise UserError(
                f"DALI input asked for step {step} but the next prepared step is "
                f"{self.next_step}; steps must be consumed in order"
            )
        if step >= self.stop_step:
            raise UserError(
                f"DALI input asked for step {step}, past its stop_step={self.stop_step}"
            )
        self.start()
        if step >= self._end:
            self._pipe = None  # the finished chunk's threads and buffers go first
            self._build(step)
        images, labels = self._pipe.run()
        self.next_step += 1
        images = images.as_tensor()
        x = torch.empty(images.shape(), dtype=torch.uint8, device=self.device)
        stream = torch.cuda.current_stream(self.device) if self.cuda else None
        feed_ndarray(images, x, cuda_stream=stream)
        y = torch.from_numpy(np.asarray(labels.as_tensor()).reshape(-1).astype(np.int64))
        if not self.cuda:
            self.h2d_bytes += x.nbytes
        return x, y.to(self.device, non_blocking=True)

    def get(self, step: int) -> list[MicroBatch]:
        """This rank's micro-batches of ``step``, on the device, prepared (normalised): the
        local batch split into ``grad_accum`` parts as ImageBatches splits it."""
        x, y = self.batch(step)
        per_image = getattr(self.task.batches, "flops_per_image", 0.0)
        out, start = [], 0
        for n in (len(p) for p in np.array_split(np.arange(len(y)), self.grad_accum)):
            part = x[start : start + n]
            out.append(
                MicroBatch(
                    self.task.prepare_inputs(part), y[start : start + n], n, 0, per_image * n
                )
            )
            start += n
        return out

    def close(self) -> None:
        self._pipe, self._closed = None, True

    def __enter__(self) -> DaliInput:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
