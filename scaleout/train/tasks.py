"""What is trained: a model, its per-step data for this rank, its loss and its eval metric, and what the
loop and the MLPerf log ask about the model family.

A task hides the model family from the loop (scaleout/train/loop.py): ``BertTask`` (MLM + NSP on packed or
padded sequences, metric = masked-LM accuracy, MLPerf's BERT quality metric) and ``ResNetTask`` (image
classification, metric = top-1), registered in :data:`TASKS` by ``model.arch``. A new model family is one
class here (and its model under scaleout/models/) plus one registry line.

Each task keeps the recipe for its per-step data in ``task.batches`` (scaleout/data/batches.py): data only,
so it pickles cheaply; that object is what the prefetcher's worker processes receive.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import replace
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from scaleout.config.schema import Config
from scaleout.data.batches import (
    BertBatches,
    ImageBatches,
    MicroBatch,
    SequenceTable,
    ShardBertBatches,
    to_device,
)
from scaleout.data.bert_batch import build_batch
from scaleout.data.bert_sources import load_bert_data, to_bert_sequences
from scaleout.data.images import ImageFolder, SyntheticImages
from scaleout.data.packing_algos import pack_histogram
from scaleout.data.packing_assign import assign_sequences
from scaleout.data.packing_hist import histogram_from_lengths
from scaleout.data.sampler import ShardedSampler
from scaleout.data.shard_source import open_shards
from scaleout.errors import ConfigError
from scaleout.models.bert import BertForPreTraining
from scaleout.models.bert_convert import load_init_checkpoint
from scaleout.models.bert_flops import batch_flops
from scaleout.models.group_bn import sync_batchnorm_stats
from scaleout.models.resnet import build_resnet, count_macs
from scaleout.report import resnet_flops_per_image
from scaleout.train.precision import Precision
from scaleout.world import World

# ImageNet-1k training set size: turns LARS step counts into the epochs the LARS rules ask for.
IMAGENET_TRAIN_IMAGES = 1_281_167


class _Counts:
    """(correct, total) of an evaluation, summed on the world's device and all-reduced once: collective
    tensors live on ``world.device`` (an NCCL default group has no CPU backend), and nothing is read on
    the host per batch."""

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

    arch: ClassVar[str]  # the model.arch value it serves
    metric_name: ClassVar[str] = "accuracy"
    benchmark: ClassVar[str]  # the MLPerf benchmark name (mlperf_logging's)
    model: torch.nn.Module
    rows: int  # global number of rows (packs / images) in the training set
    batches: Any  # picklable builder of this rank's CPU micro-batches: .micro_batches(position, grad_accum)
    precision: Precision | None = None  # of the run (build_task sets it)
    sequences_per_row: float | None = (
        None  # samples per row where a row packs several (BERT packing)
    )

    def __init__(self, cfg: Config, world: World):
        self.cfg, self.world = cfg, world
        self.info: dict[str, Any] = {}  # what report.json records about the data and the model

    def micro_batches(
        self, position: int, grad_accum: int, device: torch.device | None = None
    ) -> list[MicroBatch]:
        """This rank's micro-batches at data ``position`` on ``device`` (default: the world's device)."""
        dev = device or self.world.device
        return [
            replace(mb, inputs=to_device(mb.inputs, dev), target=to_device(mb.target, dev))
            for mb in self.batches.micro_batches(position, grad_accum)
        ]

    def loss(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        raise NotImplementedError

    def autocast(self) -> Any:
        """The run's mixed-precision context for forward passes (scaleout/train/precision.py; fp32: no-op)."""
        return self.precision.autocast() if self.precision is not None else contextlib.nullcontext()

    def evaluate(self, model: torch.nn.Module) -> float:
        raise NotImplementedError

    def sync_buffers(self) -> None:
        """Collective: make rank-local buffers (ResNet: BN running statistics) equal on every rank, before
        evaluation and before a checkpoint. Parameters are equal by construction; BERT has no such buffers."""

    def samples_per_step(self, position: int) -> tuple[int, int]:
        """(samples, real tokens) in the whole global batch at ``position``, with no communication."""
        raise NotImplementedError

    @property
    def eval_size(self) -> int:
        """Samples in the evaluation set (MLPerf ``eval_samples``)."""
        raise NotImplementedError

    def epoch_of(self, samples: int) -> int:
        """The MLPerf epoch number of ``samples`` trained samples (``epoch_num`` / ``first_epoch_num``)."""
        raise NotImplementedError

    def steps_per_epoch(self, global_batch: int) -> int:
        return max(math.ceil(self.rows / global_batch), 1)

    @classmethod
    def mlperf_hparams(cls, cfg: Config, steps_per_epoch: int | None = None) -> dict[str, Any]:
        """The MLPerf hyper-parameter keys of this family (the optimizer's); the common ones are in
        scaleout.train.hparams."""
        raise NotImplementedError


