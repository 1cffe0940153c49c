"""What is trained: a model, its per-step data for this rank, its loss and its eval metric.

A task hides the model family from the loop (scaleout/train/loop.py): ``BertTask`` (MLM + NSP on packed or
padded sequences, metric = masked-LM accuracy, MLPerf's BERT quality metric) and ``ResNetTask`` (image
classification, metric = top-1). Data order is a pure function of the data position (global samples
consumed), so a checkpoint only stores that integer and resume is exact.

Each task keeps the recipe for its per-step data in ``task.source`` (:class:`BertBatches`,
:class:`ImageBatches`): data only, no model, no ``World``, no process groups, so it pickles cheaply.
That object is what the prefetcher's worker processes receive (``scaleout/train/prefetch.py``).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from scaleout.errors import ConfigError


@dataclass
class MicroBatch:
    inputs: Any  # what the model takes
    target: Any  # labels (None when the model computes its own loss)
    samples: int  # sequences / images in it (BERT: sequences, not packed rows)
    tokens: int  # real (non-pad) tokens; images count 0
    flops: float = 0.0  # training FLOPs of this micro-batch (counted where it is built: never a device read)


class _Counts:
    """(correct, total) of an evaluation, summed on the world's device and all-reduced once: collective
    tensors live on ``world.device`` (an NCCL default group has no CPU backend), and nothing is read on
    the host per batch."""

    def __init__(self, world: Any):
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
    metric_name = "accuracy"
    benchmark = "bert"
    model: torch.nn.Module
    rows: int  # global number of rows (packs / images) in the training set
    source: Any  # picklable builder of this rank's CPU micro-batches: .micro_batches(position, grad_accum)
    precision: Any = None  # scaleout.train.precision.Precision of the run (build_task sets it)

    def micro_batches(self, position: int, grad_accum: int, device: torch.device | None = None) -> list[MicroBatch]:
        """This rank's micro-batches at data ``position`` on ``device`` (default: the world's device)."""
        dev = device or self.world.device
        return [replace(mb, inputs=_to(mb.inputs, dev), target=_to(mb.target, dev))
                for mb in self.source.micro_batches(position, grad_accum)]

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



def _to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _to(x: Any, device: torch.device) -> Any:
    if isinstance(x, dict):
        return _to_device(x, device)
    return x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x


class SequenceTable:
    """BERT sequences as flat numpy arrays with per-sequence offsets (CSR layout). It pickles as a few
    buffers, so a prefetch worker unpickles the training set in ~10 ms instead of one Python object
    per sequence (0.8 s for the 26,651 pydoc sequences of configs/bert_tiny_cpu.yaml).
    ``table[i]`` is sequence i as a :class:`~scaleout.data.bert_batch.BertSequence` of array views,
    which ``build_batch`` lays out exactly as the list form."""

    def __init__(self, seqs: list[Any]):
        from itertools import chain

        def flat(field: str, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
            lens = np.fromiter((len(getattr(q, field)) for q in seqs), dtype=np.int64, count=len(seqs))
            values = np.fromiter(chain.from_iterable(getattr(q, field) for q in seqs), dtype=dtype, count=int(lens.sum()))
            return values, np.concatenate([[0], np.cumsum(lens)])

        # narrow types (vocabularies and positions are far below 2**31): a quarter of int64's bytes to pickle;
        # build_batch writes them into int64 rows exactly
        self.tokens, self.tok_off = flat("tokens", np.int32)
        self.segments, _ = flat("segments", np.int8)
        self.mlm_positions, self.mlm_off = flat("mlm_positions", np.int32)
        self.mlm_labels, _ = flat("mlm_labels", np.int32)
        self.nsp_labels = np.array([q.nsp_label for q in seqs], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.nsp_labels)

    def __getitem__(self, i: int) -> Any:
        from scaleout.data.bert_batch import BertSequence

        a, b, c, d = self.tok_off[i], self.tok_off[i + 1], self.mlm_off[i], self.mlm_off[i + 1]
        return BertSequence(self.tokens[a:b], self.segments[a:b], self.mlm_positions[c:d], self.mlm_labels[c:d],
                            int(self.nsp_labels[i]))


class BertBatches:
    """This rank's packed/padded BERT micro-batches on the CPU, from the tokenized sequences and the
    packs. Data only (no model, no World): it is what prefetch workers unpickle."""

    def __init__(self, seqs: Any, packs: list[list[int]], pack_tokens: np.ndarray, sampler: Any,
                 max_len: int, max_pred: int, depth: int, model_cfg: Any):
        self.seqs, self.packs, self.pack_tokens, self.sampler = seqs, packs, pack_tokens, sampler
        self.max_len, self.max_pred, self.depth, self.model_cfg = max_len, max_pred, depth, model_cfg

    def micro_batches(self, position: int, grad_accum: int) -> list[MicroBatch]:
        from scaleout.data.bert_batch import build_batch
        from scaleout.models.bert_flops import batch_flops

        rows = self.sampler.local_indices(position)
        out = []
        for part in np.array_split(rows, grad_accum):
            packs = [self.packs[i] for i in part]
            seqs = {j for p in packs for j in p}
            batch = build_batch(self.seqs, packs, self.max_len, self.max_pred, self.depth)
            out.append(MicroBatch(batch, None, len(seqs), int(self.pack_tokens[part].sum()),
                                  batch_flops(self.model_cfg, batch)))
        return out


class ShardBertBatches:
    """This rank's BERT micro-batches read lazily from MLPerf shards (scaleout/data/shard_source.py). Data
    only: it pickles as file paths and per-shard counts, so prefetch workers start in milliseconds."""

    def __init__(self, stream: Any, model_cfg: Any):
        self.stream, self.model_cfg = stream, model_cfg

    def micro_batches(self, position: int, grad_accum: int) -> list[MicroBatch]:
        from scaleout.models.bert_flops import batch_flops

        return [MicroBatch(b, None, n, t, batch_flops(self.model_cfg, b)) for b, n, t in self.stream.batches(position, grad_accum)]


class ImageBatches:
    """This rank's image micro-batches on the CPU (decode + augmentation happen here). Data only."""

    def __init__(self, images: Any, sampler: Any, rows: int):
        self.images, self.sampler, self.rows = images, sampler, rows
        self.flops_per_image = 0.0  # set by the task once the model exists

    def micro_batches(self, position: int, grad_accum: int) -> list[MicroBatch]:
        idx = self.sampler.local_indices(position)
        epoch = position // max(self.rows, 1)
        out = []
        for part in np.array_split(idx, grad_accum):
            x, y = self.images.get(part, epoch)
            out.append(MicroBatch(x, y, len(part), 0, self.flops_per_image * len(part)))
        return out


