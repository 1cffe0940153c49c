"""model.resnet.memory_format: the channels_last choice (measured on a CPU, agreed by every rank)
and the inputs handed to the model in its format."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from distutil import run_dist

from scaleout.errors import ConfigError
from scaleout.families.resnet import layout
from scaleout.families.resnet.config import ResNetConfig
from scaleout.families.resnet.model import build_resnet
from scaleout.families.resnet.task import normalise_images

TINY = ResNetConfig(depth=18, width=8, num_classes=10, image_size=16)
NARROW = TINY.model_copy(
    update={"width": 4}
)  # its shortcut 4 -> 8, stride 2: layout.cpu_nhwc_hazard


def _world(device: str = "cpu") -> SimpleNamespace:
    """The three fields use_channels_last reads; a CUDA device here is only a name (no GPU)."""
    return SimpleNamespace(device=torch.device(device), world_size=1, rank=0)


@pytest.mark.unit
def test_forced_formats_and_cuda_need_no_probe(monkeypatch):
    def no_probe(*_a, **_k):
        raise AssertionError("probed")

    monkeypatch.setattr(layout, "probe_seconds", no_probe)
    cl = TINY.model_copy(update={"memory_format": "channels_last"})
    plain = TINY.model_copy(update={"memory_format": "contiguous"})
    assert layout.use_channels_last(cl, _world(), 8) is True
    assert layout.use_channels_last(plain, _world(), 8) is False
    assert layout.use_channels_last(TINY, _world("cuda"), 8) is True


@pytest.mark.unit
def test_auto_on_cpu_takes_channels_last_only_when_it_wins_by_the_margin(monkeypatch, capsys):
    monkeypatch.setattr(layout, "probe_seconds", lambda cfg, batch: (1.0, 0.5))
    assert layout.use_channels_last(TINY, _world(), 8) is True
    assert "-> channels_last" in capsys.readouterr().out
    monkeypatch.setattr(layout, "probe_seconds", lambda cfg, batch: (1.0, 0.97))
    assert layout.use_channels_last(TINY, _world(), 8) is False


@pytest.mark.unit
def test_the_probe_times_both_formats_and_leaves_the_random_streams_alone():
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    plain, nhwc = layout.probe_seconds(TINY, 4, passes=1)
    assert 0 < plain < 10 and 0 < nhwc < 10
    assert torch.equal(torch.rand(3), want)


@pytest.mark.unit
def test_a_narrow_model_keeps_the_contiguous_layout_on_a_cpu(monkeypatch, capsys):
    """width 4: the first shortcut (4 -> 8 channels, 1x1, stride 2) aborts the process in
    oneDNN's channels_last backward (torch 2.13, AVX2 EPYC, one thread): auto does not even probe
    it, and asking for channels_last is a one-line error naming the layer. On CUDA it is cuDNN's."""

    def no_probe(*_a, **_k):
        raise AssertionError("probed")

    monkeypatch.setattr(layout, "probe_seconds", no_probe)
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN: the hazard is oneDNN's")
    assert layout.use_channels_last(NARROW, _world(), 8) is False
    out = capsys.readouterr().out
    assert "contiguous (the layer" in out and "4 -> 8 channels, stride 2" in out, out
    with pytest.raises(ConfigError, match=r"memory_format=channels_last: the layer .*4 -> 8"):
        layout.use_channels_last(
            NARROW.model_copy(update={"memory_format": "channels_last"}), _world(), 8
        )
    assert layout.cpu_nhwc_hazard(build_resnet(TINY)) is None
    cl = NARROW.model_copy(update={"memory_format": "channels_last"})
    assert layout.use_channels_last(cl, _world("cuda"), 8) is True


def _agreed(world, rank_times):
    real = layout.probe_seconds  # the pool's workers outlive this test: put it back
    layout.probe_seconds = lambda cfg, batch: rank_times[world.rank]
    try:
        return layout.use_channels_last(TINY, world, 4)
    finally:
        layout.probe_seconds = real


@pytest.mark.multi_process
def test_every_rank_takes_the_slowest_ranks_verdict():
    """Rank 0 alone would pick channels_last, rank 1 finds it slower: MAX over ranks decides, so
    both keep the contiguous layout (one model format per run, whatever each rank measured)."""
    times = {0: (1.0, 0.5), 1: (1.0, 2.0)}
    assert run_dist(_agreed, 1, 2, args=(times,)) == [False, False]
    times = {0: (1.0, 0.5), 1: (1.2, 0.6)}
    assert run_dist(_agreed, 1, 2, args=(times,)) == [True, True]


@pytest.mark.unit
def test_inputs_come_in_the_models_format():
    x = torch.randint(0, 256, (2, 8, 8, 3), dtype=torch.uint8)
    nhwc = normalise_images(x, channels_last=True)
    nchw = normalise_images(x)  # CPU default: contiguous
    assert nhwc.is_contiguous(memory_format=torch.channels_last) and nchw.is_contiguous()
    assert torch.equal(nhwc, nchw)
