"""BERT's per-step micro-batch builders (data only: what prefetch workers unpickle), in memory
(:class:`BertBatches` over a :class:`SequenceTable`) or read lazily from MLPerf shards
(:class:`ShardBertBatches`)."""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from typing import Any

import numpy as np
import torch

from scaleout.data.batches import MicroBatch, no_flops
from scaleout.families.bert.data.bert_batch import BertSequence, build_batch


class SequenceTable:
    """BERT sequences as flat numpy arrays with per-sequence offsets (CSR layout). It pickles as
    a few buffers, so a prefetch worker unpickles the training set in ~10 ms instead of one
    Python object per sequence (0.8 s for the 26,651 pydoc sequences of
    configs/bert_tiny_cpu.yaml). ``table[i]`` is sequence i as a
    :class:`~scaleout.families.bert.data.bert_batch.BertSequence` of array views, which
    ``build_batch`` lays out exactly as the list form."""

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

        # narrow types (vocabularies and positions are far below 2**31): a quarter of int64's bytes
        # to pickle; build_batch writes them into int64 rows exactly
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
        # set by the task once the model exists
        self.flops: Callable[[dict[str, torch.Tensor]], float] = no_flops

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
    """This rank's BERT micro-batches read lazily from MLPerf shards
    (scaleout/families/bert/data/shard_source.py). Data only: it pickles as file paths and
    per-shard counts, so prefetch workers start in milliseconds."""

    def __init__(self, stream: Any):
        self.stream = stream
        # set by the task once the model exists
        self.flops: Callable[[dict[str, torch.Tensor]], float] = no_flops

    def micro_batches(self, position: int, grad_accum: int) -> list[MicroBatch]:
        return [
            MicroBatch(b, None, n, t, self.flops(b))
            for b, n, t in self.stream.batches(position, grad_accum)
        ]
