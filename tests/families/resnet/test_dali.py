"""data.decode=dali (issue 27): the DALI training input on DALI's CPU back-end (device_id=None),
which is what runs without a GPU; the CUDA path ("mixed" nvJPEG decode) differs only in the
decoder's device and is not emulated here. nvidia-dali is in the test extra (scripts/setup.sh
--test installs it), so it is imported directly: a missing package is a failure, not a skip."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import nvidia.dali  # noqa: F401  # the extra these tests exercise (module docstring)
import pytest
import torch
from distutil import run_dist
from PIL import Image

from scaleout.config import load_config
from scaleout.errors import ConfigError
from scaleout.families.resnet.data import dali as dali_input
from scaleout.families.resnet.task import ResNetTask

W, H, N, S = 64, 48, 64, 16  # source images W x H, how many, output side
EXTRA: list[str] = []


def _tree(root: Path) -> Path:
    """N PNGs in 4 class folders: red = 4 * column, green = 5 * row (where a crop came from),
    blue = 4 * the image's index in the sorted listing (which image a batch row is)."""
    if (root / "train").is_dir():
        return root
    xs, ys = np.meshgrid(np.arange(W), np.arange(H))
    for split, n in (("train", N), ("val", 8)):
        for i in range(n):
            c = i // (n // 4)  # sorted listing order = i (class folders c0..c3, names by i)
            d = root / split / f"c{c}"
            d.mkdir(parents=True, exist_ok=True)
            a = np.stack([xs * 4, ys * 5, np.full_like(xs, i * 4)], -1).astype(np.uint8)
            Image.fromarray(a).save(d / f"{i:03d}.png")
    return root


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return _tree(tmp_path_factory.mktemp("dali-tree"))


def _cfg(root: Path, out: Path, *extra: str) -> Any:
    return load_config(
        None,
        [
            "model.arch=resnet",
            "data.source=images",
            f"data.path={root}",
            "data.decode=dali",
            "model.resnet.depth=18",
            "model.resnet.width=4",
            "model.resnet.num_classes=4",
            f"model.resnet.image_size={S}",
            "data.eval_samples=8",
            "train.global_batch=16",
            "train.max_steps=8",
            f"train.output_dir={out}",
            *extra,
        ],
    )


def _world(rank: int, size: int) -> SimpleNamespace:
    return SimpleNamespace(
        rank=rank,
        world_size=size,
        num_nodes=1,
        device=torch.device("cpu"),
        ranks_per_node=[list(range(size))],
    )


