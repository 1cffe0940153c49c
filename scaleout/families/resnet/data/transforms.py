"""Host-side image decode and augmentation for the ResNet family: JPEG/PNG -> **uint8 HWC**.

The host does the least it can: decode (PIL, at reduced scale where the crop allows it), crop,
resize, flip, and hands ``uint8 [B, H, W, 3]`` to the device, where
:meth:`ResNetTask.prepare_inputs <scaleout.families.resnet.task.ResNetTask.prepare_inputs>`
converts to float, normalises with :data:`MEAN` / :data:`STD` and permutes to NCHW (channels_last
strides). That is 4x fewer bytes through worker shared memory, the pin copy and H2D than float32,
and no float arithmetic per pixel on the host (NVIDIA DLE's ``fast_collate``).

Training (MLPerf reference augmentation): random-resized crop with area ``min_area``-1 of the
image (``data.crop_min_area``, 0.08; NVIDIA uses 0.05), aspect 3/4-4/3, 10 tries then a centre
crop, resized to S x S, then a horizontal flip with probability 1/2; deterministic per
(seed, epoch, index). Evaluation: resize the short side to S/0.875, centre crop S.

The crop *decision* (:func:`train_crop`, :func:`eval_crop`) needs only the image's full size (the
JPEG header), so the GPU-decode path (``gpu_decode.py``) makes the same decisions on the host
without decoding. Reduced-scale decode: a JPEG decoded with ``Image.draft`` at 1/2, 1/4 or 1/8 of
its size skips most of the IDCT work; the scale is chosen so the crop box still has at least S
pixels each way, so the output is resampled *down* as before (never up from a coarser decode).
"""

from __future__ import annotations

import contextlib
import io
import math
import os
from typing import IO, Any

import numpy as np

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)  # ImageNet RGB mean (torchvision/MLPerf)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
EVAL_CROP_FRACTION = 0.875  # resize 256 / crop 224 (standard ImageNet evaluation)

Box = tuple[float, float, float, float]  # (left, top, right, bottom) in full-size pixels


def train_crop(w: int, h: int, rng: np.random.Generator, min_area: float = 0.08) -> Box:
    """Inception-style crop box of a ``w x h`` image: area ``min_area``-100 %, aspect 3/4-4/3,
    10 tries, then a centre square (MLPerf reference). Draws from ``rng`` exactly as the float
    path did, so the same (seed, epoch, index) gives the same box."""
    area = w * h
    for _ in range(10):
        target = area * rng.uniform(min_area, 1.0)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw, ch = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < cw <= w and 0 < ch <= h:
            left, top = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
            return (left, top, left + cw, top + ch)
    side = min(w, h)
    left, top = (w - side) // 2, (h - side) // 2
    return (left, top, left + side, top + side)


def train_params(
    w: int, h: int, seed: int, epoch: int, index: int, min_area: float = 0.08
) -> tuple[Box, bool]:
    """(crop box, horizontal flip) of training image ``index`` in ``epoch``: a pure function of
    (seed, epoch, index) and the image's size."""
    rng = np.random.default_rng([seed, epoch, index])
    box = train_crop(w, h, rng, min_area)
    return box, bool(rng.random() < 0.5)


def eval_crop(w: int, h: int, size: int) -> Box:
    """The source region that "resize the short side to size/0.875, centre-crop size" shows."""
    scale = round(size / EVAL_CROP_FRACTION) / min(w, h)
    cw, ch = min(size / scale, w), min(size / scale, h)
    left, top = (w - cw) / 2, (h - ch) / 2
    return (left, top, left + cw, top + ch)


def _draft_request(w: int, h: int, box: Box, size: int) -> tuple[int, int]:
    """The decode size to ask ``Image.draft`` for: the largest reduction that keeps the crop box
    at >= ``size`` pixels in both directions (draft never goes below the requested size)."""
    bw, bh = box[2] - box[0], box[3] - box[1]
    return (math.ceil(w * size / max(bw, 1e-9)), math.ceil(h * size / max(bh, 1e-9)))


def load_image(
    source: str | os.PathLike[str] | bytes | np.ndarray | IO[bytes],
    size: int,
    train: bool,
    seed: int = 0,
    epoch: int = 0,
    index: int = 0,
    min_area: float = 0.08,
    draft: bool = True,
) -> np.ndarray:
    """One image (a path, a file object, the encoded bytes, or an already decoded uint8 RGB
    array) decoded and augmented: ``uint8 [size, size, 3]``
    RGB. ``draft``: decode a JPEG at reduced scale where the crop allows (module docstring)."""
    from PIL import Image  # deferred: PIL only where images are decoded (workers), not on import

    if isinstance(source, np.ndarray):  # already decoded (the decoded cache): uint8 [H, W, 3]
        im_ctx: Any = contextlib.nullcontext(Image.fromarray(source))
    else:
        f: Any = io.BytesIO(source) if isinstance(source, bytes | bytearray) else source
        im_ctx = Image.open(f)
    with im_ctx as im:
        w, h = im.size  # from the header: nothing decoded yet
        if train:
            box, flip = train_params(w, h, seed, epoch, index, min_area)
        else:
            box, flip = eval_crop(w, h, size), False
        if draft and im.format == "JPEG":
            im.draft("RGB", _draft_request(w, h, box, size))
        dw, dh = im.size
        sx, sy = dw / w, dh / h
        rgb = im.convert("RGB")
        scaled = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
        out = rgb.resize((size, size), Image.BILINEAR, box=scaled)
        if flip:
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return np.asarray(out, dtype=np.uint8)


def normalise_reference(images: np.ndarray) -> np.ndarray:
    """The float path the host used to run (uint8 NHWC -> normalised float32 NCHW), kept as the
    reference the device-side normalisation is tested against and for ``scaleout bench data``'s
    old row."""
    a = images.astype(np.float32) / 255.0
    return ((a - MEAN) / STD).transpose(0, 3, 1, 2)
