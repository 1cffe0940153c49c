"""``build_task``: the task of ``model.arch`` (its family's, scaleout/families/) with the run's
precision."""

from __future__ import annotations

from scaleout.config.schema import Config
from scaleout.errors import ConfigError
from scaleout.families import FAMILIES
from scaleout.families.task import Task
from scaleout.train.precision import Precision
from scaleout.world import World

__all__ = ["Task", "build_task"]


def build_task(cfg: Config, world: World) -> Task:
    family = FAMILIES.get(cfg.model.arch)
    if cfg.model.init_checkpoint and not family.hf_checkpoints:
        readers = [n for n, f in FAMILIES.items() if f.hf_checkpoints]
        raise ConfigError(
            f"model.init_checkpoint: model.arch={cfg.model.arch!r} starts from no checkpoint "
            f"(model.arch={' or '.join(readers)} reads one)"
        )
    task = family.build_task(cfg, world)
    task.precision = Precision(cfg.train.precision, world.device)
    task.choose_kernels()
    return task
