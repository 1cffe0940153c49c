"""The Llama 3.1 decoder (RMSNorm, rotary embeddings with Llama 3.1's frequency scaling,
grouped-query attention, SwiGLU), with packed rows whose documents never see each other.

Module names follow Hugging Face's ``LlamaForCausalLM`` (``model.embed_tokens``,
``model.layers.N.self_attn.q_proj``, ..., ``lm_head``) and the rotation is the same half-split
convention, so a state dict moves between the two unchanged (scaleout/families/llama/hf.py).

Packing: a row holds several documents, told apart by ``doc_ids`` (B, S) (equal ids = one
document; any integers). Every document's positions restart at 0, its tokens attend only to earlier
tokens of the same document (a block-diagonal causal mask), and the loss never predicts the first
token of a document from the last one of the previous: a packed row gives each document the loss
it gets alone (tests/families/llama/test_llama_model.py).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from scaleout.families.llama.config import LlamaConfig

IGNORE = -100  # cross_entropy's ignore_index: a position that predicts nothing


def rope_inv_freq(c: LlamaConfig) -> torch.Tensor:
    """RoPE's inverse frequencies (fp32) with Llama 3.1's scaling of the long wavelengths."""
    dim = c.head_dim
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if c.rope_factor == 1.0:
        return inv
    low_wavelen = c.rope_original_max_position / c.rope_low_freq_factor
    high_wavelen = c.rope_original_max_position / c.rope_high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / c.rope_factor, inv)
    smooth = (c.rope_original_max_position / wavelen - c.rope_low_freq_factor) / (
        c.rope_high_freq_factor - c.rope_low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / c.rope_factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def positions_of(doc_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position within its document (restarting at 0 where the id changes)."""
    s = doc_ids.shape[-1]
    idx = torch.arange(s, device=doc_ids.device).expand_as(doc_ids)
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[..., 1:] = doc_ids[..., 1:] != doc_ids[..., :-1]
    first = torch.cummax(torch.where(start, idx, torch.zeros_like(idx)), dim=-1).values
    return idx - first


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, S, S) bool: query i may attend key j iff j <= i within the same document."""
    s = doc_ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=doc_ids.device).tril()
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (same & causal)[:, None]


def labels_of(tokens: torch.Tensor, doc_ids: torch.Tensor | None) -> torch.Tensor:
    """Next-token targets: position i predicts token i + 1 of the same document; the last token of
    a document (and of the row) predicts nothing."""
    labels = torch.full_like(tokens, IGNORE)
    labels[:, :-1] = tokens[:, 1:]
    if doc_ids is not None:
        labels[:, :-1][doc_ids[:, 1:] != doc_ids[:, :-1]] = IGNORE
    return labels


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Rotary(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(c), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        # in fp32 whatever the autocast: positions up to 128k need the mantissa
        with torch.autocast(positions.device.type, enabled=False):
            freqs = positions[..., None].float() * self.inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.heads, c.kv_heads, c.head_dim
        kv = c.kv_heads * c.head_dim
        self.q_proj = nn.Linear(c.hidden, c.hidden, bias=False)
        self.k_proj = nn.Linear(c.hidden, kv, bias=False)
        self.v_proj = nn.Linear(c.hidden, kv, bias=False)
        self.o_proj = nn.Linear(c.hidden, c.hidden, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        # torch's fused kernels (flash / memory-efficient on GPU) with the key/value heads shared
        # by their query group; a packed row's block-diagonal mask keeps documents apart
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.kv_heads != self.heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.up_proj = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.down_proj = nn.Linear(c.intermediate, c.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden, c.rms_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden, c.rms_eps)
        self.mlp = MLP(c)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden, c.rms_eps)
        self.rotary_emb = Rotary(c)
        # the context the decoder stack runs in (model.llama.fp8: fp8.enable_fp8 sets it)
        self.stack_context: Callable[[], contextlib.AbstractContextManager] | None = None

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        if doc_ids is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
            mask = None
        else:
            positions, mask = positions_of(doc_ids), document_mask(doc_ids)
        cos, sin = self.rotary_emb(positions, x.dtype)
        with self.stack_context() if self.stack_context else contextlib.nullcontext():
            for layer in self.layers:
                x = layer(x, cos, sin, mask)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """The decoder and its output projection; ``forward`` returns logits (B, S, vocab)."""

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.config = c
        self.model = LlamaModel(c)
        self.lm_head = nn.Linear(c.hidden, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.reset_parameters(c.init_std)

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.normal_(0.0, std)

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(self.model(tokens, doc_ids))

    def loss(
        self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None, reduction: str = "mean"
    ) -> torch.Tensor:
        """Next-token cross-entropy (fp32), never across a document boundary."""
        return self.loss_of(self(tokens, doc_ids), tokens, doc_ids, reduction)

    @staticmethod
    def loss_of(
        logits: torch.Tensor,
        tokens: torch.Tensor,
        doc_ids: torch.Tensor | None,
        reduction: str = "mean",
    ) -> torch.Tensor:
        """The loss of ``logits`` this model computed for ``tokens`` (a wrapper such as
        DataParallel runs the forward; the loss is the family's)."""
        labels = labels_of(tokens, doc_ids)
        return F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]),
            labels.reshape(-1),
            ignore_index=IGNORE,
            reduction=reduction,
        )

    @staticmethod
    def predicted(tokens: torch.Tensor, doc_ids: torch.Tensor | None) -> torch.Tensor:
        """How many positions predict a token (the loss's denominator)."""
        return (labels_of(tokens, doc_ids) != IGNORE).sum()
