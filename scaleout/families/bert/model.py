"""BERT for pre-training (MLM + NSP) that takes packed and padded batches alike.

Contract (shared with the trainer; see docs/packing.md):

``BertForPreTraining(cfg: scaleout.families.bert.config.BertConfig)`` -- post-LN BERT (Devlin et al.
2019): GELU (``cfg.activation``: exact erf, or the tanh approximation Google's and NVIDIA's BERT
use), LayerNorm eps 1e-12, normal(0, 0.02) init, MLM decoder tied to the word embeddings. NSP class
1 = "B follows A" (the batch convention of :mod:`scaleout.families.bert.data.bert_batch`; Hugging
Face and the MLPerf data use class 0). Weights from Hugging Face and NVIDIA checkpoints:
:mod:`scaleout.families.bert.convert`. ``model(batch)`` takes one dict of int64 tensors (build it
with :mod:`scaleout.families.bert.data.bert_batch`):

=================  ========  ===================================================================
key                shape     meaning
=================  ========  ===================================================================
input_ids          [B, L]    token ids, PAD_ID (0) on padding
token_type_ids     [B, L]    segment A/B per sequence (0/1)
position_ids       [B, L]    restart at 0 for every sequence in the row
seq_ids            [B, L]    1..k = which sequence of the row a token belongs to, 0 = padding;
                             attention is restricted to tokens with the same non-zero seq_id
mlm_positions      [B, P]    row positions of masked tokens (0 where unused)
mlm_labels         [B, P]    original token ids there, IGNORE_INDEX (-100) where unused
nsp_positions      [B, S]    row position of each sequence's first ([CLS]) token (0 where unused)
nsp_labels         [B, S]    is-next label (0/1), IGNORE_INDEX where unused
=================  ========  ===================================================================

A padded batch is the special case of one sequence per row (S = 1). The result is a
:class:`BertOutput`: ``loss = mlm_loss + nsp_loss`` (each a mean over its valid labels), the MLM
logits at the valid masked positions in row-major order ``[N_masked, vocab]``, pooled outputs and
NSP logits per valid sequence ``[N_seq, ...]``, and the counts for accuracy
(``mlm_correct``/``mlm_total``).

Attention: on CPU (or fp32) ``scaled_dot_product_attention`` with a block-diagonal boolean mask from
``seq_ids``; on CUDA with fp16/bf16 activations the tokens are unpadded and run through
``torch.nn.attention.varlen.varlen_attn`` (flash attention with cu_seqlens, as NVIDIA's MLPerf v2.0
BERT does) when that function exists, else the masked SDPA. varlen_attn has no dropout argument
(torch 2.13 hardcodes ``dropout_p=0``), so training with ``cfg.dropout > 0`` takes the masked SDPA,
which applies attention-probability dropout as the MLPerf reference does
(``attention_probs_dropout_prob``); evaluation, and training without dropout, take varlen
(:meth:`BertForPreTraining.uses_varlen`). That is the "sdpa" kernel. ``cfg.attention="explicit"``
runs :func:`explicit_attention` instead (two matmuls and an fp32 softmax, the same mask and
dropout), which on a CPU in bf16 trains 2x faster than torch 2.13's flash-attention kernel
there; ``"auto"`` (default) is resolved by a start-up probe of both
(:mod:`scaleout.families.bert.kernels`), and a model built by hand runs "sdpa" until
:meth:`BertForPreTraining.set_attention`.

``cfg.unpad_mlm_head``: project to the vocabulary only at the masked positions (gather first, as
NVIDIA's BERT does) instead of at all B x L tokens; identical loss and gradients, far fewer FLOPs.

``cfg.static_shapes`` (capture-safe forward, for CUDA graphs and ``fullgraph`` compiles): nothing in
the forward depends on tensor *values* for a shape or a branch, so the host never waits on the
device. The default forward selects the valid masked positions (``labels[labels != -100]``: output
size known only after a device->host sync), checks ``int(position_ids.max())`` and, on CUDA, builds
varlen ``cu_seqlens`` with ``nonzero``. The static forward instead gathers *every* slot of the fixed
``[B, P]`` MLM and ``[B, S]`` NSP tables (the layout already has ``max_predictions`` slots per
sequence, padded with position 0, like NVIDIA's ``masked_lm_positions`` + ``masked_lm_weights``) and
weights the per-slot loss by validity: ``sum(w * ce) / max(sum(w), 1)``, the same mean over valid
labels (same loss and gradients to float rounding; padded slots contribute exact zeros). It skips
the position range check (the data pipeline keeps positions < ``data.max_seq_len`` <=
``max_position``, checked at start-up) and uses the masked SDPA, never varlen. Outputs then cover
all slots, ``[B*P, vocab]`` and ``[B*S, ...]``, with ``mlm_valid``/``nsp_valid`` saying which are
real; ``mlm_logits[mlm_valid]`` equals the default output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from scaleout.families.bert.config import ATTENTION_KERNELS, BertConfig

PAD_ID = 0
IGNORE_INDEX = -100
LN_EPS = 1e-12  # BERT's LayerNorm epsilon (google-research/bert modeling.py)
INIT_STD = 0.02  # BERT's initializer_range


@dataclass
class BertOutput:
    loss: torch.Tensor
    mlm_loss: torch.Tensor
    nsp_loss: torch.Tensor
    mlm_logits: torch.Tensor  # [N_masked, vocab] at valid masked positions, row-major order
    mlm_correct: torch.Tensor  # scalar int64
    mlm_total: torch.Tensor  # scalar int64
    nsp_logits: torch.Tensor  # [N_seq, 2] for sequences with a valid nsp label
    nsp_correct: torch.Tensor
    nsp_total: torch.Tensor
    pooled: torch.Tensor  # [N_seq, hidden], same sequences as nsp_logits
    sequence_output: torch.Tensor  # [B, L, hidden] final encoder states
    # static_shapes only: which rows of mlm_logits ([B*P]) / nsp_logits and pooled ([B*S]) are real
    mlm_valid: torch.Tensor | None = None
    nsp_valid: torch.Tensor | None = None


def attention_mask(seq_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, L, L] bool: token i may attend to j iff both belong to the same (non-padding)
    sequence.

    Padding queries attend only to themselves so that no softmax row is empty (an all-False row
    would give NaN); their outputs are never read.
    """
    same = seq_ids[:, :, None] == seq_ids[:, None, :]
    real = (seq_ids != 0)[:, None, :]
    eye = torch.eye(seq_ids.shape[1], dtype=torch.bool, device=seq_ids.device)
    return ((same & real) | eye)[:, None]


