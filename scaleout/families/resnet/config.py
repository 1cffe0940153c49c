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
    # Cross-entropy label smoothing (the MLPerf LARS recipe and resnet_cpu use 0.1).
    label_smoothing: float = Field(0.0, ge=0.0, lt=1.0)
