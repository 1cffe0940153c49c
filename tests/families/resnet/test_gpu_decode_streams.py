"""GPU JPEG decode in evaluation, on an emulated CUDA device (tests/fakecuda.py: no GPU exists
here, and torchvision is not installed, so its ``decode_jpeg`` is a stand-in too).

The stand-in behaves as torchvision's CUDA decoder does (pytorch/vision#9606,
meta-pytorch/torchcodec#1634): it allocates its outputs on the caller's current stream, and
nvJPEG's hardware engine writes them without waiting for the work already queued on that stream.
So a decode on the compute stream, after the previous evaluation batch's forward was queued,
overwrites blocks those kernels may still read (review gpu-day-two finding 5); and the evaluation
cache (``data.cache_eval``) then keeps those pixels for every later evaluation. The fix: decode on
a stream of its own, drained before each decode, ordered with the compute stream both ways; cache
pixels only once the host saw them finished."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import scaleout.families.resnet.data.gpu_decode as gpu_decode
import scaleout.families.resnet.task as task_module
from scaleout.config import load_config
from scaleout.families.resnet.data.gpu_decode import JpegBatch
from scaleout.families.resnet.task import ResNetTask

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fakecuda import FakeCuda  # noqa: E402

# a tiny synthetic ResNet (memory_format fixed: auto would time both formats, not what is tested)
SMALL = (
    "model.arch=resnet data.source=synthetic model.resnet.depth=18 model.resnet.width=4 "
    "model.resnet.num_classes=4 model.resnet.image_size=16 data.eval_samples=8 "
    "train.global_batch=8 train.max_steps=6 model.resnet.memory_format=contiguous"
).split()


def _jpeg(seed: int, size: int = 20) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


class _JpegEvalSet:
    """The eval set as data.decode=gpu's host half hands it over: encoded files + crop boxes."""

    def __len__(self) -> int:
        return 8

    def get(self, idx: np.ndarray, epoch: int = 0) -> tuple[JpegBatch, torch.Tensor]:
        files = [_jpeg(int(i)) for i in idx]
        boxes = [(2.0, 2.0, 18.0, 18.0)] * len(files)
        y = torch.tensor([int(i) % 4 for i in idx])
        return JpegBatch.of(files, boxes, [False] * len(files), 16), y


def _fake_torchvision(fc: FakeCuda, calls: list[str]) -> Any:
    def decode_jpeg(datas: list[torch.Tensor], mode: Any = None, device: Any = None) -> list:
        calls.append(torch.cuda.current_stream().name)
        outs = []
        for d in datas:
            with torch._C.DisableTorchFunction():  # the host decode stands for the engine's
                pixels = np.array(Image.open(io.BytesIO(d.numpy().tobytes())).convert("RGB"))
            out = torch.empty(
                pixels.shape[::-1][:1] + pixels.shape[:2], dtype=torch.uint8, device=device
            )
            fc.engine_write(out, "decode_jpeg")
            with torch._C.DisableTorchFunction():
                out.copy_(torch.from_numpy(pixels).permute(2, 0, 1))
            outs.append(out)
        return outs

    io_ns = SimpleNamespace(decode_jpeg=decode_jpeg, ImageReadMode=SimpleNamespace(RGB="RGB"))
    return SimpleNamespace(io=io_ns)


def _evaluate_twice(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeCuda, ResNetTask, list, list]:
    world = SimpleNamespace(
        rank=0, world_size=1, num_nodes=1, local_size=1, device=torch.device("cpu")
    )
    task = ResNetTask(load_config(None, SMALL), world)
    task.eval_set, task._eval_idx = _JpegEvalSet(), np.arange(8)
    monkeypatch.setattr(task_module, "EVAL_BATCH", 4)  # two batches: the second one races
    monkeypatch.setattr(task_module, "eval_cache_budget", lambda w: 1 << 30)
    calls: list[str] = []
    accs = []
    with FakeCuda(world) as fc:
        monkeypatch.setattr(gpu_decode, "require_torchvision", lambda: _fake_torchvision(fc, calls))
        _ = task.model(torch.zeros(2, 3, 16, 16, device="cuda"))  # a training step still queued
        for _ in range(2):
            accs.append(task.evaluate(task.model))
        finished = [fc.finished(t) for pair in task._eval_cache for t in pair]
    return fc, task, calls, [accs, finished]


@pytest.mark.unit
def test_eval_gpu_decode_does_not_write_blocks_queued_kernels_read(monkeypatch) -> None:
    """Every evaluation decode runs on a stream drained right before it: no engine write into a
    block with unfinished work queued before it, and no other stream hazard; decoded once (the
    second evaluation reads the cache)."""
    fc, task, calls, (accs, _) = _evaluate_twice(monkeypatch)
    assert fc.hazards == [], fc.hazards
    assert len(calls) == 2 and "default" not in calls, calls
    assert accs[0] == accs[1]


@pytest.mark.unit
def test_eval_cache_holds_only_finished_pixels(monkeypatch) -> None:
    """What data.cache_eval keeps for every later evaluation (pixels and labels) was seen finished
    by the host before it was kept."""
    fc, task, _, (_, finished) = _evaluate_twice(monkeypatch)
    assert task._eval_cache is not None and len(task._eval_cache) == 2
    assert finished and all(finished), finished