def varlen_available(x: torch.Tensor) -> bool:
    """CUDA with fp16/bf16 attention inputs: ``x``'s dtype, or autocast's (q/k/v come out of a
    Linear)."""
    on = x.is_cuda and torch.is_autocast_enabled("cuda")
    dtype = torch.get_autocast_dtype("cuda") if on else x.dtype
    if not (x.is_cuda and dtype in (torch.float16, torch.bfloat16)):
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401  # deferred: newer torch only
    except ImportError:
        return False
    return True


def cu_seqlens(seq_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(flat indices of real tokens, cumulative sequence starts int32 [N+1], longest sequence)."""
    b, n = seq_ids.shape
    flat = seq_ids.reshape(-1)
    idx = torch.nonzero(flat > 0).squeeze(1)
    key = (idx // n) * (int(seq_ids.max()) + 1) + flat[
        idx
    ]  # (row, seq) -> one id; sequences are contiguous
    starts = torch.nonzero(key[1:] != key[:-1]).squeeze(1) + 1
    zero = torch.zeros(1, dtype=starts.dtype, device=starts.device)
    end = torch.full((1,), idx.numel(), dtype=starts.dtype, device=starts.device)
    cu = torch.cat([zero, starts, end]).to(torch.int32)
    return idx, cu, int((cu[1:] - cu[:-1]).max())


def _top1(logits: torch.Tensor) -> torch.Tensor:
    """Index of the first maximum along the last dim: ``argmax``'s result. ``max(-1).indices``
    because torch 2.13's CPU argmax is not vectorised for bf16 (2.6 against 0.6 ms for the tiny
    BERT's 180 x 4,096 MLM logits, 6 % of its step)."""
    return logits.max(-1).indices


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, p: float
) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)


