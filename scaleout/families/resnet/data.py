"""Image data for ResNet: deterministic synthetic ImageNet-shaped images and an ImageFolder reader.

Synthetic: every class c has a fixed random low-frequency template; sample i (label drawn from
(seed, i)) is template[label] + Gaussian noise, so a small ResNet can actually learn it (a CPU run
can reach an accuracy target) while shapes and dtypes match ImageNet (3 x S x S float, 1000
classes). ``fixed_batch`` returns one pre-generated batch for throughput runs (MLPerf-style
synthetic data: the input pipeline is taken out of the measurement).

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
from typing import Any

import numpy as np
import torch

from scaleout.data.batches import MicroBatch
from scaleout.errors import UserError

MEAN = np.array(
    [0.485, 0.456, 0.406], dtype=np.float32
)  # ImageNet RGB mean (torchvision/MLPerf reference)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
EXTENSIONS = (".jpeg", ".jpg", ".png")


class SyntheticImages:
    def __init__(
        self,
        num_classes: int = 1000,
        image_size: int = 224,
        length: int = 1_281_167,
        seed: int = 0,
        noise: float = 1.0,
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
        """(images [B, 3, S, S] float32, labels [B]) for the given sample indices."""
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
        return self.templates[y] + self.noise * noise, y

    def fixed_batch(
        self, batch: int, device: str | torch.device = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.get(np.arange(batch))
        return x.to(device), y.to(device)


class ImageFolder:
    """Reads ``<root>/<split>/<class>/<image>`` with PIL (see module docstring for the layout)."""

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
        from PIL import Image

        path, _ = self.samples[i]
        with Image.open(path) as im:
            im = im.convert("RGB")
            s = self.image_size
            if self.train:
                rng = np.random.default_rng([self.seed, epoch, i])
                im = _random_resized_crop(im, s, rng)
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


def _random_resized_crop(im, size: int, rng: np.random.Generator):
    """Inception-style crop: area 8-100 %, aspect 3/4-4/3, 10 tries, then a center crop (MLPerf
    reference)."""
    from PIL import Image

    w, h = im.size
    area = w * h
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw, ch = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < cw <= w and 0 < ch <= h:
            left, top = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
            return im.resize((size, size), Image.BILINEAR, box=(left, top, left + cw, top + ch))
    side = min(w, h)
    left, top = (w - side) // 2, (h - side) // 2
    return im.resize((size, size), Image.BILINEAR, box=(left, top, left + side, top + side))


class ImageBatches:
    """This rank's image micro-batches on the CPU (decode + augmentation happen here). Data only."""

    def __init__(self, images: Any, sampler: Any, rows: int):
        self.images, self.sampler, self.rows = images, sampler, rows
        self.flops_per_image = 0.0  # set by the task once the model exists

    def micro_batches(self, position: int, grad_accum: int) -> list[MicroBatch]:
        idx = self.sampler.local_indices(position)
        epoch = position // max(self.rows, 1)
        out = []
        for part in np.array_split(idx, grad_accum):
            x, y = self.images.get(part, epoch)
            out.append(MicroBatch(x, y, len(part), 0, self.flops_per_image * len(part)))
        return out
