"""``build_task``: the task of ``model.arch`` (its family's, scaleout/families/) with the run's
precision."""

from __future__ import annotations

from scaleout.config.schema import Config
from scaleout.families.task import Task
from scaleout.train.precision import Precision
from scaleout.world import World

__all__ = ["Task", "build_task"]


def build_task(cfg: Config, world: World) -> Task:
    # model.init_checkpoint with a family that reads none is refused by the schema (Config)
    family = cfg.model.family
    task = family.build_task(cfg, world)
    task.precision = Precision(cfg.train.precision, world.device)
    task.choose_kernels()
    return task
