"""ImageFolder: ``<root>/<split>/<class>/<image>`` read with PIL.

Real ImageNet layout expected at ``data.path`` (the torchvision ImageFolder layout; ILSVRC2012's
``train/`` tar unpacks into it, and the validation set needs its 50k images moved into class
folders)::

    <path>/train/<wnid>/*.JPEG     e.g. train/n01440764/n01440764_10026.JPEG
    <path>/val/<wnid>/*.JPEG

Classes are the sorted folder names (label = position). Training images get the MLPerf reference
augmentation (random-resized crop, scale 0.08-1, aspect 3/4-4/3, then a random horizontal flip),
deterministic per (seed, epoch, index); evaluation images are resized to S/0.875 on the short side
and center-cropped to S. Both are normalised with the ImageNet channel mean/std.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch

from scaleout.errors import UserError

MEAN = np.array(
    [0.485, 0.456, 0.406], dtype=np.float32
)  # ImageNet RGB mean (torchvision/MLPerf reference)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
EXTENSIONS = (".jpeg", ".jpg", ".png")


class ImageFolder:
    """Reads ``<root>/<split>/<class>/<image>`` with PIL (see module docstring for the layout)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        split: str = "train",
        image_size: int = 224,
        train: bool | None = None,
        seed: int = 0,
        min_area: float = 0.08,
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
        self.image_size, self.seed, self.min_area = image_size, seed, min_area
        self.train = (split == "train") if train is None else train

    def __len__(self) -> int:
        return len(self.samples)

    def _load(self, i: int, epoch: int) -> np.ndarray:
        from PIL import Image

        path, _ = self.samples[i]
        with Image.open(path) as im:
            im = im.convert("RGB")
            s = self.image_size
            if self.train:
                rng = np.random.default_rng([self.seed, epoch, i])
                im = _random_resized_crop(im, s, rng, self.min_area)
                if rng.random() < 0.5:
                    im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            else:
                short = round(s / 0.875)  # resize 256 / crop 224 (standard ImageNet evaluation)
                w, h = im.size
                scale = short / min(w, h)
                im = im.resize((max(s, round(w * scale)), max(s, round(h * scale))), Image.BILINEAR)
                w, h = im.size
                left, top = (w - s) // 2, (h - s) // 2
                im = im.crop((left, top, left + s, top + s))
            a = np.asarray(im, dtype=np.float32) / 255.0
        return ((a - MEAN) / STD).transpose(2, 0, 1)

    def get(self, indices: np.ndarray, epoch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        x = np.stack([self._load(int(i), epoch) for i in indices])
        y = torch.tensor([self.samples[int(i)][1] for i in indices], dtype=torch.long)
        return torch.from_numpy(x), y


def _random_resized_crop(im, size: int, rng: np.random.Generator, min_area: float = 0.08):
    """Inception-style crop: area min_area (data.crop_min_area, 8 %)-100 %, aspect 3/4-4/3, 10
    tries, then a center crop (MLPerf reference)."""
    from PIL import Image

    w, h = im.size
    area = w * h
    for _ in range(10):
        target = area * rng.uniform(min_area, 1.0)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw, ch = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < cw <= w and 0 < ch <= h:
            left, top = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
            return im.resize((size, size), Image.BILINEAR, box=(left, top, left + cw, top + ch))
    side = min(w, h)
    left, top = (w - side) // 2, (h - side) // 2
    return im.resize((size, size), Image.BILINEAR, box=(left, top, left + side, top + side))
