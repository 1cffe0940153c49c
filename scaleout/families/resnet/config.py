"""``model.resnet``: the ResNet family's config section (torch-free: the schema reads it)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from scaleout.section import MAX_WORLD, Section


class ResNetConfig(Section):
    depth: Literal[18, 34, 50, 101, 152] = 50
    width: int = Field(64, ge=4, le=4096)
    num_classes: int = Field(1000, ge=2, le=1 << 20)
    image_size: int = Field(224, ge=8, le=8192)
    # Group batch norm: statistics over k ranks (1 = plain BN); record ResNet runs use 2..8.
    bn_group: int = Field(1, ge=1, le=MAX_WORLD)
    zero_init_residual: bool = True
    # Cross-entropy label smoothing (F.cross_entropy(label_smoothing=...)): every MLPerf ResNet
    # anchor (the reference, NVIDIA, torchvision's recipe) trains with 0.1; 0 = plain cross-entropy.
    label_smoothing: float = Field(0.0, ge=0.0, lt=1.0)
    # Batch-norm statistics at evaluation. "running": the moving averages, pooled over all ranks
    # before every evaluation and checkpoint (one all-reduce of every BN buffer). "batch": the
    # HPC-AI500 variant that drops the moving average (and its sync): each evaluation batch is
    # normalised with its own statistics (BN in training mode, running buffers left untouched).
    # Trade-off: no sync before eval, but the result depends on the eval batch size and content
    # (64 images per forward here), and a checkpoint's running buffers are not what was evaluated.
    eval_bn: Literal["running", "batch"] = "running"
    # Memory format of the model's weights and activations. "auto": channels_last on CUDA (cuDNN's
    # NHWC kernels, as every MLPerf ResNet); on a CPU a probe before run_start times a forward and
    # backward of this model on a synthetic local batch in each format (oneDNN's NHWC path was 1.2-
    # 1.35x faster for the CPU config's ResNet-18 on AMD EPYC) and every rank takes the one the
    # slowest rank found faster. "channels_last" / "contiguous" force one.
    memory_format: Literal["auto", "channels_last", "contiguous"] = "auto"
