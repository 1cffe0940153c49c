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


class Task:
    metric_name = "accuracy"
    benchmark = "bert"
    model: torch.nn.Module
    rows: int  # global number of rows (packs / images) in the training set
    source: Any  # picklable builder of this rank's CPU micro-batches: .micro_batches(position, grad_accum)

    def micro_batches(self, position: int, grad_accum: int, device: torch.device | None = None) -> list[MicroBatch]:
        """This rank's micro-batches at data ``position`` on ``device`` (default: the world's device)."""
        dev = device or self.world.device
        return [replace(mb, inputs=_to(mb.inputs, dev), target=_to(mb.target, dev))
                for mb in self.source.micro_batches(position, grad_accum)]

    def loss(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        raise NotImplementedError

    def evaluate(self, model: torch.nn.Module) -> float:
        raise NotImplementedError

    def samples_per_step(self, position: int) -> tuple[int, int]:
        """(samples, real tokens) in the whole global batch at ``position``, with no communication."""
        raise NotImplementedError

    def step_flops(self, position: int) -> float:
        """Training FLOPs of the whole global batch at ``position`` (what the step runs; no communication)."""
        raise NotImplementedError


def _per_pack(values: np.ndarray, packs: list[list[int]]) -> np.ndarray:
    """Sum of ``values`` over each pack's sequence indices (vectorised: packs number in the millions)."""
    if not packs:
        return np.zeros(0, dtype=values.dtype)
    flat = np.fromiter((i for p in packs for i in p), dtype=np.int64)
    starts = np.cumsum([0] + [len(p) for p in packs[:-1]])
    return np.add.reduceat(values[flat], starts)


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
                 max_len: int, max_pred: int, depth: int):
        self.seqs, self.packs, self.pack_tokens, self.sampler = seqs, packs, pack_tokens, sampler
        self.max_len, self.max_pred, self.depth = max_len, max_pred, depth

    def micro_batches(self, position: int, grad_accum: int) -> list[MicroBatch]:
        from scaleout.data.bert_batch import build_batch

        rows = self.sampler.local_indices(position)
        out = []
        for part in np.array_split(rows, grad_accum):
            packs = [self.packs[i] for i in part]
            seqs = {j for p in packs for j in p}
            batch = build_batch(self.seqs, packs, self.max_len, self.max_pred, self.depth)
            out.append(MicroBatch(batch, None, len(seqs), int(self.pack_tokens[part].sum())))
        return out


class ImageBatches:
    """This rank's image micro-batches on the CPU (decode + augmentation happen here). Data only."""

    def __init__(self, images: Any, sampler: Any, rows: int):
        self.images, self.sampler, self.rows = images, sampler, rows

    def micro_batches(self, position: int, grad_accum: int) -> list[MicroBatch]:
        idx = self.sampler.local_indices(position)
        epoch = position // max(self.rows, 1)
        out = []
        for part in np.array_split(idx, grad_accum):
            x, y = self.images.get(part, epoch) if hasattr(self.images, "get") else self.images.batch(part)
            out.append(MicroBatch(x, y, len(part), 0))
        return out


