"""Deterministic synthetic ImageNet-shaped images, for unit tests and throughput runs only.

Every class c has a fixed random low-frequency template; sample i (label drawn from (seed, i)) is
template[label] + Gaussian noise. Trivially separable (a mean-colour classifier scores ~96 %): never
a time-to-train target (configs/resnet_cpu.yaml trains on Fashion-MNIST). ``fixed_batch`` returns
one pre-generated batch for throughput runs (MLPerf-style synthetic data: the input pipeline is
taken out of the measurement).
"""

from __future__ import annotations

import numpy as np
import torch

from scaleout.errors import UserError
from scaleout.families.resnet.data.transforms import MEAN, STD
from scaleout.families.resnet.imagenet import IMAGENET_TRAIN_IMAGES


class SyntheticImages:
    def __init__(
        self,
        num_classes: int = 1000,
        image_size: int = 224,
        length: int = IMAGENET_TRAIN_IMAGES,
        seed: int = 0,
        noise: float = 1.0,
        uint8: bool = False,
    ):
        if num_classes < 2 or image_size < 8 or length < 1:
            raise UserError(
                f"synthetic images need num_classes >= 2, image_size >= 8 and length >= 1, got "
                f"{num_classes}, {image_size}, {length}"
            )
        self.num_classes, self.image_size, self.length, self.seed, self.noise = (
            num_classes,
            image_size,
            length,
            seed,
            noise,
        )
        self.uint8 = uint8
        g = torch.Generator().manual_seed(seed)
        low = torch.randn(num_classes, 3, 4, 4, generator=g)
        self.templates = torch.nn.functional.interpolate(
            low, size=(image_size, image_size), mode="bilinear", align_corners=False
        )

    def __len__(self) -> int:
        return self.length

    def labels(self, indices: np.ndarray) -> torch.Tensor:
        return torch.tensor(
            [
                int(np.random.default_rng([self.seed, int(i)]).integers(self.num_classes))
                for i in indices
            ],
            dtype=torch.long,
        )

    def get(self, indices: np.ndarray, epoch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(images, labels [B] int64) for the given sample indices: images are normalised float32
        [B, 3, S, S], or with ``uint8`` the host batch format of the real sources, uint8
        [B, S, S, 3] RGB pixels (the float image de-normalised with transforms.MEAN/STD, rounded and
        clipped to 0..255; the task's prepare_inputs normalises it back on the device)."""
        y = self.labels(indices)
        s = self.image_size
        noise = (
            torch.stack(
                [
                    torch.randn(
                        3,
                        s,
                        s,
                        generator=torch.Generator().manual_seed(self.seed * 1_000_003 + int(i)),
                    )
                    for i in indices
                ]
            )
            if len(indices)
            else torch.zeros(0, 3, s, s)
        )
        x = self.templates[y] + self.noise * noise
        return (to_uint8_nhwc(x) if self.uint8 else x), y

    def fixed_batch(
        self, batch: int, device: str | torch.device = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.get(np.arange(batch))
        return x.to(device), y.to(device)


def to_uint8_nhwc(x: torch.Tensor) -> torch.Tensor:
    """Normalised float NCHW -> uint8 NHWC pixels (the inverse of the device normalisation,
    rounded and clipped)."""
    mean = torch.from_numpy(MEAN).view(1, 3, 1, 1)
    std = torch.from_numpy(STD).view(1, 3, 1, 1)
    px = ((x * std + mean) * 255.0).round_().clamp_(0, 255)
    return px.to(torch.uint8).permute(0, 2, 3, 1).contiguous()
