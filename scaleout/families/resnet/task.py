"""``ResNetTask``: image classification (synthetic images or an ImageFolder), metric = top-1."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from scaleout.data.batches import MicroBatch
from scaleout.data.sampler import ShardedSampler
from scaleout.errors import ConfigError
from scaleout.families.resnet.data import ImageBatches, ImageFolder, SyntheticImages
from scaleout.families.resnet.data.fashion import ensure_prepared
from scaleout.families.resnet.flops import training_flops_per_image
from scaleout.families.resnet.group_bn import sync_batchnorm_stats
from scaleout.families.resnet.model import build_resnet
from scaleout.families.task import Counts, Task

if TYPE_CHECKING:
    from scaleout.config.schema import Config
    from scaleout.world import World


class ResNetTask(Task):
    def __init__(self, cfg: Config, world: World):
        super().__init__(cfg, world)
        r, d = cfg.model.resnet, cfg.data
        if d.source in ("imagenet", "images"):
            if not d.path:
                raise ConfigError(
                    f"data.source={d.source} needs data.path (an ImageFolder root with train/ and "
                    "val/)"
                )
            if d.prepare == "fashion-mnist":
                ensure_prepared(d.path, world)  # first use: rank 0 writes it, the others wait
            self.train_set = ImageFolder(
                d.path, "train", r.image_size, seed=d.seed, min_area=d.crop_min_area
            )
            self.eval_set = ImageFolder(d.path, "val", r.image_size)
            self.eval_idx = np.arange(min(d.eval_samples, len(self.eval_set)))
        elif d.source == "synthetic":
            n = max(cfg.train.global_batch * 256, 4096)
            self.train_set = SyntheticImages(
                r.num_classes, r.image_size, n + d.eval_samples, seed=d.seed
            )
            self.eval_set = self.train_set
            self.eval_idx = np.arange(
                n, n + d.eval_samples
            )  # held out: never in the training range
            self.train_set.length = n
        else:
            raise ConfigError(
                f"data.source={d.source!r} is not an image source (expected synthetic, imagenet "
                "or images)"
            )
        self.rows = len(self.train_set)
        self.sampler = ShardedSampler(
            self.rows, cfg.train.global_batch, world.rank, world.world_size, seed=d.seed
        )
        self.batches = ImageBatches(self.train_set, self.sampler, self.rows)
        self.model = build_resnet(r, world)
        # forward 2 FLOPs per multiply-add, backward 2x forward; any bn_group (flops.py)
        self.batches.flops_per_image = training_flops_per_image(r)
        self.model = self.model.to(world.device)
        if world.device.type == "cuda":
            self.model = self.model.to(memory_format=torch.channels_last)
        tune_convolutions(world.device)

    def loss(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        smoothing = self.cfg.model.resnet.label_smoothing
        return F.cross_entropy(model(mb.inputs), mb.target, label_smoothing=smoothing)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> float:
        w = self.world
        self.sync_buffers()  # every rank evaluates with the same (pooled) BN statistics
        mine = self.eval_idx[w.rank :: w.world_size]
        counts = Counts(w)
        was_training = model.training
        model.eval()
        for i in range(0, len(mine), 64):
            part = mine[i : i + 64]
            x, y = self.eval_set.get(part)
            with self.autocast():
                pred = model(x.to(w.device, non_blocking=True)).argmax(1)
            counts.add((pred == y.to(w.device, non_blocking=True)).sum(), len(part))
        model.train(was_training)
        return counts.ratio()

    def sync_buffers(self) -> None:
        sync_batchnorm_stats(self.model, self.world)

    def samples_per_step(self, position: int) -> tuple[int, int]:
        return self.cfg.train.global_batch, 0

    @property
    def eval_size(self) -> int:
        return len(self.eval_idx)

    def epoch_of(self, samples: int) -> int:
        return samples // max(self.rows, 1)


def tune_convolutions(device: torch.device) -> None:
    """On CUDA, let cuDNN benchmark its convolution algorithms (``cudnn.benchmark``): the ResNet
    step's shapes are fixed (one image size, one local batch), so each convolution is timed once
    and the fastest kernel kept, as NVIDIA's MLPerf ResNet does; the default heuristic pick can be
    several times slower for channels_last bf16 convolutions."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
