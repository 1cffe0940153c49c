"""BERT pre-training batches, packed or padded, in the layout :mod:`scaleout.families.bert.model`
expects.

A :class:`BertSequence` is one tokenized pre-training example (``[CLS] A [SEP] B [SEP]``, its
segment ids, masked positions with their original tokens, the NSP label). :func:`build_batch` lays
out rows: packed mode puts several sequences in one row (NVIDIA MLPerf v2.0 BERT / Graphcore
packedBERT):

- position ids restart at 0 for each sequence, token-type ids are each sequence's own;
- ``seq_ids`` = 1..k per sequence (0 = padding) restricts attention to the sequence;
- MLM positions are offset by the sequence's start in the row; NSP positions point at each
  sequence's first token, where the pooler reads it.

Padded mode is the same with one sequence per row. ``packs`` is a list of rows, each a list of
indices into ``sequences`` (e.g. ``PackedSequences.packs()`` from
:mod:`scaleout.families.bert.packing`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from scaleout.errors import UserError

PAD_ID, CLS_ID, SEP_ID, MASK_ID = 0, 1, 2, 3  # the synthetic vocabulary's special tokens
FIRST_WORD_ID = 4
# same as scaleout.families.bert.model.IGNORE_INDEX and torch's cross_entropy default
IGNORE_INDEX = -100


@dataclass
class BertSequence:
    tokens: list[int]  # with [CLS] ... [SEP] ... [SEP], masked positions already replaced
    segments: list[int]  # 0 for A (incl. [CLS] and the first [SEP]), 1 for B
    mlm_positions: list[int]  # positions within this sequence
    mlm_labels: list[int]  # original tokens at those positions
    nsp_label: int  # 1 = B follows A (is-next), 0 = random B; IGNORE_INDEX = none

    def __len__(self) -> int:
        return len(self.tokens)


def build_batch(
    sequences: Sequence[BertSequence],
    packs: Sequence[Sequence[int]],
    max_len: int,
    max_predictions: int | None = None,
    max_per_pack: int | None = None,
) -> dict[str, torch.Tensor]:
    """Rows of ``max_len`` tokens, one per pack; MLM slots ``max_predictions`` (default: the most
    any row needs) and NSP slots ``max_per_pack`` (default: the deepest pack) per row."""
    if max_len < 1:
        raise UserError(f"max_len={max_len} must be >= 1")
    rows = len(packs)
    depth = max((len(p) for p in packs), default=1)
    need_pred = max((sum(len(sequences[i].mlm_positions) for i in p) for p in packs), default=0)
    p_slots = need_pred if max_predictions is None else max_predictions
    s_slots = depth if max_per_pack is None else max_per_pack
    if need_pred > p_slots:
        raise UserError(f"a row has {need_pred} masked tokens, more than max_predictions={p_slots}")
    if depth > s_slots:
        raise UserError(f"a pack has {depth} sequences, more than max_per_pack={s_slots}")
    a = {
        k: np.zeros((rows, max_len), dtype=np.int64)
        for k in ("input_ids", "token_type_ids", "position_ids", "seq_ids")
    }
    mlm_pos = np.zeros((rows, max(p_slots, 1)), dtype=np.int64)
    mlm_lab = np.full((rows, max(p_slots, 1)), IGNORE_INDEX, dtype=np.int64)
    nsp_pos = np.zeros((rows, s_slots), dtype=np.int64)
    nsp_lab = np.full((rows, s_slots), IGNORE_INDEX, dtype=np.int64)
    for r, pack in enumerate(packs):
        start, m = 0, 0
        for j, i in enumerate(pack):
            s = sequences[i]
            n = len(s)
            if start + n > max_len:
                raise UserError(
                    f"pack {r} ({[len(sequences[k]) for k in pack]}) is longer than "
                    f"max_len={max_len}"
                )
            a["input_ids"][r, start : start + n] = s.tokens
            a["token_type_ids"][r, start : start + n] = s.segments
            a["position_ids"][r, start : start + n] = np.arange(n)
            a["seq_ids"][r, start : start + n] = j + 1
            k = len(s.mlm_positions)
            mlm_pos[r, m : m + k] = np.asarray(s.mlm_positions, dtype=np.int64) + start
            mlm_lab[r, m : m + k] = s.mlm_labels
            nsp_pos[r, j] = start
            nsp_lab[r, j] = s.nsp_label
            start, m = start + n, m + k
    out = {k: torch.from_numpy(v) for k, v in a.items()}
    out.update(
        mlm_positions=torch.from_numpy(mlm_pos),
        mlm_labels=torch.from_numpy(mlm_lab),
        nsp_positions=torch.from_numpy(nsp_pos),
        nsp_labels=torch.from_numpy(nsp_lab),
    )
    return out


def padded_packs(n: int) -> list[list[int]]:
    """The padded layout: sequence i alone in row i."""
    return [[i] for i in range(n)]


def synthetic_sequence(
    length: int, vocab_size: int, rng: np.random.Generator, mask_prob: float = 0.15
) -> BertSequence:
    """A random ``[CLS] A [SEP] B [SEP]`` example of ``length`` tokens with BERT's masking:
    ``mask_prob`` of the word tokens (at least 1) are predicted; of those 80 % become [MASK], 10
    % a random word, 10 % stay (Devlin et al. 2019)."""
    if length < 1:
        raise UserError(f"sequence length {length} must be >= 1")
    if vocab_size <= FIRST_WORD_ID:
        raise UserError(f"vocab_size={vocab_size} must be > {FIRST_WORD_ID} (special tokens)")
    words = rng.integers(FIRST_WORD_ID, vocab_size, size=length).tolist()
    tokens = [CLS_ID] + words[1:]
    segments = [0] * length
    word_pos = list(range(1, length))
    if length >= 5:  # A and B, each with >= 1 word: [CLS] a.. [SEP] b.. [SEP]
        sep = int(rng.integers(2, length - 2))
        tokens[sep], tokens[-1] = SEP_ID, SEP_ID
        segments = [0] * (sep + 1) + [1] * (length - sep - 1)
        word_pos = [p for p in range(1, length - 1) if p != sep]
    elif length >= 3:
        tokens[-1] = SEP_ID
        word_pos = list(range(1, length - 1))
    n_mask = max(1, int(round(mask_prob * len(word_pos)))) if word_pos else 0
    positions = sorted(rng.choice(word_pos, size=n_mask, replace=False).tolist()) if n_mask else []
    labels = [tokens[p] for p in positions]
    for p in positions:
        u = rng.random()
        if u < 0.8:
            tokens[p] = MASK_ID
        elif u < 0.9:
            tokens[p] = int(rng.integers(FIRST_WORD_ID, vocab_size))
    return BertSequence(tokens, segments, positions, labels, int(rng.integers(0, 2)))


def synthetic_sequences(
    lengths: Sequence[int] | np.ndarray, vocab_size: int, seed: int = 0, mask_prob: float = 0.15
) -> list[BertSequence]:
    rng = np.random.default_rng(seed)
    return [synthetic_sequence(int(n), vocab_size, rng, mask_prob) for n in lengths]


def sample_lengths(h: np.ndarray, n: int, seed: int = 0) -> np.ndarray:
    """``n`` sequence lengths drawn from histogram ``h`` (``h[l]`` = count of length l)."""
    p = np.asarray(h, dtype=np.float64)
    if p.sum() <= 0:
        raise UserError("cannot sample lengths from an empty histogram")
    return np.random.default_rng(seed).choice(len(p), size=n, p=p / p.sum())
