"""Parameters and training FLOPs of the Llama family, from its config.

Matmul FLOPs only (one multiply-add = 2 FLOPs), training = 3 x forward, the convention of MFU
(PaLM, arXiv 2204.02311, appendix B). Per token and layer, forward: 2 x (the attention projections'
and SwiGLU's weights); the output projection 2 x hidden x vocab per token. The attention's
QK^T and AV cost 4 x hidden x (the keys a query sees): under the causal mask a query at position p
sees p + 1 keys, so a document of n tokens costs 2 x hidden x n (n + 1) per layer; documents packed
in one row are kept apart, so each counts its own length, never the row's. The input embedding is a
lookup (no FLOPs).
"""

from __future__ import annotations

from collections.abc import Iterable

from scaleout.families.llama.config import LlamaConfig


def layer_params(c: LlamaConfig) -> int:
    """One decoder layer's parameters: q, k, v, o projections, SwiGLU's three, two RMSNorms."""
    kv = c.kv_heads * c.head_dim
    return c.hidden * (2 * c.hidden + 2 * kv) + 3 * c.hidden * c.intermediate + 2 * c.hidden


def llama_params(c: LlamaConfig) -> int:
    """Every trainable parameter (the embedding and, untied, the output projection included)."""
    head = 0 if c.tie_embeddings else c.vocab_size * c.hidden
    return c.vocab_size * c.hidden + c.layers * layer_params(c) + c.hidden + head


def llama_param_tensors(c: LlamaConfig) -> int:
    """Parameter tensors (per-tensor optimizer work): 9 per layer, the embedding, the final norm
    and the untied output projection."""
    return 9 * c.layers + 2 + (0 if c.tie_embeddings else 1)


def dense_forward_flops_per_token(c: LlamaConfig) -> float:
    """Forward matmul FLOPs of one token outside the attention scores."""
    matmul_weights = layer_params(c) - 2 * c.hidden  # the norms are not matmuls
    return 2.0 * (c.layers * matmul_weights + c.hidden * c.vocab_size)


def training_flops(c: LlamaConfig, doc_lengths: Iterable[int]) -> float:
    """Forward + backward FLOPs of the documents of ``doc_lengths`` (in one or several rows)."""
    tokens = attn = 0.0
    for n in doc_lengths:
        tokens += n
        attn += 2.0 * c.hidden * n * (n + 1) * c.layers
    return 3.0 * (tokens * dense_forward_flops_per_token(c) + attn)


def training_flops_per_sequence(c: LlamaConfig) -> float:
    """One full row of ``seq_len`` tokens holding one document (MLPerf's C4 rows: the reference's
    FLOP count per sample)."""
    return training_flops(c, [c.seq_len])
