"""``model.bert``: the BERT family's config section (torch-free: the schema reads it)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from scaleout.section import Section

ATTENTION_KERNELS = ("sdpa", "explicit")  # model.bert.attention's kernels (auto picks one)


class BertConfig(Section):
    vocab_size: int = Field(30522, ge=8, le=1 << 20)
    hidden: int = Field(1024, ge=8, le=1 << 16)
    layers: int = Field(24, ge=1, le=1024)
    heads: int = Field(16, ge=1, le=1024)
    intermediate: int = Field(4096, ge=8, le=1 << 18)
    max_position: int = Field(512, ge=8, le=1 << 17)
    type_vocab_size: int = Field(2, ge=1, le=1024)
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    # gelu: exact (erf), as torch and Hugging Face's "gelu"; gelu_tanh: the tanh approximation of
    # Google's TF BERT and NVIDIA's MLPerf BERT (HF "gelu_new"), what the MLPerf phase-1 checkpoint
    # was trained with.
    activation: Literal["gelu", "gelu_tanh"] = "gelu"
    # NVIDIA's BERT computes the vocabulary projection only at masked positions (MLM-head
    # unpadding).
    unpad_mlm_head: bool = True
    # Capture-safe forward (no host syncs, static shapes): MLM/NSP heads gather every fixed slot
    # (max_predictions per sequence, as NVIDIA's masked_lm_positions + weights) and weight the loss.
    # None = on exactly when model.cuda_graphs=true.
    static_shapes: bool | None = None
    # Attention kernel: sdpa = torch's fused kernels (varlen flash attention for packed bf16/fp16
    # rows on CUDA, else scaled_dot_product_attention); explicit = two matmuls + an fp32 softmax;
    # auto = measured at start-up where they differ (CPU with bf16/fp16), else sdpa
    # (scaleout/families/bert/kernels.py).
    attention: Literal["auto", "sdpa", "explicit"] = "auto"

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> BertConfig:
        if self.hidden % self.heads:
            raise ValueError(
                f"model.bert.hidden={self.hidden} must be divisible by "
                f"model.bert.heads={self.heads}"
            )
        return self