def explicit_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, p: float
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v as two matmuls and a softmax in fp32, [B, H, L, D].

    The same function as ``scaled_dot_product_attention`` (the same scale, a boolean mask that
    keeps True, attention-probability dropout ``p``), in plain ops. The scores are computed in the
    inputs' dtype (bf16 under autocast), normalised in fp32 and cast back for the second matmul.
    """
    s = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-1, -2))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    a = torch.softmax(s, dim=-1, dtype=torch.float32)
    if p > 0:
        a = F.dropout(a, p)
    return torch.matmul(a.to(v.dtype), v)


def attention_fn(kernel: str) -> Any:
    """The function of an attention kernel name (looked up at call time)."""
    return explicit_attention if kernel == "explicit" else _sdpa


class SelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.hidden // cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.hidden)
        self.dropout = cfg.dropout
        # "sdpa" or "explicit" (model.bert.attention; auto runs sdpa until the task's start-up
        # probe sets it: scaleout/families/bert/kernels.py)
        self.kernel = "explicit" if cfg.attention == "explicit" else "sdpa"

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None, varlen: tuple | None
    ) -> torch.Tensor:
        b, n, h = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.head_dim).unbind(2)
        if varlen is not None:
            from torch.nn.attention.varlen import varlen_attn  # deferred: newer torch only

            idx, cu, longest = varlen
            sel = lambda t: t.reshape(b * n, self.heads, self.head_dim)[idx]  # noqa: E731
            o = varlen_attn(sel(q), sel(k), sel(v), cu, cu, longest, longest)
            ctx = (
                x.new_zeros(b * n, self.heads, self.head_dim)
                .index_copy(0, idx, o.to(x.dtype))
                .view(b, n, h)
            )
        else:
            p = self.dropout if self.training else 0.0
            ctx = attention_fn(self.kernel)(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, p
            )
            ctx = ctx.transpose(1, 2).reshape(b, n, h)
        return self.out(ctx)


def activation(cfg: BertConfig) -> nn.Module:
    """The FFN / MLM-transform nonlinearity: exact GELU or its tanh approximation (HF
    ``gelu_new``)."""
    return nn.GELU(approximate="tanh" if cfg.activation == "gelu_tanh" else "none")


class Layer(nn.Module):
    """Post-LN transformer layer: x = LN(x + Attn(x)); x = LN(x + FFN(x)) (original BERT)."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.act = activation(cfg)
        self.attn = SelfAttention(cfg)
        self.ln1 = nn.LayerNorm(cfg.hidden, eps=LN_EPS)
        self.fc1 = nn.Linear(cfg.hidden, cfg.intermediate)
        self.fc2 = nn.Linear(cfg.intermediate, cfg.hidden)
        self.ln2 = nn.LayerNorm(cfg.hidden, eps=LN_EPS)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None, varlen: tuple | None
    ) -> torch.Tensor:
        x = self.ln1(x + self.drop(self.attn(x, mask, varlen)))
        return self.ln2(x + self.drop(self.fc2(self.act(self.fc1(x)))))


