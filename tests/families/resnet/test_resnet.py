"""ResNet models (v1.5), FLOP count, synthetic images and the ImageFolder reader."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from scaleout.errors import TopologyError, UserError
from scaleout.families.resnet.config import ResNetConfig
from scaleout.families.resnet.data import ImageFolder, SyntheticImages
from scaleout.families.resnet.flops import forward_macs
from scaleout.families.resnet.model import Bottleneck, ResNet, build_resnet, count_macs


@pytest.mark.multi_process
def test_resnet_matches_published_sizes_and_v15_stride():
    # torchvision's published parameter counts and GFLOPs (multiply-adds) for the same architectures
    r50 = ResNet(50)
    assert sum(p.numel() for p in r50.parameters()) == 25_557_032
    macs = count_macs(r50)
    assert abs(macs - 4.089e9) / 4.089e9 < 1e-3
    assert macs == forward_macs(ResNetConfig())  # the formula the report and the simulator use
    assert sum(p.numel() for p in ResNet(18).parameters()) == 11_689_512
    first = r50.stages[1][0]
    assert isinstance(first, Bottleneck)
    assert first.conv1.stride == (1, 1) and first.conv2.stride == (2, 2)  # v1.5: stride on the 3x3
    assert all(
        m.last_bn().weight.abs().sum() == 0 for m in r50.modules() if isinstance(m, Bottleneck)
    )
    r50b = ResNet(50, zero_init_residual=False)
    assert all(
        torch.all(m.last_bn().weight == 1) for m in r50b.modules() if isinstance(m, Bottleneck)
    )


@pytest.mark.multi_process
def test_small_resnets_from_config_and_errors():
    blocks = {}
    for depth in (18, 34, 50, 101, 152):
        cfg = ResNetConfig(depth=depth, width=4, num_classes=10, image_size=16)
        m = build_resnet(cfg)
        blocks[depth] = sum(len(stage) for stage in m.stages)
        if depth in (18, 50):
            assert m(torch.randn(2, 3, 16, 16)).shape == (2, 10)
        assert not isinstance(m.stem[-1], nn.MaxPool2d)  # CIFAR stem below 128 px
    assert blocks == {18: 8, 34: 16, 50: 16, 101: 33, 152: 50}  # He et al. 2015, Table 1
    assert isinstance(ResNet(18, width=4, image_size=128).stem[-1], nn.MaxPool2d)
    with pytest.raises(TopologyError, match="bn_group=2"):
        build_resnet(ResNetConfig(depth=18, width=4, bn_group=2))


@pytest.mark.multi_process
def test_synthetic_images_deterministic_and_learnable():
    data = SyntheticImages(num_classes=10, image_size=16, length=10_000, seed=3)
    x1, y1 = data.get(np.array([5, 7, 9]))
    x2, y2 = data.get(np.array([5, 7, 9]))
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(data.get(np.array([6]))[0][0], x1[0])
    assert not torch.equal(SyntheticImages(10, 16, 100, seed=4).get(np.array([5]))[0][0], x1[0])
    # a tiny ResNet learns it well above chance (10 %) in a few dozen steps
    threads = torch.get_num_threads()
    torch.set_num_threads(
        1
    )  # tiny convolutions: one thread avoids OpenMP spinning on a shared machine
    try:
        acc = _train_tiny_resnet(data)
    finally:
        torch.set_num_threads(threads)
    assert acc > 0.5, acc


def _train_tiny_resnet(data: SyntheticImages) -> float:
    torch.manual_seed(0)
    model = ResNet(18, width=4, num_classes=10, image_size=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(30):
        x, y = data.get(np.arange(step * 32, step * 32 + 32))
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    model.eval()
    x, y = data.get(np.arange(9000, 9200))
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


@pytest.mark.unit
def test_image_folder_reader(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for cls in ["n01", "n02"]:
            d = tmp_path / split / cls
            d.mkdir(parents=True)
            for i, (w, h) in enumerate([(40, 30), (25, 50), (64, 64)]):
                arr = (rng.random((h, w, 3)) * 255).astype(np.uint8)
                Image.fromarray(arr).save(d / f"img{i}.JPEG", quality=90)
    (tmp_path / "train" / "n01" / "notes.txt").write_text("ignored")
    train = ImageFolder(tmp_path, "train", image_size=24, seed=1)
    assert train.classes == ["n01", "n02"] and len(train) == 6
    x, y = train.get(np.arange(6), epoch=0)
    assert x.shape == (6, 24, 24, 3) and x.dtype == torch.uint8  # host format: uint8 NHWC
    assert y.tolist() == [0, 0, 0, 1, 1, 1]
    assert torch.equal(
        train.get(np.arange(6), epoch=0)[0], x
    )  # deterministic per (seed, epoch, index)
    assert not torch.equal(train.get(np.arange(6), epoch=1)[0], x)  # fresh augmentation each epoch
    val = ImageFolder(tmp_path, "val", image_size=24)
    v1, _ = val.get(np.arange(6))
    assert torch.equal(v1, val.get(np.arange(6), epoch=5)[0])  # evaluation is not augmented
    assert v1.dtype == torch.uint8 and 64 < float(v1.float().mean()) < 192  # pixels, not normalised
    with pytest.raises(UserError, match="no 'test' folder"):
        ImageFolder(tmp_path, "test")


@pytest.mark.unit
def test_cudnn_benchmark_on_cuda_only(monkeypatch):
    """ResNet's fixed shapes: cuDNN autotunes its convolutions on CUDA (cudnn.benchmark), not on
    CPU. Setting the flag needs no GPU; the task calls this with its world's device."""
    from scaleout.families.resnet.task import tune_convolutions

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    tune_convolutions(torch.device("cpu"))
    assert torch.backends.cudnn.benchmark is False
    tune_convolutions(torch.device("cuda", 0))
    assert torch.backends.cudnn.benchmark is True
