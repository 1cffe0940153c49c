"""The ResNet input pipeline (issue 27): uint8 NHWC on the host (transforms.py, reduced-scale
decode, crop_min_area), normalisation on the device in Task.prepare_inputs, called by the
prefetcher on its copy stream; the host half of data.decode=gpu; the input settings refused on a
GPU. The emulated CUDA device (tests/fakecuda.py) stands in for a GPU, which cannot exist here."""

from __future__ import annotations

import io
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

import scaleout.families.resnet.task as task_module
from scaleout.config import load_config
from scaleout.errors import ConfigError
from scaleout.families.resnet.data import ImageFolder, SyntheticImages
from scaleout.families.resnet.data import transforms as T
from scaleout.families.resnet.data.gpu_decode import (
    JpegBatch,
    JpegImages,
    crop_resize_flip,
    read_jpeg,
    require_torchvision,
)
from scaleout.families.resnet.task import ResNetTask, check_input_pipeline, normalise_images
from scaleout.train.prefetch import Prefetcher

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fakecuda import FakeCuda  # noqa: E402

SMALL = [
    "model.arch=resnet",
    "data.source=synthetic",
    "model.resnet.depth=18",
    "model.resnet.width=4",
    "model.resnet.num_classes=4",
    "model.resnet.image_size=16",
    "data.eval_samples=8",
    "train.global_batch=8",
    "train.max_steps=6",
]


def _world(device: torch.device | str = "cpu") -> SimpleNamespace:
    return SimpleNamespace(rank=0, world_size=1, num_nodes=1, device=torch.device(device))