class BertTask(Task):
    arch = "bert"
    metric_name = "mlm_accuracy"
    benchmark = "bert"

    def __init__(self, cfg: Config, world: World):
        super().__init__(cfg, world)
        d, b = cfg.data, cfg.model.bert
        if d.max_seq_len > b.max_position:
            raise ConfigError(
                f"data.max_seq_len={d.max_seq_len} exceeds model.bert.max_position={b.max_position}"
            )
        self.stream: Any = None
        if d.source == "wikipedia":  # MLPerf shards, read lazily (scaleout/data/shard_source.py)
            self._open_shards(cfg, world)
        else:
            self._load_in_memory(cfg, world)
        # model.bert.static_shapes unset: on exactly when the step is captured in a CUDA graph (the
        # fixed-slot MLM/NSP heads cost a few padded rows; graphs need them, eager/compile need not)
        static = b.static_shapes if b.static_shapes is not None else cfg.model.cuda_graphs
        self.info["bert_static_shapes"] = bool(static)
        model = BertForPreTraining(b.model_copy(update={"static_shapes": bool(static)}))
        # micro-batches count their FLOPs with the heads this model runs
        self.batches.flops = functools.partial(batch_flops, model.cfg)
        if (
            cfg.model.init_checkpoint
        ):  # rank 0 reads the values; the trainer broadcasts them (bert_convert.py)
            self.info["init_checkpoint"] = load_init_checkpoint(
                model, cfg.model.init_checkpoint, world.rank == 0
            )
        self.model = model.to(world.device)

    def _open_shards(self, cfg: Config, world: World) -> None:
        """Training stream and eval share from the shard index: nothing per sequence is loaded up front."""
        data = open_shards(cfg, world.rank, world.world_size, world.barrier)
        self.stream, self.eval_seqs, self.depth = data.stream, data.eval, data.depth
        self.rows, self.max_pred = data.stream.total, data.stream.max_pred
        self.sequences_per_row = data.sequences_per_row
        self.info["data"], self.info["packing"] = (
            {k: v for k, v in data.info.items() if k != "packing"},
            data.info["packing"],
        )
        self.batches = ShardBertBatches(data.stream)

    def _load_in_memory(self, cfg: Config, world: World) -> None:
        """pydoc / synthetic: every sequence in memory (small data sets)."""
        d = cfg.data
        # The corpus, tokenizer and samples are built once per node and cached: local rank 0 builds while
        # the others wait, then they load the cache instead of all doing the same minutes of work.
        if world.local_rank == 0:
            data = load_bert_data(cfg)
        world.barrier()
        if world.local_rank != 0:
            data = load_bert_data(cfg)
        self.info["data"] = {k: v for k, v in data.info.items() if k != "cache"}
        self.train_seqs = to_bert_sequences(data.train)
        self.eval_seqs = to_bert_sequences(data.eval[: d.eval_samples])
        self.lengths = np.array([len(s) for s in self.train_seqs], dtype=np.int64)
        if d.packing != "none":
            strategy = pack_histogram(
                histogram_from_lengths(self.lengths, d.max_seq_len),
                d.max_seq_len,
                d.max_per_pack,
                d.packing,
            )
            self.packs = assign_sequences(strategy, self.lengths, seed=d.seed).packs()
            self.depth = d.max_per_pack
            self.info["packing"] = {
                "algorithm": strategy.algorithm,
                "efficiency": float(strategy.efficiency),
                "speedup": float(strategy.speedup),
            }
        else:
            self.packs = [[i] for i in range(len(self.train_seqs))]
            self.depth = 1
        self.rows = len(self.packs)
        self.sequences_per_row = sum(len(p) for p in self.packs) / max(self.rows, 1)
        self.pack_tokens = np.array(
            [int(self.lengths[p].sum()) for p in self.packs], dtype=np.int64
        )
        self.pack_sizes = np.array([len(p) for p in self.packs], dtype=np.int64)
        self.sampler = ShardedSampler(
            self.rows, cfg.train.global_batch, world.rank, world.world_size, seed=d.seed
        )
        self.max_pred = d.max_predictions * self.depth
        self.batches = BertBatches(
            SequenceTable(self.train_seqs),
            self.packs,
            self.pack_tokens,
            self.sampler,
            d.max_seq_len,
            self.max_pred,
            self.depth,
        )

    def loss(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        return model(mb.inputs).loss

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> float:
        d = self.cfg.data
        return evaluate_mlm(
            model, self.eval_seqs, d.max_seq_len, d.max_predictions, self.world, self.autocast
        )

    def samples_per_step(self, position: int) -> tuple[int, int]:
        if self.stream is not None:
            return self.stream.global_counts(position)
        idx = self.sampler.global_indices(position)
        return int(self.pack_sizes[idx].sum()), int(self.pack_tokens[idx].sum())

    @property
    def eval_size(self) -> int:
        return len(self.eval_seqs)

    def epoch_of(self, samples: int) -> int:
        return samples  # MLPerf BERT counts "epochs" in samples (the reference logs samples as epoch_num)

    @classmethod
    def mlperf_hparams(cls, cfg: Config, steps_per_epoch: int | None = None) -> dict[str, Any]:
        o = cfg.optim
        return {
            "opt_name": o.name,
            "opt_base_learning_rate": o.lr,
            "opt_lamb_epsilon": o.eps,
            "opt_lamb_beta_1": o.betas[0],
            "opt_lamb_beta_2": o.betas[1],
            "opt_lamb_weight_decay_rate": o.weight_decay,
            "opt_learning_rate_warmup_steps": o.warmup_steps,
            "opt_learning_rate_training_steps": o.total_steps or cfg.train.max_steps,
            "num_warmup_steps": o.warmup_steps,
            "start_warmup_step": o.start_warmup_step,
            "max_sequence_length": cfg.data.max_seq_len,
        }


class ResNetTask(Task):
    arch = "resnet"
    metric_name = "top1"
    benchmark = "resnet"

    def __init__(self, cfg: Config, world: World):
        super().__init__(cfg, world)
        r, d = cfg.model.resnet, cfg.data
        if d.source == "imagenet":
            if not d.path:
                raise ConfigError(
                    "data.source=imagenet needs data.path (an ImageFolder root with train/ and val/)"
                )
            self.train_set = ImageFolder(d.path, "train", r.image_size)
            self.eval_set = ImageFolder(d.path, "val", r.image_size)
            self.eval_idx = np.arange(min(d.eval_samples, len(self.eval_set)))
        elif d.source == "synthetic":
            n = max(cfg.train.global_batch * 256, 4096)
            self.train_set = SyntheticImages(
                r.num_classes, r.image_size, n + d.eval_samples, seed=d.seed
            )
            self.eval_set = self.train_set
            self.eval_idx = np.arange(
                n, n + d.eval_samples
            )  # held out: never in the training range
            self.train_set.length = n
        else:
            raise ConfigError(
                f"data.source={d.source!r} is not an image source (expected synthetic or imagenet)"
            )
        self.rows = len(self.train_set)
        self.sampler = ShardedSampler(
            self.rows, cfg.train.global_batch, world.rank, world.world_size, seed=d.seed
        )
        self.batches = ImageBatches(self.train_set, self.sampler, self.rows)
        self.model = build_resnet(r, world)
        self.macs = (
            count_macs(self.model, (1, 3, r.image_size, r.image_size)) if r.bn_group == 1 else None
        )
        if (
            self.macs is not None
        ):  # counted on this exact model: forward 2 FLOPs per MAC, backward ~2x forward
            self.batches.flops_per_image = 3 * 2 * float(self.macs)
        else:
            self.batches.flops_per_image = resnet_flops_per_image(image_size=r.image_size)
        self.model = self.model.to(world.device)
        if world.device.type == "cuda":
            self.model = self.model.to(memory_format=torch.channels_last)

    def loss(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        return F.cross_entropy(model(mb.inputs), mb.target)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> float:
        w = self.world
        self.sync_buffers()  # every rank evaluates with the same (pooled) BN statistics
        mine = self.eval_idx[w.rank :: w.world_size]
        counts = _Counts(w)
        was_training = model.training
        model.eval()
        for i in range(0, len(mine), 64):
            part = mine[i : i + 64]
            x, y = self.eval_set.get(part)
            with self.autocast():
                pred = model(x.to(w.device, non_blocking=True)).argmax(1)
            counts.add((pred == y.to(w.device, non_blocking=True)).sum(), len(part))
        model.train(was_training)
        return counts.ratio()

    def sync_buffers(self) -> None:
        sync_batchnorm_stats(self.model, self.world)

    def samples_per_step(self, position: int) -> tuple[int, int]:
        return self.cfg.train.global_batch, 0

    @property
    def eval_size(self) -> int:
        return len(self.eval_idx)

    def epoch_of(self, samples: int) -> int:
        return samples // max(self.rows, 1)

    @classmethod
    def mlperf_hparams(cls, cfg: Config, steps_per_epoch: int | None = None) -> dict[str, Any]:
        """LARS keys. ``steps_per_epoch`` turns step counts into the epochs they use; by default one
        ImageNet-1k epoch at the configured global batch."""
        o, t = cfg.optim, cfg.train
        total = o.total_steps or t.max_steps
        spe = steps_per_epoch or max(math.ceil(IMAGENET_TRAIN_IMAGES / t.global_batch), 1)
        return {
            "opt_name": o.name,
            "lars_opt_base_learning_rate": o.lr,
            "lars_opt_end_learning_rate": o.end_lr,
            "lars_opt_learning_rate_decay_poly_power": o.power,
            "lars_opt_learning_rate_decay_steps": max(total - o.warmup_steps, 0),
            "lars_epsilon": 0.0,
            "lars_opt_learning_rate_warmup_epochs": o.warmup_steps / spe,
            "lars_opt_momentum": o.momentum,
            "lars_opt_weight_decay": o.weight_decay,
        }


@torch.no_grad()
def evaluate_mlm(
    model: torch.nn.Module,
    eval_seqs: Any,
    max_len: int,
    max_pred: int,
    world: Any,
    autocast: Any = contextlib.nullcontext,
) -> float:
    """Masked-LM accuracy over ``eval_seqs`` (padded rows, each rank a strided share, one all-reduce).
    ``world`` needs ``rank``, ``world_size`` and ``device`` only, so a plain torch script (the baseline
    of ``scaleout bench ttt``) evaluates with exactly this function."""
    mine = list(range(world.rank, len(eval_seqs), world.world_size))
    counts = _Counts(world)
    bs = 64
    was_training = model.training
    model.eval()
    for i in range(0, len(mine), bs):
        batch = build_batch(eval_seqs, [[j] for j in mine[i : i + bs]], max_len, max_pred, 1)
        with autocast():
            out = model(to_device(batch, world.device))
        counts.add(out.mlm_correct, out.mlm_total)
    model.train(was_training)
    return counts.ratio()


TASKS: dict[str, type[Task]] = {t.arch: t for t in (BertTask, ResNetTask)}


def task_class(arch: str) -> type[Task]:
    """The task of ``model.arch``, or a one-line error naming the value."""
    if arch not in TASKS:
        raise ConfigError(f"model.arch={arch!r}: expected one of {', '.join(TASKS)}")
    return TASKS[arch]


def build_task(cfg: Config, world: World) -> Task:
    if cfg.model.init_checkpoint and cfg.model.arch != "bert":
        raise ConfigError(
            f"model.init_checkpoint is for BERT (phase-1 weights); model.arch={cfg.model.arch!r}"
        )
    task = task_class(cfg.model.arch)(cfg, world)
    task.precision = Precision(cfg.train.precision, world.device)
    return task
