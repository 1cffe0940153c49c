"""ResNet image classification (LARS, group batch norm), MLPerf's ``resnet`` benchmark: the family's
torch-free declaration.

Folder: ``config.py`` (``model.resnet``), ``flops.py`` (multiply-adds and parameters from the
config), ``model.py``, ``group_bn.py`` (batch norm over ``bn_group`` ranks), ``data/``
(ImageFolder, synthetic images), ``task.py`` (``ResNetTask``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from scaleout.errors import ConfigError
from scaleout.families.base import Family, Reference, register
from scaleout.families.resnet.config import ResNetConfig
from scaleout.families.resnet.flops import (
    resnet_param_tensors,
    resnet_params,
    training_flops_per_image,
)
from scaleout.families.resnet.imagenet import IMAGENET_TRAIN_IMAGES

if TYPE_CHECKING:
    from scaleout.families.task import Task
    from scaleout.world import World

# The MLPerf ResNet LARS reference skips weight decay and trust-ratio adaptation for batch-norm and
# bias variables (batch-norm parameters are also excluded by module type: torch names them
# bn1.weight, ...).
LARS_EXCLUDE = ("bias", "bn", "batch_norm", "batchnorm", "BatchNorm")


class ResNetFamily(Family):
    name = "resnet"
    config = ResNetConfig
    # imagenet: ILSVRC2012 (its counts checked); images: any real labelled set at data.path
    data_sources = ("synthetic", "imagenet", "images")
    benchmark = "resnet"
    metric = "top1"
    quality_exponent = 5.0  # HPC-AI500's n for image classification
    train_samples = IMAGENET_TRAIN_IMAGES
    mlperf_epochs = True
    no_decay = LARS_EXCLUDE
    convolutions = True
    sim_preset = "resnet50"
    # ResNet-50 v1.5: 25.6M params, 4.09 G multiply-adds forward per 224x224 image (x2 FLOPs, x3 for
    # training; flops.py).
    reference = Reference(
        "resnet50",
        params=25.6e6,  # the published size (resnet_params(ResNetConfig()) = 25,557,032)
        flops_per_sample=training_flops_per_image(ResNetConfig()),
        grad_bytes=4,
        opt_bytes_per_param=16.0,
        # MLPerf LARS runs converge in ~35-40 epochs of ImageNet-1k
        samples_to_converge=37 * IMAGENET_TRAIN_IMAGES,
        eval_samples=50000,  # ImageNet validation set
        eval_rule="mlperf-resnet",  # every 4 epochs (scaleout.sim.step.eval_interval)
        notes="ResNet-50 v1.5, fp32 gradients (Horovod-era default)",
    )

    def params(self, cfg: Any) -> int:
        return resnet_params(cfg.model.resnet)

    def param_tensors(self, cfg: Any) -> int:
        return resnet_param_tensors(cfg.model.resnet)

    def flops_per_sample(self, cfg: Any) -> float:
        return training_flops_per_image(cfg.model.resnet)

    def describe(self, cfg: Any) -> str:
        return f"resnet{cfg.model.resnet.depth}"

    def check(self, cfg: Any, world_size: int) -> None:
        k = cfg.model.resnet.bn_group
        if k > world_size or world_size % k:
            raise ConfigError(f"model.resnet.bn_group={k} must divide the world size {world_size}")

    def mlperf_hparams(
        self, cfg: Any, steps_per_epoch: int | None = None, world_size: int = 1
    ) -> dict[str, Any]:
        """LARS keys and ``model_bn_span``. ``steps_per_epoch`` turns step counts into the epochs
        they use; by default one ImageNet-1k epoch at the configured global batch.

        ``lars_opt_learning_rate_decay_steps`` is the reference's (lars_util.py): train steps -
        warm-up steps + 1. ``model_bn_span``: the images one BN layer's statistics cover, the
        per-rank batch x ``bn_group`` (as the reference and NVIDIA log it)."""
        o, t = cfg.optim, cfg.train
        total = o.total_steps or t.max_steps
        spe = steps_per_epoch or max(math.ceil(IMAGENET_TRAIN_IMAGES / t.global_batch), 1)
        local = max(t.global_batch // (max(world_size, 1) * t.grad_accum), 1)
        return {
            "model_bn_span": local * cfg.model.resnet.bn_group,
            "opt_name": o.name,
            "lars_opt_base_learning_rate": o.lr,
            "lars_opt_end_learning_rate": o.end_lr,
            "lars_opt_learning_rate_decay_poly_power": o.power,
            "lars_opt_learning_rate_decay_steps": max(total - o.warmup_steps + 1, 1),
            "lars_epsilon": 0.0,
            "lars_opt_learning_rate_warmup_epochs": o.warmup_steps / spe,
            "lars_opt_momentum": o.momentum,
            "lars_opt_weight_decay": o.weight_decay,
        }

    def build_task(self, cfg: Any, world: World) -> Task:
        from scaleout.families.resnet.task import ResNetTask  # deferred: torch-free declaration

        return ResNetTask(cfg, world)


RESNET = register(ResNetFamily())
