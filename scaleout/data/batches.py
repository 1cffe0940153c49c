"""Data-only builders of a rank's per-step micro-batches on the CPU: no model, no ``World``, no process
groups, so they pickle cheaply. A task (scaleout/train/tasks.py) keeps one as ``task.batches``; the prefetch
workers (scaleout/train/prefetch.py) receive exactly that object. Data order is a pure function of the data
position (global samples consumed), so a checkpoint only stores that integer and resume is exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import torch

from scaleout.data.bert_batch import BertSequence, build_batch


@dataclass
class MicroBatch:
    inputs: Any  # what the model takes
    target: Any  # labels (None when the model computes its own loss)
    samples: int  # sequences / images in it (BERT: sequences, not packed rows)
    tokens: int  # real (non-pad) tokens; images count 0
    flops: float = (
        0.0  # training FLOPs of this micro-batch (counted where it is built: never a device read)
    )


def _no_flops(_batch: Any) -> float:
    return 0.0


def to_device(x: Any, device: torch.device) -> Any:
    """Tensors in ``x`` (nested dicts, lists, tuples) on ``device``, copied asynchronously where possible."""
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(to_device(v, device) for v in x)
    return x


class SequenceTable:
    """BERT sequences as flat numpy arrays with per-sequence offsets (CSR layout). It pickles as a few
    buffers, so a prefetch worker unpickles the training set in ~10 ms instead of one Python object
    per sequence (0.8 s for the 26,651 pydoc sequences of configs/bert_tiny_cpu.yaml).
    ``table[i]`` is sequence i as a :class:`~scaleout.data.bert_batch.BertSequence` of array views,
    which ``build_batch`` lays out exactly as the list form."""

    def __init__(self, seqs: list[Any]):
        def flat(field: str, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
            lens = np.fromiter(
                (len(getattr(q, field)) for q in seqs), dtype=np.int64, count=len(seqs)
            )
            values = np.fromiter(
                chain.from_iterable(getattr(q, field) for q in seqs),
                dtype=dtype,
                count=int(lens.sum()),
            )
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
        a, b, c, d = self.tok_off[i], self.tok_off[i + 1], self.mlm_off[i], self.mlm_off[i + 1]
        return BertSequence(
            self.tokens[a:b],
            self.segments[a:b],
            self.mlm_positions[c:d],
            self.mlm_labels[c:d],
            int(self.nsp_labels[i]),
        )


class BertBatches:
    """This rank's packed/padded BERT micro-batches on the CPU, from the tokenized sequences and the
    packs. Data only (no model, no World): it is what prefetch workers unpickle."""

    def __init__(
        self,
        seqs: Any,
        packs: list[list[int]],
        pack_tokens: np.ndarray,
        sampler: Any,
        max_len: int,
        max_pred: int,
        depth: int,
    ):
        self.seqs, self.packs, self.pack_tokens, self.sampler = seqs, packs, pack_tokens, sampler
        self.max_len, self.max_pred, self.depth = max_len, max_pred, depth
        self.flops: Callable[[dict[str, torch.Tensor]], float] = (
            _no_flops  # set by the task once the model exists
        )

    def micro_batches(self, position: int, grad_accum: int) -> list[MicroBatch]:
        rows = self.sampler.local_indices(position)
        out = []
        for part in np.array_split(rows, grad_accum):
            packs = [self.packs[i] for i in part]
            seqs = {j for p in packs for j in p}
            batch = build_batch(self.seqs, packs, self.max_len, self.max_pred, self.depth)
            out.append(
                MicroBatch(
                    batch, None, len(seqs), int(self.pack_tokens[part].sum()), self.flops(batch)
                )
            )
        return out


class ShardBertBatches:
    """This rank's BERT micro-batches read lazily from MLPerf shards (scaleout/data/shard_source.py). Data
    only: it pickles as file paths and per-shard counts, so prefetch workers start in milliseconds."""

    def __init__(self, stream: Any):
        self.stream = stream
        self.flops: Callable[[dict[str, torch.Tensor]], float] = (
            _no_flops  # set by the task once the model exists
        )

    def micro_batches(self, position: int, grad_accum: int) -> list[MicroBatch]:
        return [
            MicroBatch(b, None, n, t, self.flops(b))
            for b, n, t in self.stream.batches(position, grad_accum)
        ]


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
