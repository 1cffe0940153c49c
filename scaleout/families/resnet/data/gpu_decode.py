"""``data.decode=gpu``: JPEGs decoded on the GPU (nvJPEG through ``torchvision.io.decode_jpeg``).

Host half (the prefetcher's workers, :class:`JpegImages`): read each file's bytes and decide its
crop box and flip from the JPEG header's size alone -- the same decisions, from the same
(seed, epoch, index) random stream, as the CPU path (transforms.py) -- nothing is decoded. That is
what is left of the host's work per image: a file read and a header parse (``scaleout bench data``
measures it). The batch travels as a :class:`JpegBatch` (not a tensor: DataLoader's pin thread and
``to_device`` leave it on the host, where nvJPEG reads it).

Device half (:func:`decode_on_device`, called by ``ResNetTask.prepare_inputs`` on the prefetcher's
copy stream): one batched ``decode_jpeg(list, device="cuda")``, then per image a crop (a view), a
bilinear antialiased resize to S x S (``torch.nn.functional.interpolate``) and the flip, stacked as
the uint8 NHWC batch every other source produces; the task then normalises it as usual.

torchvision is optional and is not a dependency: install the torchvision release built for the
installed torch (``pip install torchvision==<the match for torch X.Y>`` from the same index as
torch). Asking for ``data.decode=gpu`` without it, or without CUDA, is refused when the task is
built, in one line.

Non-JPEG or CMYK files (ImageNet's train set has a few: 22 CMYK JPEGs and one PNG) are re-encoded
on the host as RGB JPEG (quality 95) so the batch is always decodable by nvJPEG.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
import torch
import torch.nn.functional as F

from scaleout.errors import ConfigError
from scaleout.families.resnet.data.transforms import Box, eval_crop, train_params


@dataclass
class JpegBatch:
    """Encoded images of one micro-batch and what to do with each, decided on the host. Plain
    Python (lists, floats, uint8 byte tensors) so nothing is read back from the device."""

    data: torch.Tensor  # 1-D uint8: the encoded files end to end (stays on the host)
    offsets: list[int]  # file i is data[offsets[i]:offsets[i + 1]]
    boxes: list[Box]  # crop box per image, in full-size pixels (left, top, right, bottom)
    flips: list[bool]  # horizontal flip per image
    size: int  # output side S

    @classmethod
    def of(cls, files: list[bytes], boxes: list[Box], flips: list[bool], size: int) -> JpegBatch:
        """One tensor for the whole batch: a worker hands it over as one shared-memory block,
        not one per image."""
        offsets = np.cumsum([0, *(len(f) for f in files)]).tolist()
        data = torch.frombuffer(bytearray(b"".join(files)), dtype=torch.uint8) if files else None
        return cls(
            data if data is not None else torch.zeros(0, dtype=torch.uint8),
            offsets,
            boxes,
            flips,
            size,
        )

    @property
    def jpegs(self) -> list[torch.Tensor]:
        """The encoded files as 1-D uint8 views (what decode_jpeg takes)."""
        o = self.offsets
        return [self.data[o[i] : o[i + 1]] for i in range(len(o) - 1)]

    def __len__(self) -> int:
        return len(self.offsets) - 1


def require_torchvision() -> Any:
    """torchvision, or one line saying what ``data.decode=gpu`` needs."""
    try:
        import torchvision  # deferred: optional, CUDA machines only (module docstring)
        import torchvision.io  # noqa: F401  # deferred: as above
    except Exception as exc:  # noqa: BLE001 -- ImportError, or a wheel whose CUDA libs are missing
        raise ConfigError(
            f"data.decode=gpu needs torchvision built for this torch {torch.__version__} "
            "(pip install the torchvision release matching it, from the same index as torch), "
            f"or data.decode=cpu: import torchvision failed: {str(exc).splitlines()[0][:120]}"
        ) from None
    return torchvision


def check_gpu_decode(device: torch.device) -> None:
    """Refuse ``data.decode=gpu`` where it cannot run: not a CUDA rank, or no torchvision (a source
    without image files is the schema's rule, DataConfig)."""
    if torch.device(device).type != "cuda":
        raise ConfigError(
            f"data.decode=gpu needs a CUDA device (nvJPEG via torchvision); this rank runs on "
            f"{torch.device(device)}: use data.decode=cpu"
        )
    require_torchvision()


def read_jpeg(path: str | IO[bytes]) -> tuple[bytes, int, int]:
    """(the file as JPEG bytes, full width, full height) from the header; non-JPEG or non-RGB/L
    files re-encoded as RGB JPEG (module docstring)."""
    from PIL import Image  # deferred: PIL only where images are read (workers)

    if isinstance(path, str | os.PathLike):
        with open(path, "rb") as f:
            data = f.read()
    else:  # a file object (a tar shard's member)
        data = path.read()
    with Image.open(io.BytesIO(data)) as im:
        w, h = im.size  # header only: nothing decoded
        if im.format == "JPEG" and im.mode in ("RGB", "L"):
            return data, w, h
        out = io.BytesIO()
        im.convert("RGB").save(out, format="JPEG", quality=95)
        return out.getvalue(), w, h


class JpegImages:
    """The host half over an :class:`~scaleout.families.resnet.data.folder.ImageFolder` (its
    files, labels, split, seed, size and crop area): ``get`` returns ``(JpegBatch, labels)``."""

    def __init__(self, folder: Any):
        self.folder = folder

    def __len__(self) -> int:
        return len(self.folder)

    def params(self, index: int, epoch: int, w: int, h: int) -> tuple[Box, bool]:
        f = self.folder
        if f.train:
            return train_params(w, h, f.seed, epoch, index, f.crop_min_area)
        return eval_crop(w, h, f.image_size), False

    def get(self, indices: np.ndarray, epoch: int = 0) -> tuple[JpegBatch, torch.Tensor]:
        files, boxes, flips = [], [], []
        for i in indices:
            data, w, h = read_jpeg(self.folder._open(int(i)))
            box, flip = self.params(int(i), epoch, w, h)
            files.append(data)
            boxes.append(tuple(float(v) for v in box))
            flips.append(flip)
        labels = self.folder.labels
        y = torch.tensor([int(labels[int(i)]) for i in indices], dtype=torch.long)
        return JpegBatch.of(files, boxes, flips, self.folder.image_size), y


def crop_resize_flip(images: list[torch.Tensor], batch: JpegBatch) -> torch.Tensor:
    """Decoded uint8 CHW images (any device) -> the uint8 NHWC batch: crop each to its box, resize
    bilinear (antialiased, as PIL downsamples) to S x S, flip. Device-agnostic (tested on CPU)."""
    s = batch.size
    out = []
    for img, (left, top, right, bottom), flip in zip(images, batch.boxes, batch.flips, strict=True):
        h, w = img.shape[-2:]
        x0, y0 = min(int(round(left)), w - 1), min(int(round(top)), h - 1)
        x1, y1 = max(int(round(right)), x0 + 1), max(int(round(bottom)), y0 + 1)
        crop = img[None, :, y0:y1, x0:x1].float()
        r = F.interpolate(crop, size=(s, s), mode="bilinear", align_corners=False, antialias=True)
        out.append(r.flip(-1) if flip else r)
    if not out:
        return torch.zeros(0, s, s, 3, dtype=torch.uint8)
    x = torch.cat(out).round_().clamp_(0, 255).to(torch.uint8)
    return x.permute(0, 2, 3, 1)  # NHWC view of NCHW memory: prepare_inputs' permute undoes it


def decode_on_device(batch: JpegBatch, device: torch.device) -> torch.Tensor:
    """One batched nvJPEG decode of ``batch`` on ``device``, then :func:`crop_resize_flip`.

    On CUDA the current stream is drained first: torchvision's decoder (nvJPEG's hardware engine)
    writes its outputs without waiting for the stream it is given (pytorch/vision#9606,
    meta-pytorch/torchcodec#1634), into blocks the caching allocator hands out on that stream --
    blocks that kernels still queued there may be reading. Call it on a stream that carries decode
    work only (the prefetcher's copy stream, the evaluation's decode stream), so the wait is
    short and the compute stream keeps running."""
    tv = require_torchvision()
    if torch.device(device).type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    images = tv.io.decode_jpeg(batch.jpegs, mode=tv.io.ImageReadMode.RGB, device=device)
    return crop_resize_flip(list(images), batch)
