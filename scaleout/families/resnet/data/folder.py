"""ImageFolder: ``<root>/<split>/<class>/<image>`` read with PIL.

Real ImageNet layout expected at ``data.path`` (the torchvision ImageFolder layout; ILSVRC2012's
``train/`` tar unpacks into it, and the validation set needs its 50k images moved into class
folders)::

    <path>/train/<wnid>/*.JPEG     e.g. train/n01440764/n01440764_10026.JPEG
    <path>/val/<wnid>/*.JPEG

Classes are the sorted folder names (label = position). Training images get the MLPerf reference
augmentation (random-resized crop, scale 0.08-1, aspect 3/4-4/3, then a random horizontal flip),
deterministic per (seed, epoch, index); evaluation images are resized to S/0.875 on the short side
and center-cropped to S. Decode and augmentation are in ``transforms.py``; images leave the host
as uint8 NHWC and are normalised on the device (``ResNetTask.prepare_inputs``).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from scaleout.errors import UserError
from scaleout.families.resnet.data.transforms import MEAN, STD, load_image

__all__ = ["EXTENSIONS", "MEAN", "STD", "ImageFolder"]

EXTENSIONS = (".jpeg", ".jpg", ".png")


class ImageFolder:
    """Reads ``<root>/<split>/<class>/<image>`` with PIL (see module docstring for the layout)."""

    crop_min_area = 0.08  # data.crop_min_area (the task sets it); decode: transforms.py

    def __init__(
        self,
        root: str | os.PathLike[str],
        split: str = "train",
        image_size: int = 224,
        train: bool | None = None,
        seed: int = 0,
    ):
        base = Path(root) / split
        if not base.is_dir():
            raise UserError(
                f"data.path={root}: no '{split}' folder; expected "
                f"{root}/{split}/<class>/<image>.JPEG"
            )
        self.classes = sorted(d.name for d in base.iterdir() if d.is_dir())
        if not self.classes:
            raise UserError(
                f"data.path={root}: {base} has no class folders; expected "
                f"{base}/<class>/<image>.JPEG"
            )
        self.samples = [
            (str(p), c)
            for c, name in enumerate(self.classes)
            for p in sorted((base / name).iterdir())
            if p.suffix.lower() in EXTENSIONS
        ]
        if not self.samples:
            raise UserError(
                f"data.path={root}: no {'/'.join(EXTENSIONS)} images under {base}/<class>/"
            )
        self.image_size, self.seed = image_size, seed
        self.train = (split == "train") if train is None else train

    def __len__(self) -> int:
        return len(self.samples)

    def _load(self, i: int, epoch: int) -> np.ndarray:
        path, _ = self.samples[i]
        return load_image(
            path, self.image_size, self.train, self.seed, epoch, i, self.crop_min_area
        )

    def get(self, indices: np.ndarray, epoch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(uint8 images [B, S, S, 3] RGB, int64 labels [B]); the task normalises on the device."""
        s = self.image_size
        x = (
            np.stack([self._load(int(i), epoch) for i in indices])
            if len(indices)
            else np.zeros((0, s, s, 3), np.uint8)
        )
        y = torch.tensor([self.samples[int(i)][1] for i in indices], dtype=torch.long)
        return torch.from_numpy(x), y
