"""ImageFolder: ``<root>/<split>/<class>/<image>`` read with PIL.

Real ImageNet layout expected at ``data.path`` (the torchvision ImageFolder layout; ILSVRC2012's
``train/`` tar unpacks into it, and ``scaleout data prepare-imagenet`` files the flat validation
set into class folders)::

    <path>/train/<wnid>/*.JPEG     e.g. train/n01440764/n01440764_10026.JPEG
    <path>/val/<wnid>/*.JPEG

Classes are train's sorted folder names (label = position); val's folders must be among train's
(each val image gets the label of its class in train's list). The file list is built lazily and
cached (scaleout/families/resnet/data/index.py): nothing is listed before the first item access,
rank 0 lists the tree once, every other rank reads the one index file.

Training images get the MLPerf reference augmentation (random-resized crop, scale
``data.crop_min_area``-1, aspect 3/4-4/3, then a random horizontal flip), deterministic per (seed,
epoch, index); evaluation images are resized to S/0.875 on the short side and center-cropped to S.
Decode and augmentation are in ``transforms.py``; images leave the host as uint8 NHWC and are
normalised on the device (``ResNetTask.prepare_inputs``).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from scaleout.errors import UserError
from scaleout.families.resnet.data.index import (
    index_dir,
    index_path,
    load_or_build,
    pack_strings,
    unpack_string,
)
from scaleout.families.resnet.data.transforms import MEAN, STD, load_image

__all__ = ["EXTENSIONS", "MEAN", "STD", "DecodedCache", "ImageFolder"]

EXTENSIONS = (".jpeg", ".jpg", ".png")


class ImageFolder:
    """Reads ``<root>/<split>/<class>/<image>`` with PIL (see module docstring for the layout).

    ``rank``: the global rank (rank 0 builds the index, the others read it); ``index_root``: where
    the index goes when ``root`` is read-only (``train.output_dir``); ``classes_from``: the training
    set whose classes label this one (val); ``expect_classes`` / ``expect_images``: counts the
    index must have (ImageNet: 1,000 and 1,281,167 / 50,000), checked when it is loaded
    (``max_classes``: the model's outputs);
    ``cache_bytes``: keep decoded images in memory up to this many bytes per process (0: off)."""

    crop_min_area = 0.08  # data.crop_min_area (the task sets it); decode: transforms.py

    def __init__(
        self,
        root: str | os.PathLike[str],
        split: str = "train",
        image_size: int = 224,
        train: bool | None = None,
        seed: int = 0,
        *,
        rank: int = 0,
        index_root: str | os.PathLike[str] | None = None,
        classes_from: ImageFolder | None = None,
        expect_classes: int | None = None,
        expect_images: int | None = None,
        cache_bytes: int = 0,
        max_classes: int | None = None,
    ):
        self.root, self.split = Path(root), split
        self.base = self._locate()  # one stat per rank, no listing
        self.image_size, self.seed = image_size, seed
        self.train = (split == "train") if train is None else train
        self.rank, self.index_root, self.classes_from = rank, index_root, classes_from
        self.expect_classes, self.expect_images = expect_classes, expect_images
        self.max_classes = max_classes
        self.cache = DecodedCache(cache_bytes)
        self._index: dict[str, np.ndarray] | None = None

    def _locate(self) -> Path:
        """The split's folder (a tar-shard set overrides this with its first shard)."""
        base = self.root / self.split
        if not base.is_dir():
            raise UserError(
                f"data.path={self.root}: no '{self.split}' folder; expected "
                f"{self.root}/{self.split}/<class>/<image>.JPEG"
            )
        return base

    # -- the lazy index ----------------------------------------------------------------------------
    def _ensure(self) -> dict[str, np.ndarray]:
        if self._index is None:
            path = index_path(index_dir(self.root, self.index_root), self.split, self.base)
            arrays = load_or_build(path, self._list, self.rank)
            self._index = self._check(arrays)
        return self._index

    def _list(self) -> dict[str, np.ndarray]:
        """Rank 0 only: one listing of the split (sorted class folders, sorted image names)."""
        base = self.base
        folders = sorted(e.name for e in os.scandir(base) if e.is_dir())
        if not folders:
            raise UserError(
                f"data.path={self.root}: {base} has no class folders; expected "
                f"{base}/<class>/<image>.JPEG"
            )
        names: list[str] = []
        folder_of: list[int] = []
        for c, name in enumerate(folders):
            files = sorted(
                e.name for e in os.scandir(base / name) if e.name.lower().endswith(EXTENSIONS)
            )
            names += files
            folder_of += [c] * len(files)
        if not names:
            raise UserError(
                f"data.path={self.root}: no {'/'.join(EXTENSIONS)} images under {base}/<class>/"
            )
        blob, offsets = pack_strings(names)
        fblob, foffsets = pack_strings(folders)
        return {
            "names": blob,
            "offsets": offsets,
            "folder": np.asarray(folder_of, np.int32),
            "folders": fblob,
            "folder_offsets": foffsets,
        }

    def _check(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Counts and labels (train's class positions) of a loaded index; a one-line error when
        they are not what this data set must have."""
        folders = [
            unpack_string(arrays["folders"], arrays["folder_offsets"], i)
            for i in range(len(arrays["folder_offsets"]) - 1)
        ]
        self._dirs = folders  # this split's own folder names (path() reads them)
        n = len(arrays["folder"])
        where = f"data.path={self.root}: {self.split}/"
        if self.expect_classes is not None and len(folders) != self.expect_classes:
            raise UserError(
                f"{where} has {len(folders)} class folders; expected {self.expect_classes}"
            )
        if self.max_classes is not None and len(folders) > self.max_classes:
            raise UserError(
                f"{where} has {len(folders)} classes; model.resnet.num_classes={self.max_classes} "
                f"is too few (expected num_classes >= {len(folders)})"
            )
        if self.expect_images is not None and n != self.expect_images:
            raise UserError(f"{where} has {n} images; expected {self.expect_images}")
        if self.classes_from is None:
            arrays["labels"] = arrays["folder"]  # the same array: no copy per worker
            self._classes = folders
            return arrays
        train = self.classes_from.classes
        position = {c: i for i, c in enumerate(train)}
        unknown = [c for c in folders if c not in position]
        if unknown:
            raise UserError(
                f"{where} has class {unknown[0]!r} ({len(unknown)} in all) that "
                f"{self.classes_from.split}/ does not have; expected val classes among "
                f"{self.classes_from.split}'s {len(train)}"
            )
        remap = np.array([position[c] for c in folders], np.int32)
        arrays["labels"] = remap[arrays["folder"]]
        self._classes = train
        return arrays

    def __getstate__(self) -> dict:
        self._ensure()  # pickled into prefetch workers (after run_start) with the index loaded
        return self.__dict__

    @property
    def classes(self) -> list[str]:
        """The label names (train's sorted class folders; val: train's)."""
        self._ensure()
        return self._classes

    @property
    def labels(self) -> np.ndarray:
        return self._ensure()["labels"]

    def __len__(self) -> int:
        return len(self._ensure()["folder"])

    def path(self, i: int) -> str:
        a = self._ensure()
        folder = unpack_string(a["folders"], a["folder_offsets"], int(a["folder"][i]))
        return str(self.base / folder / unpack_string(a["names"], a["offsets"], i))

    def paths(self, indices: np.ndarray) -> list[str]:
        """``path(i)`` of every i in ``indices`` (a DALI reader's file list: one string each,
        without a Path object per file)."""
        a = self._ensure()
        blob, offsets, folder = a["names"].tobytes(), a["offsets"], a["folder"]
        base, dirs = str(self.base), self._dirs
        return [
            f"{base}/{dirs[folder[i]]}/{blob[offsets[i] : offsets[i + 1]].decode()}"
            for i in indices.tolist()
        ]

    def _open(self, i: int):
        """What PIL opens for image i: a path (a tar shard reader returns the member's bytes)."""
        return self.path(i)

    def _rgb_array(self, i: int) -> np.ndarray:
        """Image i decoded at full size to uint8 RGB [H, W, 3], kept in the decoded cache (while
        its budget lasts) so a later epoch crops it without decoding."""
        from PIL import Image  # deferred: PIL only where images are decoded (workers)

        hit = self.cache.get(i)
        if hit is not None:
            return hit
        with Image.open(self._open(i)) as im:
            rgb = np.asarray(im.convert("RGB"), dtype=np.uint8)
        self.cache.put(i, rgb)
        return rgb

    def _load(self, i: int, epoch: int) -> np.ndarray:
        """Image i decoded, cropped and flipped: uint8 [S, S, 3]. With the decoded cache on, from
        the full-size RGB kept in memory; otherwise a reduced-scale decode where the crop allows."""
        source = self._rgb_array(i) if self.cache.budget else self._open(i)
        return load_image(
            source, self.image_size, self.train, self.seed, epoch, i, self.crop_min_area
        )

    def get(self, indices: np.ndarray, epoch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(uint8 images [B, S, S, 3] RGB, int64 labels [B]); the task normalises on the device."""
        s = self.image_size
        x = (
            np.stack([self._load(int(i), epoch) for i in indices])
            if len(indices)
            else np.zeros((0, s, s, 3), np.uint8)
        )
        labels = self.labels
        y = torch.tensor([int(labels[int(i)]) for i in indices], dtype=torch.long)
        return torch.from_numpy(x), y


class DecodedCache:
    """Decoded uint8 RGB images of this process, kept until ``budget`` bytes are used (then new
    images are not kept: a fixed set, no eviction churn). Per process: each prefetch worker fills
    its own from the images it decodes."""

    def __init__(self, budget: int = 0):
        self.budget, self.used = int(budget), 0
        self.images: dict[int, np.ndarray] = {}

    def get(self, i: int) -> np.ndarray | None:
        return self.images.get(i) if self.budget else None

    def put(self, i: int, im) -> None:
        if not self.budget or i in self.images:
            return
        a = np.asarray(im, dtype=np.uint8)
        if self.used + a.nbytes <= self.budget:
            self.images[i] = a
            self.used += a.nbytes

    def __getstate__(self) -> dict:
        return {"budget": self.budget, "used": 0, "images": {}}  # each process fills its own