class BertForPreTraining(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.cfg = cfg
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden, padding_idx=PAD_ID)
        self.position = nn.Embedding(cfg.max_position, cfg.hidden)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden)
        self.emb_ln = nn.LayerNorm(cfg.hidden, eps=LN_EPS)
        self.emb_drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.layers))
        self.pooler = nn.Linear(cfg.hidden, cfg.hidden)
        self.mlm_transform = nn.Linear(cfg.hidden, cfg.hidden)
        self.mlm_ln = nn.LayerNorm(cfg.hidden, eps=LN_EPS)
        self.mlm_bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        self.nsp = nn.Linear(cfg.hidden, 2)
        self.act = activation(cfg)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=INIT_STD)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    def encode(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B, L, hidden] encoder output; attention restricted to each row's sequences."""
        ids, seq = batch["input_ids"], batch["seq_ids"]
        pos = batch["position_ids"]
        static = self.cfg.static_shapes
        # a host sync: not in the static forward
        if not static and int(pos.max()) >= self.cfg.max_position:
            raise ValueError(
                f"position id {int(pos.max())} >= model.bert.max_position={self.cfg.max_position}"
            )
        x = self.word(ids) + self.position(pos) + self.token_type(batch["token_type_ids"])
        x = self.emb_drop(self.emb_ln(x))
        varlen = cu_seqlens(seq) if not static and self.uses_varlen(x) else None
        mask = None if varlen is not None else attention_mask(seq)
        for layer in self.layers:
            x = layer(x, mask, varlen)
        return x

    def uses_varlen(self, x: torch.Tensor) -> bool:
        """Whether attention runs through varlen flash attention: available for ``x`` (CUDA,
        fp16/bf16) and no attention dropout to apply (varlen_attn has none; the masked SDPA
        keeps it, so the recipe's dropout is never dropped silently)."""
        if self.training and self.cfg.dropout > 0:
            return False
        return self.attention == "sdpa" and varlen_available(x)

    @property
    def attention(self) -> str:
        """The attention kernel every layer runs: "sdpa" (torch's fused kernels: varlen flash
        attention for packed fp16/bf16 rows on CUDA, else scaled_dot_product_attention) or
        "explicit" (:func:`explicit_attention`)."""
        return self.layers[0].attn.kernel

    def set_attention(self, kernel: str) -> None:
        if kernel not in ATTENTION_KERNELS:
            raise ValueError(f"attention kernel {kernel!r}: expected one of {ATTENTION_KERNELS}")
        for layer in self.layers:
            layer.attn.kernel = kernel

    def mlm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        t = self.mlm_ln(self.act(self.mlm_transform(hidden)))
        return F.linear(t, self.word.weight, self.mlm_bias)  # decoder tied to the input embeddings

    def forward(self, batch: dict[str, torch.Tensor]) -> BertOutput:
        hidden = self.encode(batch)
        if self.cfg.static_shapes:
            return self._heads_static(hidden, batch)
        b, n, h = hidden.shape
        labels = batch["mlm_labels"]
        valid = labels != IGNORE_INDEX
        rows = torch.arange(b, device=hidden.device)[:, None].expand_as(labels)
        # One value-shaped selection per head (a host sync each: the static forward has none), then
        # plain gathers: the same elements in the same row-major order as boolean masking.
        picked = valid.reshape(-1).nonzero().squeeze(1)
        flat_pos = (rows * n + batch["mlm_positions"]).reshape(-1).index_select(0, picked)
        target = labels.reshape(-1).index_select(0, picked)
        if self.cfg.unpad_mlm_head:
            logits = self.mlm_logits(hidden.reshape(b * n, h).index_select(0, flat_pos))
        else:
            logits = self.mlm_logits(hidden).reshape(b * n, -1).index_select(0, flat_pos)
        zero = hidden.sum() * 0.0  # a graph-connected 0 for batches without labels
        mlm_loss = F.cross_entropy(logits.float(), target) if target.numel() else zero
        nsp_valid = batch["nsp_labels"] != IGNORE_INDEX
        srows = torch.arange(b, device=hidden.device)[:, None].expand_as(batch["nsp_labels"])
        seqs = nsp_valid.reshape(-1).nonzero().squeeze(1)
        first_at = (srows * n + batch["nsp_positions"]).reshape(-1).index_select(0, seqs)
        first = hidden.reshape(b * n, h).index_select(0, first_at)  # [N_seq, hidden]
        pooled = torch.tanh(self.pooler(first))
        nsp_logits = self.nsp(pooled)
        nsp_target = batch["nsp_labels"].reshape(-1).index_select(0, seqs)
        nsp_loss = F.cross_entropy(nsp_logits.float(), nsp_target) if nsp_target.numel() else zero
        with torch.no_grad():
            mlm_correct = (_top1(logits) == target).sum()
            nsp_correct = (_top1(nsp_logits) == nsp_target).sum()
        return BertOutput(
            loss=mlm_loss + nsp_loss,
            mlm_loss=mlm_loss,
            nsp_loss=nsp_loss,
            mlm_logits=logits,
            mlm_correct=mlm_correct,
            mlm_total=valid.sum(),  # counted on the device: no host -> device copy
            nsp_logits=nsp_logits,
            nsp_correct=nsp_correct,
            nsp_total=nsp_valid.sum(),
            pooled=pooled,
            sequence_output=hidden,
        )

    def _heads_static(self, hidden: torch.Tensor, batch: dict[str, torch.Tensor]) -> BertOutput:
        """MLM + NSP heads over every fixed slot, loss weighted by validity (module docstring)."""
        b, n, h = hidden.shape
        rows = torch.arange(b, device=hidden.device)[:, None] * n
        flat = hidden.reshape(b * n, h)
        labels = batch["mlm_labels"].reshape(-1)  # [B*P]
        mlm_valid = labels != IGNORE_INDEX
        # unused slots point at each row's token 0
        slots = (rows + batch["mlm_positions"]).reshape(-1)
        if self.cfg.unpad_mlm_head:
            logits = self.mlm_logits(flat.index_select(0, slots))
        else:
            logits = self.mlm_logits(hidden).reshape(b * n, -1).index_select(0, slots)
        mlm_loss, mlm_total = _weighted_ce(logits, labels, mlm_valid)
        nsp_labels = batch["nsp_labels"].reshape(-1)  # [B*S]
        nsp_valid = nsp_labels != IGNORE_INDEX
        pooled = torch.tanh(
            self.pooler(flat.index_select(0, (rows + batch["nsp_positions"]).reshape(-1)))
        )
        nsp_logits = self.nsp(pooled)
        nsp_loss, nsp_total = _weighted_ce(nsp_logits, nsp_labels, nsp_valid)
        with torch.no_grad():
            mlm_correct = ((_top1(logits) == labels) & mlm_valid).sum()
            nsp_correct = ((_top1(nsp_logits) == nsp_labels) & nsp_valid).sum()
        return BertOutput(
            loss=mlm_loss + nsp_loss,
            mlm_loss=mlm_loss,
            nsp_loss=nsp_loss,
            mlm_logits=logits,
            mlm_correct=mlm_correct,
            mlm_total=mlm_total,
            nsp_logits=nsp_logits,
            nsp_correct=nsp_correct,
            nsp_total=nsp_total,
            pooled=pooled,
            sequence_output=hidden,
            mlm_valid=mlm_valid,
            nsp_valid=nsp_valid,
        )


def _weighted_ce(
    logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy over the valid rows, their count) with static shapes: ignored rows
    give an exact 0 (``ignore_index``), the count stays on the device; no valid row -> a
    graph-connected 0."""
    per_row = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="none")
    total = valid.sum()
    return per_row.sum() / total.clamp_min(1), total
