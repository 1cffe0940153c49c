"""Training FLOPs of one BERT step, counted from what the step ran.

Matmul FLOPs only (one multiply-add = 2 FLOPs), the convention of MFU (PaLM, arXiv 2204.02311,
appendix B) and of ``torch.utils.flop_counter.FlopCounterMode``; training = 3 x forward (the
backward of every matmul computes the input and the weight gradient). Per forward:

* encoder, per real token and layer: 2 x (4 d^2 + 2 d f) for QKV, output projection and the FFN;
* attention, per sequence of s real tokens and layer: 4 d s^2 for QK^T and AV. With packing the
  attention is block-diagonal, so each sequence counts its own s^2, not the row's length;
* MLM head (transform d x d + decoder d x V) at every row position it ran on: the masked positions
  when ``unpad_mlm_head``, every position of every row otherwise; the capture-safe forward
  (``static_shapes``) runs it on every fixed slot;
* pooler (d x d) + NSP classifier (d x 2) at each sequence's first token (every slot when static).

Padding tokens and masked-out attention blocks are not counted (they are not model work), so MFU
measures useful work; ``tests/families/bert/test_flops.py`` checks the count against FlopCounterMode
run on each sequence alone.

This module is the one owner of BERT's FLOP and parameter formulas: the trainer counts each batch
with :func:`batch_flops`, the simulator (scaleout.sim) and the sweep's cost column read
:func:`sequence_training_flops` and :func:`bert_params` through the family (scaleout.families.bert).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from scaleout.families.bert.config import BertConfig


def bert_training_flops(
    cfg: BertConfig, tokens: float, tokens_sq: float, mlm_rows: int, nsp_rows: int
) -> float:
    """FLOPs of forward + backward over sequences with ``tokens`` real tokens in all and
    ``tokens_sq`` = the sum of their squared lengths, with the MLM head run on ``mlm_rows``
    positions and the NSP head on ``nsp_rows``."""
    d, f, layers, vocab = (
        float(cfg.hidden),
        float(cfg.intermediate),
        float(cfg.layers),
        float(cfg.vocab_size),
    )
    encoder = layers * (2.0 * tokens * (4 * d * d + 2 * d * f) + 4.0 * d * tokens_sq)
    heads = mlm_rows * (2 * d * d + 2 * d * vocab) + nsp_rows * (2 * d * d + 2 * d * 2)
    return 3.0 * (encoder + heads)


# Mean real length of a Wikipedia-512 sequence implied by the packing ceiling of 2.0013 sequences
# per 512-token row (Graphcore arXiv 2107.02027; DESIGN facts).
WIKI_512_MEAN_TOKENS = 512 / 2.0013


def sequence_training_flops(
    cfg: BertConfig, tokens: float = WIKI_512_MEAN_TOKENS, masked_fraction: float = 0.15
) -> float:
    """:func:`bert_training_flops` of one sequence of ``tokens`` real tokens (its own attention
    span), the MLM head on ``masked_fraction`` of them and the NSP head once (the simulator's
    sample)."""
    return bert_training_flops(cfg, tokens, tokens * tokens, masked_fraction * tokens, 1)


def bert_params(cfg: BertConfig) -> int:
    """Parameters of BertForPreTraining (decoder tied to the word embeddings): 336.2M for
    BERT-large."""
    d, inter, vocab = cfg.hidden, cfg.intermediate, cfg.vocab_size
    embeddings = (vocab + cfg.max_position + cfg.type_vocab_size) * d + 2 * d
    layer = 4 * d * d + 2 * d * inter + 9 * d + inter  # attention, FFN, two layer norms
    heads = (d * d + d) + (d * d + 3 * d + vocab) + (2 * d + 2)  # pooler, MLM transform + bias, NSP
    return embeddings + cfg.layers * layer + heads


def sequence_flops(
    cfg: BertConfig, seq_lens: Sequence[int] | np.ndarray, mlm_rows: int, nsp_rows: int
) -> float:
    """:func:`bert_training_flops` from the sequences' lengths."""
    lens = np.asarray(seq_lens, dtype=np.float64)
    return bert_training_flops(cfg, float(lens.sum()), float((lens**2).sum()), mlm_rows, nsp_rows)


def head_rows(
    cfg: BertConfig,
    rows: int,
    max_len: int,
    n_masked: int,
    n_seqs: int,
    mlm_slots: int,
    nsp_slots: int,
) -> tuple[int, int]:
    """(MLM head positions, NSP head positions) that ``BertForPreTraining`` runs for a batch of
    ``rows`` rows of ``max_len`` tokens with ``mlm_slots``/``nsp_slots`` slots per row
    (scaleout.families.bert.model)."""
    if cfg.static_shapes:
        mlm = rows * mlm_slots if cfg.unpad_mlm_head else rows * max_len
        return mlm, rows * nsp_slots
    return (n_masked if cfg.unpad_mlm_head else rows * max_len), n_seqs


def batch_flops(cfg: BertConfig, batch: dict) -> float:
    """:func:`bert_training_flops` of one CPU batch from
    :func:`scaleout.families.bert.data.bert_batch.build_batch`: the sequences' lengths from
    ``seq_ids`` (one id per sequence of a row, 0 = padding), the masked count from ``mlm_labels``
    and the head slots from the batch's shapes. Runs where the batch is built (prefetch workers
    included), so counting never reads the device."""
    from scaleout.families.bert.data.bert_batch import (
        IGNORE_INDEX,
    )  # deferred: flops.py is torch-free

    ids = np.asarray(batch["seq_ids"])
    rows, max_len = ids.shape
    key = (np.arange(rows)[:, None] * (int(ids.max(initial=0)) + 1) + ids)[ids > 0]
    lens = np.bincount(key)
    lens = lens[lens > 0]
    n_masked = int((np.asarray(batch["mlm_labels"]) != IGNORE_INDEX).sum())
    mlm, nsp = head_rows(
        cfg,
        rows,
        max_len,
        n_masked,
        len(lens),
        batch["mlm_positions"].shape[1],
        batch["nsp_positions"].shape[1],
    )
    return sequence_flops(cfg, lens, mlm, nsp)
