"""The memory format the ResNet trains in (``model.resnet.memory_format``).

channels_last (NHWC) is what cuDNN's fast convolutions want, and every MLPerf ResNet uses it on
GPUs. On a CPU it depends on the machine and the shapes (oneDNN has NHWC kernels; for the CPU
config's 28 px ResNet-18 they were 1.2-1.35x faster on an AMD EPYC), so ``auto`` measures instead
of assuming: before ``run_start`` (no data touched: MLPerf-legal) each rank times a forward and
backward of a plain-BN copy of the model on a synthetic local batch in both formats, interleaved,
and keeps each format's fastest pass; one all-reduce (MAX: the slowest rank decides, since it sets
the step time) makes every rank take the same format. The probe runs under ``fork_rng``, so the
run's random streams are those of a run without it.

One model is kept out of channels_last on a CPU whatever the probe would say: torch 2.13's oneDNN
corrupts the heap (an abort or a segfault, no Python error) in the channels_last backward of a
strided 1x1 convolution with fewer than ``NHWC_MIN_POINTWISE_IN`` input channels, as a narrow
ResNet's first downsampling shortcut is (reproduced on an AMD EPYC with AVX2, one thread; with the
native kernels, ``torch.backends.mkldnn.enabled=False``, it is fine). :func:`cpu_nhwc_hazard` names
that layer; ``auto`` then keeps the contiguous layout and ``channels_last`` is refused.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from scaleout.errors import ConfigError

if TYPE_CHECKING:
    from scaleout.families.resnet.config import ResNetConfig
    from scaleout.world import World

# channels_last must win by this margin to be chosen (a tie keeps the default layout).
MARGIN = 0.95
PASSES = 3  # timed passes per format, after one untimed (oneDNN builds its primitives then)
NHWC_MIN_POINTWISE_IN = (
    7  # fewest input channels of a strided 1x1 conv oneDNN's NHWC backward survives
)


def cpu_nhwc_hazard(model: nn.Module) -> str | None:
    """The name of the layer whose channels_last backward crashes oneDNN on a CPU (module
    docstring), or None: a 1x1 convolution with a stride and fewer than 7 input channels."""
    if not torch.backends.mkldnn.is_available() or not torch.backends.mkldnn.enabled:
        return None
    for name, m in model.named_modules():
        if (
            isinstance(m, nn.Conv2d)
            and m.kernel_size == (1, 1)
            and m.stride != (1, 1)
            and m.in_channels < NHWC_MIN_POINTWISE_IN
        ):
            return f"{name} ({m.in_channels} -> {m.out_channels} channels, stride {m.stride[0]})"
    return None


def probe_seconds(cfg: ResNetConfig, batch: int, passes: int = PASSES) -> tuple[float, float]:
    """(contiguous, channels_last): the fastest of ``passes`` forward + backward passes of a
    plain-BN copy of the model on ``batch`` random images, on the CPU."""
    from scaleout.families.resnet.model import build_resnet  # deferred: model imports task deps

    best = [float("inf"), float("inf")]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        models, inputs = [], []
        for fmt in (torch.contiguous_format, torch.channels_last):
            m = build_resnet(cfg.model_copy(update={"bn_group": 1}))
            x = torch.randn(batch, 3, cfg.image_size, cfg.image_size)
            models.append(m.to(memory_format=fmt))
            inputs.append(x.contiguous(memory_format=fmt))
        y = torch.randint(0, cfg.num_classes, (batch,))
        for i in range(passes + 1):
            for k in (0, 1):
                t0 = time.perf_counter()
                F.cross_entropy(models[k](inputs[k]), y).backward()
                if i:
                    best[k] = min(best[k], time.perf_counter() - t0)
    return best[0], best[1]


def use_channels_last(cfg: ResNetConfig, world: World, batch: int) -> bool:
    """Whether this run's model is put in channels_last (the same answer on every rank)."""
    if cfg.memory_format == "contiguous":
        return False
    if world.device.type != "cpu":
        return cfg.memory_format == "channels_last" or world.device.type == "cuda"
    from scaleout.families.resnet.model import build_resnet  # deferred: model imports task deps

    hazard = cpu_nhwc_hazard(build_resnet(cfg.model_copy(update={"bn_group": 1})))
    if hazard and cfg.memory_format == "channels_last":
        raise ConfigError(
            f"model.resnet.memory_format=channels_last: the layer {hazard} crashes torch's CPU "
            f"(oneDNN) channels_last backward; expected contiguous or auto for a model of width "
            f"{cfg.width} on a CPU"
        )
    if cfg.memory_format == "channels_last":
        return True
    if hazard:
        if world.rank == 0:
            print(
                f"model.resnet.memory_format=auto: contiguous (the layer {hazard} crashes "
                "oneDNN's channels_last backward on a CPU)",
                flush=True,
            )
        return False
    plain, nhwc = probe_seconds(cfg, max(1, batch))
    if world.world_size > 1 and dist.is_initialized():
        box = torch.tensor([plain, nhwc], dtype=torch.float64)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        plain, nhwc = box.tolist()
    choice = nhwc < MARGIN * plain
    if world.rank == 0:
        print(
            f"model.resnet.memory_format=auto: forward + backward of {batch} images "
            f"{plain * 1e3:.1f} ms contiguous, {nhwc * 1e3:.1f} ms channels_last (slowest rank) "
            f"-> {'channels_last' if choice else 'contiguous'}",
            flush=True,
        )
    return choice
