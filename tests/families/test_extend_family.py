"""A model family added from this one file: a 2-layer MLP classifying synthetic points
(docs/extending.md).

It registers itself in :data:`scaleout.families.FAMILIES` and goes through the real path: a config
naming ``model.arch=toy_mlp`` (with its own ``model.toy_mlp`` section) validates, the simulator
prices it from its FLOP and parameter formulas, the report uses its quality exponent, and the real
Trainer trains it a few steps in a single-process world and evaluates it. It touches no other file
and unregisters at the end.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import Field

from scaleout.config import load_config
from scaleout.data.batches import MicroBatch
from scaleout.data.sampler import ShardedSampler
from scaleout.errors import ConfigError
from scaleout.families import FAMILIES, Family, register, unregister
from scaleout.families.task import Counts, Task
from scaleout.section import Section

NAME = "toy_mlp"


class ToyConfig(Section):
    features: int = Field(8, ge=1)
    hidden: int = Field(16, ge=1)
    classes: int = Field(2, ge=2)


def _points(cfg: ToyConfig, idx: np.ndarray, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Point i: Gaussian features; label = which half-space of a fixed direction it lies in."""
    g = torch.Generator().manual_seed(seed)
    direction = torch.randn(cfg.features, generator=g)
    x = torch.stack(
        [torch.randn(cfg.features, generator=g.manual_seed(seed + 1 + int(i))) for i in idx]
    )
    return x, (x @ direction > 0).long() % cfg.classes


class ToyBatches:
    """Data only (it pickles): this rank's micro-batches at a data position."""

    def __init__(self, cfg: ToyConfig, sampler: ShardedSampler, seed: int, flops_per_sample: float):
        self.cfg, self.sampler, self.seed, self.flops = cfg, sampler, seed, flops_per_sample

    def micro_batches(self, position: int, grad_accum: int) -> list[MicroBatch]:
        out = []
        for part in np.array_split(self.sampler.local_indices(position), grad_accum):
            x, y = _points(self.cfg, part, self.seed)
            out.append(MicroBatch(x, y, len(part), 0, self.flops * len(part)))
        return out


class ToyTask(Task):
    def __init__(self, cfg: Any, world: Any):
        super().__init__(cfg, world)
        c = cfg.model.toy_mlp
        self.rows = 4096
        self.sampler = ShardedSampler(
            self.rows, cfg.train.global_batch, world.rank, world.world_size, seed=cfg.data.seed
        )
        self.batches = ToyBatches(c, self.sampler, cfg.data.seed, TOY.flops_per_sample(cfg))
        self.eval_x, self.eval_y = _points(c, np.arange(self.rows, self.rows + 64), cfg.data.seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(c.features, c.hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(c.hidden, c.classes),
        ).to(world.device)

    def loss(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(mb.inputs), mb.target)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> float:
        counts = Counts(self.world)
        pred = model(self.eval_x.to(self.world.device)).argmax(1)
        counts.add((pred == self.eval_y.to(self.world.device)).sum(), len(self.eval_y))
        return counts.ratio()

    def samples_per_step(self, position: int) -> tuple[int, int]:
        return self.cfg.train.global_batch, 0

    @property
    def eval_size(self) -> int:
        return len(self.eval_y)


class ToyFamily(Family):
    name = NAME
    config = ToyConfig
    data_sources = ("synthetic",)
    metric = "accuracy"
    quality_exponent = 3.0
    sim_preset = "resnet50"  # fp32 gradients and an SGD-like optimizer's bytes per parameter

    def params(self, cfg: Any) -> int:
        c = cfg.model.toy_mlp
        return (c.features + 1) * c.hidden + (c.hidden + 1) * c.classes

    def param_tensors(self, cfg: Any) -> int:
        return 4

    def flops_per_sample(self, cfg: Any) -> float:
        c = cfg.model.toy_mlp
        return 3.0 * 2.0 * (c.features * c.hidden + c.hidden * c.classes)

    def build_task(self, cfg: Any, world: Any) -> Task:
        return ToyTask(cfg, world)


TOY = ToyFamily()


@pytest.fixture(autouse=True)
def toy() -> Iterator[ToyFamily]:
    register(TOY)
    try:
        yield TOY
    finally:
        unregister(NAME)
    assert NAME not in FAMILIES
    with pytest.raises(ConfigError, match="model.arch"):
        load_config(None, [f"model.arch={NAME}"])


RUN = [
    f"model.arch={NAME}",
    f"model.{NAME}.hidden=32",
    "optim.name=sgd",
    "optim.lr=0.5",
    "optim.momentum=0.0",
    "optim.weight_decay=0.0",
    "launch.env=single",
    "train.global_batch=32",
    "train.max_steps=30",
    "train.eval_every=30",
    "train.progress=false",
    "train.metrics=[]",
]


@pytest.mark.unit
def test_a_config_names_it_and_the_simulator_prices_it(toy: ToyFamily) -> None:
    from scaleout.sim.fromconfig import from_config
    from scaleout.telemetry.report import RunReport

    cfg = load_config(None, RUN)
    assert cfg.model.arch == NAME and cfg.model.toy_mlp.hidden == 32
    cfg.check_world(4)
    with pytest.raises(ConfigError, match=f"model.{NAME}.hidden"):
        load_config(None, [*RUN, f"model.{NAME}.hidden=0"])
    with pytest.raises(ConfigError, match="data.source"):
        load_config(None, [*RUN, "data.source=nope"])
    run = from_config(cfg)
    assert run.model.params == (8 + 1) * 32 + (32 + 1) * 2
    assert run.model.flops_per_sample == 6.0 * (8 * 32 + 32 * 2)
    report = RunReport(
        arch=NAME, time_to_train_s=1.0, steps=1, samples=1, flops_per_sample=1.0, devices=1
    )
    assert report.quality_exponent == 3.0


@pytest.mark.full_system  # a training run end to end (one rank, in this process)
def test_the_trainer_trains_and_evaluates_it(toy: ToyFamily, tmp_path) -> None:
    from scaleout.train.trainer import Trainer
    from scaleout.world import init

    cfg = load_config(None, [*RUN, f"train.output_dir={tmp_path}"])
    world = init(cfg)
    try:
        trainer = Trainer(cfg, world)
        result = trainer.train()
    finally:
        world.close()
    assert result.status == "max_steps" and result.steps == 30
    assert trainer.task.family is toy and trainer.task.metric_name == "accuracy"
    assert result.metric is not None and result.metric > 0.75  # the half-space is learnable
    assert trainer.losses[-1] < trainer.losses[0]
