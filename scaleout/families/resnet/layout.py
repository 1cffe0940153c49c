"""The memory format the ResNet trains in (``model.resnet.memory_format``).

channels_last (NHWC) is what cuDNN's fast convolutions want, and every MLPerf ResNet uses it on
GPUs. On a CPU it depends on the machine and the shapes (oneDNN has NHWC kernels; for the CPU
config's 28 px ResNet-18 they were 1.2-1.35x faster on an AMD EPYC), so ``auto`` measures instead
of assuming: before ``run_start`` (no data touched: MLPerf-legal) each rank times a forward and
backward of a plain-BN copy of the model on a synthetic local batch in both formats, interleaved,
and keeps each format's fastest pass; one all-reduce (MAX: the slowest rank decides, since it sets
the step time) makes every rank take the same format. The probe runs under ``fork_rng``, so the
run's random streams are those of a run without it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

if TYPE_CHECKING:
    from scaleout.families.resnet.config import ResNetConfig
    from scaleout.world import World

# channels_last must win by this margin to be chosen (a tie keeps the default layout).
MARGIN = 0.95
PASSES = 3  # timed passes per format, after one untimed (oneDNN builds its primitives then)


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
    if cfg.memory_format != "auto":
        return cfg.memory_format == "channels_last"
    if world.device.type != "cpu":
        return world.device.type == "cuda"
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