class BertTask(Task):
    metric_name = "mlm_accuracy"
    benchmark = "bert"

    def __init__(self, cfg: Any, world: Any):
        from scaleout.models.bert import BertForPreTraining

        self.cfg, self.world, d, b = cfg, world, cfg.data, cfg.model.bert
        self.info: dict[str, Any] = {}
        if d.max_seq_len > b.max_position:
            raise ConfigError(f"data.max_seq_len={d.max_seq_len} exceeds model.bert.max_position={b.max_position}")
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
        self.source.model_cfg = model.cfg  # micro-batches count their FLOPs with the heads this model runs
        if cfg.model.init_checkpoint:  # rank 0 reads the values; the trainer broadcasts them (bert_convert.py)
            from scaleout.models.bert_convert import load_init_checkpoint

            self.info["init_checkpoint"] = load_init_checkpoint(model, cfg.model.init_checkpoint, world.rank == 0)
        self.model = model.to(world.device)

    def _open_shards(self, cfg: Any, world: Any) -> None:
        """Training stream and eval share from the shard index: nothing per sequence is loaded up front."""
        from scaleout.data.shard_source import open_shards

        data = open_shards(cfg, world.rank, world.world_size, world.barrier)
        self.stream, self.eval_seqs, self.depth = data.stream, data.eval, data.depth
        self.rows, self.max_pred = data.stream.total, data.stream.max_pred
        self.sequences_per_row = data.sequences_per_row
        self.info["data"], self.info["packing"] = {k: v for k, v in data.info.items() if k != "packing"}, data.info["packing"]
        self.source = ShardBertBatches(data.stream, model_cfg=None)  # model_cfg: set once the model exists

    def _load_in_memory(self, cfg: Any, world: Any) -> None:
        """pydoc / synthetic: every sequence in memory (small data sets)."""
        from scaleout.data.bert_sources import load_bert_data, to_bert_sequences
        from scaleout.data.packing_assign import assign_sequences
        from scaleout.data.packing_hist import histogram_from_lengths
        from scaleout.data.sampler import ShardedSampler

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
            from scaleout.data.packing_algos import pack_histogram

            strategy = pack_histogram(histogram_from_lengths(self.lengths, d.max_seq_len), d.max_seq_len,
                                      d.max_per_pack, d.packing)
            self.packs = assign_sequences(strategy, self.lengths, seed=d.seed).packs()
            self.depth = d.max_per_pack
            self.info["packing"] = {"algorithm": strategy.algorithm, "efficiency": float(strategy.efficiency),
                                    "speedup": float(strategy.speedup)}
        else:
            self.packs = [[i] for i in range(len(self.train_seqs))]
            self.depth = 1
        self.rows = len(self.packs)
        self.sequences_per_row = sum(len(p) for p in self.packs) / max(self.rows, 1)
        self.pack_tokens = np.array([int(self.lengths[p].sum()) for p in self.packs], dtype=np.int64)
        self.pack_sizes = np.array([len(p) for p in self.packs], dtype=np.int64)
        self.sampler = ShardedSampler(self.rows, cfg.train.global_batch, world.rank, world.world_size, seed=d.seed)
        self.max_pred = d.max_predictions * self.depth
        self.source = BertBatches(SequenceTable(self.train_seqs), self.packs, self.pack_tokens, self.sampler, d.max_seq_len,
                                  self.max_pred, self.depth, model_cfg=None)  # model_cfg: set once the model exists

    def loss(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        return model(mb.inputs).loss

    def evaluate(self, model: torch.nn.Module) -> float:
        d = self.cfg.data
        return evaluate_mlm(model, self.eval_seqs, d.max_seq_len, d.max_predictions, self.world, self.autocast)

    def samples_per_step(self, position: int) -> tuple[int, int]:
        if self.stream is not None:
            return self.stream.global_counts(position)
        idx = self.sampler.global_indices(position)
        return int(self.pack_sizes[idx].sum()), int(self.pack_tokens[idx].sum())



class ResNetTask(Task):
    metric_name = "top1"
    benchmark = "resnet"

    def __init__(self, cfg: Any, world: Any):
        from scaleout.data.sampler import ShardedSampler
        from scaleout.models.resnet import build_resnet

        self.cfg, self.world, r, d = cfg, world, cfg.model.resnet, cfg.data
        self.info = {}
        if d.source == "imagenet":
            from scaleout.data.images import ImageFolder

            if not d.path:
                raise ConfigError("data.source=imagenet needs data.path (an ImageFolder root with train/ and val/)")
            self.train_set = ImageFolder(d.path, "train", r.image_size)
            self.eval_set = ImageFolder(d.path, "val", r.image_size)
            self.eval_idx = np.arange(min(d.eval_samples, len(self.eval_set)))
        elif d.source == "synthetic":
            from scaleout.data.images import SyntheticImages

            n = max(cfg.train.global_batch * 256, 4096)
            self.train_set = SyntheticImages(r.num_classes, r.image_size, n + d.eval_samples, seed=d.seed)
            self.eval_set = self.train_set
            self.eval_idx = np.arange(n, n + d.eval_samples)  # held out: never in the training range
            self.train_set.length = n
        else:
            raise ConfigError(f"data.source={d.source!r} is not an image source (expected synthetic or imagenet)")
        self.rows = len(self.train_set)
        self.sampler = ShardedSampler(self.rows, cfg.train.global_batch, world.rank, world.world_size, seed=d.seed)
        self.source = ImageBatches(self.train_set, self.sampler, self.rows)
        self.model = build_resnet(r, world)
        from scaleout.models.resnet import count_macs

        self.macs = count_macs(self.model, (1, 3, r.image_size, r.image_size)) if r.bn_group == 1 else None
        if self.macs is not None:  # counted on this exact model: forward 2 FLOPs per MAC, backward ~2x forward
            self.source.flops_per_image = 3 * 2 * float(self.macs)
        else:
            from scaleout.report import resnet_flops_per_image

            self.source.flops_per_image = resnet_flops_per_image(image_size=r.image_size)
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
        from scaleout.models.group_bn import sync_batchnorm_stats

        sync_batchnorm_stats(self.model, self.world)

    def samples_per_step(self, position: int) -> tuple[int, int]:
        return self.cfg.train.global_batch, 0



@torch.no_grad()
def evaluate_mlm(model: torch.nn.Module, eval_seqs: Any, max_len: int, max_pred: int, world: Any,
                 autocast: Any = contextlib.nullcontext) -> float:
    """Masked-LM accuracy over ``eval_seqs`` (padded rows, each rank a strided share, one all-reduce).
    ``world`` needs ``rank``, ``world_size`` and ``device`` only, so a plain torch script (the baseline
    of ``scaleout bench ttt``) evaluates with exactly this function."""
    from scaleout.data.bert_batch import build_batch

    mine = list(range(world.rank, len(eval_seqs), world.world_size))
    counts = _Counts(world)
    bs = 64
    was_training = model.training
    model.eval()
    for i in range(0, len(mine), bs):
        batch = build_batch(eval_seqs, [[j] for j in mine[i : i + bs]], max_len, max_pred, 1)
        with autocast():
            out = model(_to_device(batch, world.device))
        counts.add(out.mlm_correct, out.mlm_total)
    model.train(was_training)
    return counts.ratio()


def build_task(cfg: Any, world: Any) -> Task:
    from scaleout.train.precision import Precision

    if cfg.model.init_checkpoint and cfg.model.arch != "bert":
        raise ConfigError(f"model.init_checkpoint is for BERT (phase-1 weights); model.arch={cfg.model.arch!r}")
    tasks = {"bert": BertTask, "resnet": ResNetTask}
    if cfg.model.arch not in tasks:
        raise ConfigError(f"model.arch={cfg.model.arch!r}: expected bert or resnet")
    task = tasks[cfg.model.arch](cfg, world)
    task.precision = Precision(cfg.train.precision, world.device)
    return task


def steps_per_epoch(task: Task, global_batch: int) -> int:
    return max(math.ceil(task.rows / global_batch), 1)