class BertTask(Task):
    metric_name = "mlm_accuracy"
    benchmark = "bert"

    def __init__(self, cfg: Any, world: Any):
        from scaleout.data.bert_batch import build_batch
        from scaleout.data.bert_sources import load_bert_data, to_bert_sequences
        from scaleout.data.packing_assign import assign_sequences
        from scaleout.data.packing_hist import histogram_from_lengths
        from scaleout.data.sampler import ShardedSampler
        from scaleout.models.bert import BertForPreTraining

        self.cfg, self.world, d, b = cfg, world, cfg.data, cfg.model.bert
        self.info: dict[str, Any] = {}
        if d.max_seq_len > b.max_position:
            raise ConfigError(f"data.max_seq_len={d.max_seq_len} exceeds model.bert.max_position={b.max_position}")
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
        self.pack_tokens = np.array([int(self.lengths[p].sum()) for p in self.packs], dtype=np.int64)
        self.pack_sizes = np.array([len(p) for p in self.packs], dtype=np.int64)
        masked = np.array([len(s.mlm_positions) for s in self.train_seqs], dtype=np.int64)
        self.pack_masked = _per_pack(masked, self.packs)
        self.pack_sq = _per_pack(self.lengths.astype(np.float64) ** 2, self.packs)
        self.sampler = ShardedSampler(self.rows, cfg.train.global_batch, world.rank, world.world_size, seed=d.seed)
        self._build = build_batch
        self.max_pred = d.max_predictions * self.depth
        self.source = BertBatches(SequenceTable(self.train_seqs), self.packs, self.pack_tokens, self.sampler, d.max_seq_len,
                                  self.max_pred, self.depth)
        # model.bert.static_shapes unset: on exactly when the step is captured in a CUDA graph (the
        # fixed-slot MLM/NSP heads cost a few padded rows; graphs need them, eager/compile need not)
        static = b.static_shapes if b.static_shapes is not None else cfg.model.cuda_graphs
        self.info["bert_static_shapes"] = bool(static)
        self.model = BertForPreTraining(b.model_copy(update={"static_shapes": bool(static)})).to(world.device)

    def loss(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        return model(mb.inputs).loss

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> float:
        w = self.world
        mine = list(range(w.rank, len(self.eval_seqs), w.world_size))
        correct = torch.zeros(2, dtype=torch.float64)
        bs = 64
        was_training = model.training
        model.eval()
        for i in range(0, len(mine), bs):
            packs = [[j] for j in mine[i : i + bs]]
            batch = self._build(self.eval_seqs, packs, self.cfg.data.max_seq_len, self.cfg.data.max_predictions, 1)
            out = model(_to_device(batch, w.device))
            correct += torch.tensor([float(out.mlm_correct), float(out.mlm_total)], dtype=torch.float64)
        model.train(was_training)
        if w.world_size > 1:
            dist.all_reduce(correct)
        return float(correct[0] / max(correct[1], 1.0))

    def samples_per_step(self, position: int) -> tuple[int, int]:
        idx = self.sampler.global_indices(position)
        return int(self.pack_sizes[idx].sum()), int(self.pack_tokens[idx].sum())

    def step_flops(self, position: int) -> float:
        from scaleout.models.bert_flops import bert_training_flops, head_rows

        idx = self.sampler.global_indices(position)
        cfg = self.model.cfg  # static_shapes resolved for this run
        mlm, nsp = head_rows(cfg, len(idx), self.cfg.data.max_seq_len, int(self.pack_masked[idx].sum()),
                             int(self.pack_sizes[idx].sum()), self.max_pred, self.depth)
        return bert_training_flops(cfg, float(self.pack_tokens[idx].sum()), float(self.pack_sq[idx].sum()), mlm, nsp)


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
        self.model = self.model.to(world.device)
        if world.device.type == "cuda":
            self.model = self.model.to(memory_format=torch.channels_last)

    def loss(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        return F.cross_entropy(model(mb.inputs), mb.target)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> float:
        w = self.world
        mine = self.eval_idx[w.rank :: w.world_size]
        stats = torch.zeros(2, dtype=torch.float64)
        was_training = model.training
        model.eval()
        for i in range(0, len(mine), 64):
            part = mine[i : i + 64]
            x, y = self.eval_set.get(part) if hasattr(self.eval_set, "get") else self.eval_set.batch(part)
            pred = model(x.to(w.device)).argmax(1).cpu()
            stats += torch.tensor([float((pred == y).sum()), float(len(part))], dtype=torch.float64)
        model.train(was_training)
        if w.world_size > 1:
            dist.all_reduce(stats)
        return float(stats[0] / max(stats[1], 1.0))

    def samples_per_step(self, position: int) -> tuple[int, int]:
        return self.cfg.train.global_batch, 0

    def step_flops(self, position: int) -> float:
        from scaleout.report import resnet_flops_per_image

        r = self.cfg.model.resnet
        if self.macs is not None:  # counted on this exact model: forward 2 FLOPs per MAC, backward ~2x forward
            per_image = 3 * 2 * float(self.macs)
        else:
            per_image = resnet_flops_per_image(image_size=r.image_size)
        return per_image * self.cfg.train.global_batch


def build_task(cfg: Any, world: Any) -> Task:
    if cfg.model.arch == "bert":
        return BertTask(cfg, world)
    if cfg.model.arch == "resnet":
        return ResNetTask(cfg, world)
    raise ConfigError(f"model.arch={cfg.model.arch!r}: expected bert or resnet")


def steps_per_epoch(task: Task, global_batch: int) -> int:
    return max(math.ceil(task.rows / global_batch), 1)