def _old_train_load(path: str, s: int, seed: int, epoch: int, i: int) -> np.ndarray:
    """The host path before issue 27 (folder.py @ 7ee03a5): full PIL decode, crop, flip, then
    normalised float32 CHW on the host."""
    rng = np.random.default_rng([seed, epoch, i])
    with Image.open(path) as im:
        im = im.convert("RGB")
        w, h = im.size
        area = w * h
        box = None
        for _ in range(10):
            target = area * rng.uniform(0.08, 1.0)
            ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
            cw, ch = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
            if 0 < cw <= w and 0 < ch <= h:
                left, top = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
                box = (left, top, left + cw, top + ch)
                break
        if box is None:
            side = min(w, h)
            box = ((w - side) // 2, (h - side) // 2, (w + side) // 2, (h + side) // 2)
        im = im.resize((s, s), Image.BILINEAR, box=box)
        if rng.random() < 0.5:
            im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        a = np.asarray(im, dtype=np.float32) / 255.0
    return ((a - T.MEAN) / T.STD).transpose(2, 0, 1)


def _jpeg(path: Path, w: int, h: int, seed: int = 0, mode: str = "RGB", fmt: str = "JPEG") -> None:
    rng = np.random.default_rng(seed)
    low = rng.uniform(0, 255, (h // 48 + 1, w // 48 + 1, 3)).astype(np.uint8)
    img = Image.fromarray(low).resize((w, h), Image.BICUBIC).convert(mode)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, format=fmt, quality=90)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("imgs")
    for split in ("train", "val"):
        for i in range(4):
            _jpeg(root / split / f"c{i % 2}" / f"{i}.jpg", 500, 375, seed=i)
    return root


@pytest.mark.unit
def test_device_normalisation_equals_the_old_host_float_path(folder: Path) -> None:
    """Full decode (draft off) + uint8 + device normalisation = the old float32 host path within
    1e-6, and the crop/flip decisions are the old ones draw for draw."""
    train = ImageFolder(folder, "train", image_size=32, seed=5)
    for i in range(len(train)):
        path = train.path(i)
        u8 = T.load_image(path, 32, True, seed=5, epoch=2, index=i, draft=False)
        assert u8.dtype == np.uint8 and u8.shape == (32, 32, 3)
        got = normalise_images(torch.from_numpy(u8[None].copy()))
        old = torch.from_numpy(_old_train_load(path, 32, 5, 2, i))[None]
        assert got.shape == old.shape and got.dtype == torch.float32
        assert (got - old).abs().max().item() <= 1e-6
        assert torch.equal(
            torch.from_numpy(T.normalise_reference(u8[None])), got
        )  # the same float32 ops


@pytest.mark.unit
def test_reduced_scale_decode_keeps_the_crop_and_resolution(folder: Path) -> None:
    """Image.draft decodes a 500x375 JPEG at reduced scale when the crop allows it, never below
    the output resolution; the result is close to the full decode (same crop, same flip)."""
    path = str(folder / "val" / "c0" / "0.jpg")
    w, h, s = 500, 375, 32
    box = T.eval_crop(w, h, s)
    req = T._draft_request(w, h, box, s)
    with Image.open(path) as im:
        im.draft("RGB", req)
        dw, dh = im.size
    assert (dw, dh) == (63, 47)  # 1/8 scale: the crop box is still >= 32 px each way
    assert (box[2] - box[0]) * dw / w >= s and (box[3] - box[1]) * dh / h >= s
    for train in (True, False):
        fast = T.load_image(path, s, train, seed=1, epoch=0, index=3, draft=True)
        full = T.load_image(path, s, train, seed=1, epoch=0, index=3, draft=False)
        assert fast.shape == full.shape == (s, s, 3) and fast.dtype == np.uint8
        assert np.abs(fast.astype(float) - full.astype(float)).mean() < 6.0
    big = T.load_image(path, 300, False, draft=True)  # 300 px needs the full-size decode
    assert np.array_equal(big, T.load_image(path, 300, False, draft=False))


@pytest.mark.unit
def test_crop_min_area_bounds_the_crop_and_is_validated() -> None:
    for min_area in (0.08, 0.5, 1.0):
        areas = []
        for seed in range(200):
            box = T.train_crop(500, 375, np.random.default_rng(seed), min_area)
            areas.append((box[2] - box[0]) * (box[3] - box[1]) / (500 * 375))
        # a square centre crop is the fallback after 10 misses: 375^2 / (500 * 375) = 0.75
        assert min(areas) >= min(min_area, 0.75) - 0.02, (min_area, min(areas))
    assert load_config(None, [*SMALL, "data.crop_min_area=0.05"]).data.crop_min_area == 0.05
    for bad in ("0", "1.5"):
        with pytest.raises(ConfigError, match=f"data.crop_min_area={bad}"):
            load_config(None, [*SMALL, f"data.crop_min_area={bad}"])


@pytest.mark.unit
def test_task_batches_are_uint8_and_prepared_by_micro_batches_and_eval() -> None:
    """The host batch is uint8 NHWC (synthetic too: one input format); Task.micro_batches and
    evaluate pass it through prepare_inputs (float NCHW, normalised)."""
    task = ResNetTask(load_config(None, SMALL), _world())
    raw = task.batches.micro_batches(0, 1)[0].inputs
    assert raw.dtype == torch.uint8 and raw.shape == (8, 16, 16, 3)
    [mb] = task.micro_batches(0, 1)
    assert mb.inputs.dtype == torch.float32 and mb.inputs.shape == (8, 3, 16, 16)
    assert torch.equal(mb.inputs, normalise_images(raw))
    assert abs(mb.inputs.mean().item()) < 0.5 and 0.5 < mb.inputs.std().item() < 2.0
    assert 0.0 <= task.evaluate(task.model) <= 1.0


@pytest.mark.unit
def test_prefetcher_copies_uint8_and_prepares_on_its_copy_stream(monkeypatch) -> None:
    """On the emulated GPU: the tensors the prefetcher copies host -> device are uint8 images
    (S*S*3 bytes each, 4x fewer than float32); prepare_inputs runs on the copy stream, the compute
    stream waits for it before using the batch (no stream hazard), and the prepared tensor is
    recorded for the compute stream (record_stream)."""
    task = ResNetTask(load_config(None, SMALL), _world())
    with FakeCuda():  # the image source made under the emulation: its tensors are host tensors
        task.batches.images = SyntheticImages(4, 16, task.rows, uint8=True)
    streams: list[str] = []
    prepare = task.prepare_inputs

    def spy(x):
        streams.append(torch.cuda.current_stream().name)
        return prepare(x)

    task.prepare_inputs = spy
    copied: list[torch.Tensor] = []
    import scaleout.train.prefetch as prefetch

    to_device = prefetch.to_device

    def record(x, device):
        copied.extend(t for mb in x for t in mb[:2])
        return to_device(x, device)

    monkeypatch.setattr(prefetch, "to_device", record)
    with FakeCuda() as fc:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        pf = Prefetcher(task, 8, 2, 0, 2, num_workers=0, pin_memory=False, device=fc.device)
        mbs = pf.get(0)
        x = mbs[0].inputs
        assert x.device == fc.device and x.dtype == torch.float32
        (x * 2).sum()  # the compute stream uses the batch
        hazards = list(fc.hazards)
    images = [t for t in copied if t.dim() == 4]
    assert [t.dtype for t in images] == [torch.uint8, torch.uint8]
    assert sum(t.nbytes for t in images) / 8 == 16 * 16 * 3  # bytes per image crossing H2D
    assert pf.h2d_bytes == sum(t.nbytes for t in copied)
    assert streams == ["side1", "side1"], streams  # both micro-batches, on the copy stream
    assert hazards == [], hazards
    assert ((4, 3, 16, 16), torch.float32, "default") in fc.recorded, fc.recorded


@pytest.mark.unit
def test_prepare_on_the_compute_stream_would_race() -> None:
    """The harness catches the bug the prefetcher avoids: a batch written on the copy stream and
    read on the compute stream without wait_stream is a hazard."""
    with FakeCuda() as fc:
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            x = normalise_images(torch.zeros(2, 4, 4, 3, dtype=torch.uint8).to(fc.device))
        (x + 1).sum()
    assert any("without waiting" in h for h in fc.hazards), fc.hazards


@pytest.mark.unit
def test_gpu_decode_host_half_matches_the_cpu_path(tmp_path: Path, folder: Path) -> None:
    """data.decode=gpu's workers read bytes and decide crop + flip from the header alone: the same
    decisions as the CPU path, deterministic per (seed, epoch, index); CMYK and PNG files are
    re-encoded as RGB JPEG. The device half's crop/resize/flip, run here on CPU on a PIL decode,
    is close to the CPU path's output."""
    train = ImageFolder(folder, "train", image_size=32, seed=7)
    train.crop_min_area = 0.3
    src = JpegImages(train)
    batch, y = src.get(np.arange(4), epoch=3)
    assert isinstance(batch, JpegBatch) and len(batch) == 4 and y.dtype == torch.int64
    assert all(t.dtype == torch.uint8 and t.dim() == 1 for t in batch.jpegs)
    again, _ = src.get(np.arange(4), epoch=3)
    assert again.boxes == batch.boxes and again.flips == batch.flips
    other, _ = src.get(np.arange(4), epoch=4)
    assert other.boxes != batch.boxes
    for i in range(4):
        box, flip = T.train_params(500, 375, 7, 3, i, 0.3)
        assert batch.boxes[i] == tuple(map(float, box)) and batch.flips[i] == flip
    decoded = [
        torch.from_numpy(np.array(Image.open(io.BytesIO(t.numpy().tobytes())).convert("RGB")))
        .permute(2, 0, 1)
        .contiguous()
        for t in batch.jpegs
    ]
    out = crop_resize_flip(decoded, batch)
    assert out.shape == (4, 32, 32, 3) and out.dtype == torch.uint8
    cpu = np.stack([T.load_image(train.path(i), 32, True, 7, 3, i, 0.3, False) for i in range(4)])
    assert np.abs(out.numpy().astype(float) - cpu.astype(float)).mean() < 6.0
    for mode, fmt in (("CMYK", "JPEG"), ("RGB", "PNG")):
        p = tmp_path / f"x.{fmt.lower()}"
        _jpeg(p, 60, 40, mode=mode, fmt=fmt)
        data, w, h = read_jpeg(str(p))
        with Image.open(io.BytesIO(data)) as im:
            assert (im.format, im.mode, w, h) == ("JPEG", "RGB", 60, 40)


@pytest.mark.unit
def test_input_settings_refused_where_they_cannot_feed_the_device() -> None:
    """One line each: data.decode=gpu without CUDA, on synthetic data, or without torchvision;
    data.num_workers=0 for ImageNet on a GPU unless decode=gpu."""
    cfg = load_config(None, [*SMALL, "data.source=imagenet", "data.path=/x", "data.num_workers=0"])
    with pytest.raises(ConfigError, match="data.num_workers=0 with data.source=imagenet") as e:
        check_input_pipeline(cfg, torch.device("cuda", 0))
    assert "\n" not in str(e.value)
    check_input_pipeline(cfg, torch.device("cpu"))  # CPU: the synchronous path is fine
    other = load_config(None, [*SMALL, "data.source=images", "data.path=/x", "data.num_workers=0"])
    with pytest.raises(ConfigError, match="data.num_workers=0 with data.source=images"):
        check_input_pipeline(other, torch.device("cuda", 0))
    gpu = cfg.model_copy(update={"data": cfg.data.model_copy(update={"decode": "gpu"})})
    with pytest.raises(ConfigError, match="data.decode=gpu needs a CUDA device"):
        check_input_pipeline(gpu, torch.device("cpu"))
    with pytest.raises(ConfigError, match="data.source='synthetic' has none"):  # the schema's
        load_config(None, [*SMALL, "data.source=synthetic", "data.decode=gpu"])
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 -- this machine: torchvision cannot be imported
        with pytest.raises(ConfigError, match="data.decode=gpu needs torchvision built for") as e:
            require_torchvision()
        assert "\n" not in str(e.value) and torch.__version__ in str(e.value)
        with pytest.raises(ConfigError, match="needs torchvision"):  # num_workers=0 is allowed
            check_input_pipeline(gpu, torch.device("cuda", 0))


@pytest.mark.unit
def test_eval_images_are_read_once_and_kept_while_they_fit(monkeypatch) -> None:
    """data.cache_eval: the first evaluation reads and decodes this rank's share, later ones read
    nothing and score the same; with the cache off, or a share over the budget, every evaluation
    reads again."""

    def reads_per_eval(over: list[str]) -> tuple[ResNetTask, list[int], list[float]]:
        task = ResNetTask(load_config(None, [*SMALL, *over]), _world())
        real, calls = task.eval_set.get, []
        monkeypatch.setattr(
            task.eval_set, "get", lambda idx, *a, **k: calls.append(1) or real(idx, *a, **k)
        )
        per_eval, accs = [], []
        for _ in range(3):
            n = len(calls)
            accs.append(task.evaluate(task.model))
            per_eval.append(len(calls) - n)
        return task, per_eval, accs

    task, per_eval, accs = reads_per_eval([])
    assert per_eval[0] >= 1 and per_eval[1:] == [0, 0], per_eval
    assert accs[0] == accs[1] == accs[2]
    assert task._eval_cache and all(x.dtype == torch.uint8 for x, _ in task._eval_cache)

    _, per_eval, accs = reads_per_eval(["data.cache_eval=false"])
    assert per_eval[0] >= 1 and per_eval == [per_eval[0]] * 3 and len(set(accs)) == 1
    monkeypatch.setattr(task_module, "EVAL_CACHE_SHARE", 1e-15)  # no share fits
    _, per_eval, _ = reads_per_eval([])
    assert per_eval[0] >= 1 and per_eval == [per_eval[0]] * 3
