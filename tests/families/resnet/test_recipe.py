"""The MLPerf ResNet recipe's keys: label smoothing in ResNetTask.loss, the flagship config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from scaleout.config import load_config
from scaleout.families.resnet.task import ResNetTask

pytestmark = pytest.mark.unit


def test_loss_uses_model_resnet_label_smoothing():
    """ResNetTask.loss is F.cross_entropy with model.resnet.label_smoothing (the loss method
    alone, on a stand-in task: building a task needs data and a World); 0 = plain CE."""
    torch.manual_seed(0)
    logits, target = torch.randn(6, 5), torch.randint(0, 5, (6,))
    mb = SimpleNamespace(inputs=logits, target=target)
    for eps in (0.0, 0.1):
        cfg = load_config(None, ["model.arch=resnet", f"model.resnet.label_smoothing={eps}"])
        got = ResNetTask.loss(SimpleNamespace(cfg=cfg), lambda x: x, mb)
        assert torch.equal(got, F.cross_entropy(logits, target, label_smoothing=eps))
    assert not torch.equal(
        F.cross_entropy(logits, target, label_smoothing=0.1), F.cross_entropy(logits, target)
    )


def test_flagship_config_has_the_recipe():
    cfg = load_config("resnet50_128x8")
    assert cfg.model.resnet.label_smoothing == 0.1  # NVIDIA's LABELSMOOTHING, the reference's
    assert cfg.data.num_workers >= 1 and cfg.model.resnet.eval_bn == "running"
    with pytest.raises(Exception, match="label_smoothing"):
        load_config(None, ["model.arch=resnet", "model.resnet.label_smoothing=1.5"])
