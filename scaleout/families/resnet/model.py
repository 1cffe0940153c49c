"""ResNet-18/34/50/101/152 (v1.5, as MLPerf uses), width-scalable for small CPU variants.

v1.5 (the MLPerf reference, and NVIDIA DeepLearningExamples' "ResNet-50 v1.5") puts the stride-2 of
a down-sampling bottleneck on the 3x3 conv instead of the first 1x1 conv, which is slightly more
accurate (~0.5 % top-1) for ~0.3 GMACs more than v1 (4.1 vs 3.8 G multiply-adds at 224 px, He et al.
2015).

``zero_init_residual`` sets the last BN's gamma of every residual block to 0, so each block starts
as the identity (Goyal et al. 2017, arXiv 1706.02677, sec. 5.1); large-batch LARS runs rely on it.
``width`` is the stem width (64 in the paper); stage widths are width x (1, 2, 4, 8). Images below
128 px use a CIFAR-style stem (3x3 stride-1 conv, no max-pool) so that 32 px inputs keep spatial
size. Batch norm is :mod:`scaleout.families.resnet.group_bn` when ``bn_group`` > 1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from scaleout.errors import ConfigError
from scaleout.families.resnet.config import ResNetConfig
from scaleout.families.resnet.flops import LAYERS, STEM_MIN_IMAGE
from scaleout.families.resnet.group_bn import norm_factory

if TYPE_CHECKING:
    from scaleout.world import World

Norm = Callable[[int], nn.Module]


def _conv(cin: int, cout: int, k: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int, norm: Norm):
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = _conv(cin, width, 3, stride), norm(width)
        self.conv2, self.bn2 = _conv(width, cout, 3), norm(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(_conv(cin, cout, 1, stride), norm(cout))

    def last_bn(self) -> nn.Module:
        return self.bn2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idt = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + idt)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int, norm: Norm):
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = _conv(cin, width, 1), norm(width)
        # v1.5: stride on the 3x3
        self.conv2, self.bn2 = _conv(width, width, 3, stride), norm(width)
        self.conv3, self.bn3 = _conv(width, cout, 1), norm(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(_conv(cin, cout, 1, stride), norm(cout))

    def last_bn(self) -> nn.Module:
        return self.bn3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idt = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + idt)


class ResNet(nn.Module):
    def __init__(
        self,
        depth: int = 50,
        width: int = 64,
        num_classes: int = 1000,
        image_size: int = 224,
        zero_init_residual: bool = True,
        norm: Norm = nn.BatchNorm2d,
    ):
        super().__init__()
        if depth not in LAYERS:
            raise ConfigError(f"model.resnet.depth={depth} is not one of {sorted(LAYERS)}")
        kind, blocks = LAYERS[depth]
        block = Bottleneck if kind == "bottleneck" else BasicBlock
        self.depth, self.image_size = depth, image_size
        if image_size >= STEM_MIN_IMAGE:
            self.stem = nn.Sequential(
                nn.Conv2d(3, width, 7, 2, 3, bias=False),
                norm(width),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(3, 2, 1),
            )
        else:
            self.stem = nn.Sequential(_conv(3, width, 3), norm(width), nn.ReLU(inplace=True))
        stages, cin = [], width
        for i, n in enumerate(blocks):
            w = width * 2**i
            layers = []
            for j in range(n):
                layers.append(block(cin, w, 2 if (j == 0 and i > 0) else 1, norm))
                cin = w * block.expansion
            stages.append(nn.Sequential(*layers))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, (BasicBlock, Bottleneck)):
                    nn.init.zeros_(m.last_bn().weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def build_resnet(cfg: ResNetConfig, world: World | None = None) -> ResNet:
    """ResNet from a :class:`scaleout.families.resnet.config.ResNetConfig` (group BN over
    ``bn_group`` ranks)."""

    if world is not None and cfg.bn_group > world.world_size:
        raise ConfigError(
            f"model.resnet.bn_group={cfg.bn_group} exceeds the world size {world.world_size}"
        )
    return ResNet(
        cfg.depth,
        cfg.width,
        cfg.num_classes,
        cfg.image_size,
        cfg.zero_init_residual,
        norm=norm_factory(world, cfg.bn_group, cfg.eval_bn),
    )


def count_macs(model: nn.Module, input_shape: tuple[int, ...] = (1, 3, 224, 224)) -> int:
    """Multiply-accumulates per sample of one forward pass through the conv and linear layers."""
    total = [0]

    def conv_hook(m: nn.Conv2d, _inp: Any, out: torch.Tensor) -> None:
        k = m.kernel_size[0] * m.kernel_size[1] * m.in_channels // m.groups
        total[0] += out[0].numel() * k

    def linear_hook(m: nn.Linear, _inp: Any, out: torch.Tensor) -> None:
        total[0] += out[0].numel() * m.in_features

    handles = [
        m.register_forward_hook(conv_hook) for m in model.modules() if isinstance(m, nn.Conv2d)
    ]
    handles += [
        m.register_forward_hook(linear_hook) for m in model.modules() if isinstance(m, nn.Linear)
    ]
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros(1, *input_shape[1:]))
    finally:
        model.train(was)
        for h in handles:
            h.remove()
    return total[0]
