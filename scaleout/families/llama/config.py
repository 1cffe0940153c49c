"""``model.llama``: the Llama family's config section (torch-free: the schema reads it).

The defaults are Llama 3.1 8B as MLPerf Training's ``llama31_8b`` benchmark trains it (Meta's
``config.json`` for Llama-3.1-8B: hidden 4096, 32 layers, 32 query heads over 8 key/value heads,
SwiGLU width 14336, vocabulary 128256, RoPE base 500000 with the "llama3" frequency scaling; the
benchmark's sequences are 8192 tokens). A CPU-tiny model is the same section with small numbers
(configs/llama_tiny_cpu.yaml).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from scaleout.section import Section


class LlamaConfig(Section):
    vocab_size: int = Field(128256, ge=2, le=1 << 22)
    hidden: int = Field(4096, ge=2, le=1 << 17)
    layers: int = Field(32, ge=1, le=1024)
    heads: int = Field(32, ge=1, le=4096)  # query heads
    kv_heads: int = Field(8, ge=1, le=4096)  # key/value heads (grouped-query attention)
    intermediate: int = Field(14336, ge=1, le=1 << 20)  # SwiGLU width
    seq_len: int = Field(8192, ge=2, le=1 << 20)  # tokens per training row
    rms_eps: float = Field(1e-5, gt=0.0, lt=1.0)
    rope_theta: float = Field(500000.0, gt=1.0)
    # Llama 3.1's RoPE frequency scaling ("llama3" in Hugging Face's rope_parameters): wavelengths
    # longer than original_max_position / low_freq_factor are divided by rope_factor, those
    # shorter than original_max_position / high_freq_factor kept, the band between interpolated.
    # rope_factor 1 turns the scaling off (plain RoPE).
    rope_factor: float = Field(8.0, ge=1.0)
    rope_low_freq_factor: float = Field(1.0, gt=0.0)
    rope_high_freq_factor: float = Field(4.0, gt=0.0)
    rope_original_max_position: int = Field(8192, ge=1)
    tie_embeddings: bool = False  # the 8B model has a separate output projection
    init_std: float = Field(0.02, gt=0.0)  # normal init of the weights (Hugging Face's default)
    # Train with each packed row's documents kept apart (a block-diagonal causal mask, positions
    # restarting per document, no loss across a boundary). false: a row is one causal sequence,
    # documents naively concatenated as a plain script's rows (bench ttt's baseline and its
    # ablation step). Evaluation always keeps the documents apart: the metric does not change.
    document_mask: bool = True
    # FP8 matmuls in the decoder layers through Transformer Engine (H100/H200; the fp8 extra):
    # scaleout/families/llama/fp8.py. Refused in one line anywhere else.
    fp8: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @model_validator(mode="after")
    def _shapes(self) -> LlamaConfig:
        if self.hidden % self.heads:
            raise ValueError(
                f"model.llama.hidden={self.hidden} must be a multiple of model.llama.heads="
                f"{self.heads}"
            )
        if self.heads % self.kv_heads:
            raise ValueError(
                f"model.llama.heads={self.heads} must be a multiple of model.llama.kv_heads="
                f"{self.kv_heads} (grouped-query attention)"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"model.llama.hidden/heads = {self.head_dim}: expected an even head size (RoPE "
                "rotates pairs)"
            )
        if self.rope_high_freq_factor <= self.rope_low_freq_factor and self.rope_factor > 1:
            raise ValueError(
                f"model.llama.rope_high_freq_factor={self.rope_high_freq_factor} must exceed "
                f"rope_low_freq_factor={self.rope_low_freq_factor}"
            )
        return self