@pytest.mark.unit
def test_dali_batches_per_rank_shapes_labels_disjoint_and_crop_area(
    tree: Path, tmp_path, monkeypatch
) -> None:
    """Two ranks, 8 steps = 2 epochs of 64 images (so a second pipeline is built at the epoch
    boundary): every step's images are uint8 NHWC [8, S, S, 3], the rows are exactly the
    sampler's samples of that rank and step (read back from the blue channel) with their labels,
    the two ranks' samples are disjoint and together cover each epoch once; every crop covers at
    least data.crop_min_area of the source (from the red/green gradients), some crop less than
    all of it, and some rows are flipped."""
    monkeypatch.setattr(dali_input, "CHUNK_FILES", 8)  # a pipeline per epoch, as for ImageNet
    min_area = 0.5
    cfg = _cfg(tree, tmp_path, f"data.crop_min_area={min_area}")
    seen: dict[int, list[np.ndarray]] = {}
    areas, flips = [], []
    for rank in (0, 1):
        task = ResNetTask(cfg, _world(rank, 2))
        pipe = task.input_pipeline(0, 8)
        assert isinstance(pipe, dali_input.DaliInput)
        for step in range(8):
            x, y = pipe.batch(step)
            assert pipe._end == (4 if step < 4 else 8)  # the epoch's pipeline
            assert x.shape == (8, S, S, 3) and x.dtype == torch.uint8 and y.dtype == torch.int64
            got = np.rint(x[:, :, :, 2].float().mean((1, 2)).numpy() / 4).astype(int)
            want = task.sampler.local_indices(step * 16)
            assert got.tolist() == want.tolist(), (rank, step)
            assert y.tolist() == (want // 16).tolist()  # class c holds images 16c .. 16c+15
            seen.setdefault(step, []).append(want)
            red, green = x[..., 0].float() / 4, x[..., 1].float() / 5
            wf = (red.amax((1, 2)) - red.amin((1, 2)) + 1) / W
            hf = (green.amax((1, 2)) - green.amin((1, 2)) + 1) / H
            areas += (wf * hf).tolist()
            flips += (red[:, :, 0].mean(1) > red[:, :, -1].mean(1)).tolist()
        pipe.close()
    for step, (a, b) in seen.items():
        assert not set(a) & set(b), step
    for epoch in (0, 1):
        both = np.concatenate([np.concatenate(seen[s]) for s in range(4 * epoch, 4 * epoch + 4)])
        assert sorted(both.tolist()) == list(range(N)), epoch
    # the resize's antialias filter shrinks a gradient's visible range by < 1 source pixel a side
    assert min(areas) >= min_area * 0.85, min(areas)
    assert min(areas) < 0.9 and 0 < sum(flips) < len(flips)


@pytest.mark.unit
def test_dali_get_prepares_micro_batches_and_resumes_at_the_step(tree: Path, tmp_path) -> None:
    """get(): grad_accum micro-batches of normalised float NCHW (the task's prepare_inputs) with
    their targets; a DaliInput started at step 3 (a resume) reads exactly the samples an
    uninterrupted one reads at step 3; steps out of order are refused."""
    cfg = _cfg(tree, tmp_path, "train.grad_accum=2")
    task = ResNetTask(cfg, _world(0, 1))
    pipe = task.input_pipeline(0, 8)
    mbs = pipe.get(0)
    assert [mb.samples for mb in mbs] == [8, 8]
    assert mbs[0].inputs.shape == (8, 3, S, S) and mbs[0].inputs.dtype == torch.float32
    for step in (1, 2):
        pipe.get(step)
    x3, y3 = pipe.batch(3)
    resumed = task.input_pipeline(3, 8)
    r3, ry3 = resumed.batch(3)
    assert torch.equal(y3, ry3)
    blue = [np.rint(t[..., 2].float().mean((1, 2)).numpy() / 4).tolist() for t in (x3, r3)]
    assert blue[0] == blue[1] == task.sampler.local_indices(3 * 16).tolist()
    with pytest.raises(Exception, match="step 5 but the next prepared step is 4"):
        pipe.get(5)


def _train_dali(world: Any, root: str, out: str) -> dict[str, Any]:
    from scaleout.train.trainer import Trainer

    cfg = _cfg(
        Path(root),
        Path(out) / "out",
        "train.max_steps=3",
        "train.eval_every=3",
        "train.progress=false",
        "checkpoint.dir=null",
        "checkpoint.every_steps=0",
        "data.num_workers=0",
        *EXTRA,
    )
    trainer = Trainer(cfg, world)
    kind = type(trainer.prefetcher).__name__
    result = trainer.train()
    return {"kind": kind, "status": result.status, "losses": trainer.losses}


@pytest.mark.multi_process
def test_trainer_with_data_decode_dali_trains(tree: Path, tmp_path) -> None:
    """The real trainer, one rank, data.decode=dali with data.num_workers=0 (one DALI thread):
    its input is the DALI pipeline, 3 steps train with finite losses and the run ends at
    max_steps (evaluation on the PIL path)."""
    (r,) = run_dist(_train_dali, nproc_per_node=1, args=(str(tree), str(tmp_path)))
    assert r["kind"] == "DaliInput" and r["status"] == "max_steps", r
    assert len(r["losses"]) == 3 and all(np.isfinite(r["losses"])), r


@pytest.mark.unit
def test_dali_refusals_are_one_line(tree: Path, tmp_path, monkeypatch) -> None:
    """Without nvidia-dali: one line naming the extra. A synthetic source, tar shards and the
    workers' decoded cache are refused by the config; shards found by data.format=auto by the
    task."""
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # what an install without it imports
    with pytest.raises(ConfigError, match=r"needs nvidia-dali \(pip install scaleout\[dali\]\)"):
        dali_input.require_dali()
    monkeypatch.undo()
    with pytest.raises(Exception, match="data.decode=dali decodes image files"):
        load_config(None, ["model.arch=resnet", "data.source=synthetic", "data.decode=dali"])
    with pytest.raises(Exception, match="not data.format=shards"):
        _cfg(tree, tmp_path, "data.format=shards")
    with pytest.raises(Exception, match="data.cache_decoded=true is a cache of the prefetch"):
        _cfg(tree, tmp_path, "data.cache_decoded=true")
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "train-000000.tar").write_bytes(b"")
    with pytest.raises(ConfigError, match="holds tar shards"):
        ResNetTask(_cfg(tmp_path / "shards", tmp_path), _world(0, 1))
