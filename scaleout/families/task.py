"""What is trained: a model, its per-step data for this rank, its loss and its eval metric.

A task hides the model family from the loop (scaleout/train/trainer.py). Each family
(scaleout/families/<name>/) has one subclass, built by its
:meth:`~scaleout.families.Family.build_task`: ``BertTask`` (MLM + NSP on packed or padded sequences,
metric = masked-LM accuracy, MLPerf's BERT quality metric) and ``ResNetTask`` (image classification,
metric = top-1).

Each task keeps the recipe for its per-step data in ``task.batches`` (scaleout/data/batches.py):
data only, so it pickles cheaply; that object is what the prefetcher's worker processes receive.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from scaleout.data.batches import MicroBatch, to_device
from scaleout.families.base import Family

if TYPE_CHECKING:
    from scaleout.config.schema import Config
    from scaleout.world import World


class Numerics(Protocol):
    """What a task reads of the run's precision (the trainer's scaleout.train.precision.Precision
    answers it): the low-precision dtype (None: fp32) and the forward passes' autocast context.
    Declared here so that the task, below the trainer, names no trainer type."""

    dtype: torch.dtype | None

    def autocast(self) -> contextlib.AbstractContextManager[Any]: ...


class Counts:
    """(correct, total) of an evaluation, summed on the world's device and all-reduced once:
    collective tensors live on ``world.device`` (an NCCL default group has no CPU backend), and
    nothing is read on the host per batch."""

    def __init__(self, world: World):
        self.world = world
        self.sums = torch.zeros(2, dtype=torch.float64, device=world.device)

    def add(self, correct: torch.Tensor | int, total: torch.Tensor | int) -> None:
        self.sums[0] += correct
        self.sums[1] += total

    def ratio(self) -> float:
        if self.world.world_size > 1:
            dist.all_reduce(self.sums)
        correct, total = self.sums.tolist()  # the one host read of the evaluation
        return correct / max(total, 1.0)


class Task:
    """The interface the loop uses; one subclass per model family (``model.arch``)."""

    model: torch.nn.Module
    rows: int  # global number of rows (packs / images) in the training set
    # picklable builder of this rank's CPU micro-batches: .micro_batches(position, grad_accum)
    batches: Any
    precision: Numerics | None = None  # of the run (build_task sets it)
    # samples per row where a row packs several (BERT packing)
    sequences_per_row: float | None = None

    def __init__(self, cfg: Config, world: World):
        self.cfg, self.world = cfg, world
        self.family: Family = cfg.model.family
        self.info: dict[str, Any] = {}  # what report.json records about the data and the model

    @property
    def metric_name(self) -> str:
        """The evaluation's quality metric (the family's)."""
        return self.family.metric

    @property
    def benchmark(self) -> str | None:
        """The MLPerf benchmark name (mlperf_logging's), the family's."""
        return self.family.benchmark

    def micro_batches(
        self, position: int, grad_accum: int, device: torch.device | None = None
    ) -> list[MicroBatch]:
        """This rank's micro-batches at data ``position`` on ``device`` (default: the world's
        device)."""
        dev = device or self.world.device
        return [
            replace(
                mb,
                inputs=self.prepare_inputs(to_device(mb.inputs, dev)),
                target=to_device(mb.target, dev),
            )
            for mb in self.batches.micro_batches(position, grad_accum)
        ]

    def prepare_inputs(self, inputs: Any) -> Any:
        """The host batch's inputs, just copied to the device, as the model takes them (default:
        unchanged). Runs on the device: ResNet turns uint8 NHWC pixels into normalised float NCHW
        here. The prefetcher calls it on its copy stream right after the host-to-device copy, so
        it overlaps the previous step's kernels; ``micro_batches`` and evaluation call it too."""
        return inputs

    def input_pipeline(self, start_step: int, stop_step: int) -> Any | None:
        """The task's own training input (the Prefetcher's interface: ``start``, ``get(step)``,
        ``close``), used instead of the prefetch workers; None (default): the workers, or the
        synchronous path. ResNet with ``data.decode=dali`` returns its DALI pipeline."""
        return None

    def choose_kernels(self) -> None:
        """Once the run's precision is known, before the trainer wraps the model: pick the
        model's kernels where the config leaves it to a measurement (default: nothing to pick).
        BERT probes its attention kernel here (scaleout/families/bert/kernels.py)."""

    def loss(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        raise NotImplementedError

    def autocast(self) -> Any:
        """The run's mixed-precision context for forward passes (scaleout/train/precision.py;
        fp32: no-op)."""
        return self.precision.autocast() if self.precision is not None else contextlib.nullcontext()

    def evaluate(self, model: torch.nn.Module) -> float:
        raise NotImplementedError

    def sync_buffers(self) -> None:
        """Collective: make rank-local buffers (ResNet: BN running statistics) equal on every
        rank, before evaluation and before a checkpoint. Parameters are equal by construction;
        BERT has no such buffers."""

    def samples_per_step(self, position: int) -> tuple[int, int]:
        """(samples, real tokens) in the whole global batch at ``position``, with no
        communication."""
        raise NotImplementedError

    @property
    def eval_size(self) -> int:
        """Samples in the evaluation set (MLPerf ``eval_samples``)."""
        raise NotImplementedError

    def epoch_of(self, samples: int) -> int:
        """The MLPerf epoch number of ``samples`` trained samples (``epoch_num`` /
        ``first_epoch_num``)."""
        return self.family.epoch_of(samples, self.rows)

    def steps_per_epoch(self, global_batch: int) -> int:
        return max(math.ceil(self.rows / global_batch), 1)
