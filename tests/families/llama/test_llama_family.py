"""The llama family through the real path: its config validates, the report reads its metric in
its direction (log-perplexity: lower is better), and the real Trainer trains it on the offline
corpus in one process and evaluates it."""

from __future__ import annotations

import pytest

from scaleout.config import load_config
from scaleout.errors import ConfigError
from scaleout.families import FAMILIES

SHORT = [
    "launch.env=single",
    "model.llama.seq_len=64",
    "train.global_batch=8",
    "train.max_steps=8",
    "optim.warmup_steps=2",  # the config's 20-step warm-up would leave 8 steps barely moving
    "optim.total_steps=8",
    "train.eval_every=8",
    "data.eval_samples=16",
    "train.progress=false",
    "checkpoint.dir=null",
    "checkpoint.every_steps=0",
]


@pytest.mark.unit
def test_the_config_validates_and_the_metric_points_down() -> None:
    cfg = load_config("llama_tiny_cpu")
    assert cfg.model.arch == "llama"
    with pytest.raises(ConfigError, match="model.llama.heads=4 must be a multiple of"):
        load_config("llama_tiny_cpu", ["model.llama.kv_heads=3"])
    with pytest.raises(ConfigError, match="data.source"):
        load_config("llama_tiny_cpu", ["data.source=imagenet"])
    fam = FAMILIES.get(cfg.model.arch)
    assert fam.reached(3.2, 3.3) and not fam.reached(3.4, 3.3)
    assert FAMILIES.get("bert").reached(0.73, 0.72) and not FAMILIES.get("bert").reached(0.7, 0.72)
    from scaleout.telemetry.report import RunReport

    report = RunReport(
        arch="llama",
        time_to_train_s=1.0,
        steps=1,
        samples=1,
        flops_per_sample=1.0,
        devices=1,
        achieved=3.0,
        target=3.3,
    )
    assert report.quality_ratio == pytest.approx(1.1)  # better than the target: above 1
    assert report.valid_flops_per_s == pytest.approx(1.1)  # n = 1


@pytest.mark.full_system  # a training run end to end (one rank, in this process)
def test_the_trainer_trains_and_evaluates_it(tmp_path) -> None:
    from scaleout.train.trainer import Trainer
    from scaleout.world import init

    cfg = load_config("llama_tiny_cpu", [*SHORT, f"train.output_dir={tmp_path}"])
    world = init(cfg)
    try:
        trainer = Trainer(cfg, world)
        result = trainer.train()
    finally:
        world.close()
    assert result.status == "max_steps" and result.steps == 8
    assert trainer.task.metric_name == "log_perplexity"
    # an untrained 4096-token model sits near ln(4096) = 8.3 nats; 8 steps move it down
    assert result.metric is not None and result.metric < 8.0
    assert trainer.losses[-1] < trainer.losses[0]


@pytest.mark.unit
def test_without_the_document_mask_a_row_trains_as_one_sequence() -> None:
    """model.llama.document_mask=false (bench ttt's baseline rows, in scaleout's trainer): the
    training loss is the row's as one causal sequence, across document boundaries; the evaluation
    keeps documents apart either way (the metric does not move with the knob)."""
    import torch

    from scaleout.data.sampler import DistributedSamplerOrder
    from scaleout.families.llama.task import LlamaTask
    from scaleout.world import init

    got = {}
    for mask in (True, False):
        cfg = load_config("llama_tiny_cpu", [*SHORT, f"model.llama.document_mask={mask}"])
        world = init(cfg)
        try:
            torch.manual_seed(0)
            task = LlamaTask(cfg, world)
            for position in range(0, 64 * 8, 8):  # the first batch with a document boundary
                mb = task.batches.micro_batches(position, 1)[0]
                tokens, doc_ids = mb.inputs["tokens"], mb.inputs["doc_ids"]
                if (doc_ids[:, 1:] != doc_ids[:, :-1]).any():
                    break
            else:
                raise AssertionError("no row holds two documents")
            with torch.no_grad():
                got[mask] = (task.loss(task.model, mb), task.evaluate(task.model))
                alone = task.model.loss(tokens, doc_ids if mask else None)
            assert torch.allclose(got[mask][0], alone)
        finally:
            world.close()
    assert not torch.allclose(got[True][0], got[False][0])
    assert got[True][1] == pytest.approx(got[False][1], abs=1e-6)
    cfg = load_config("llama_tiny_cpu", [*SHORT, "data.order=torch"])
    world = init(cfg)
    try:
        assert isinstance(LlamaTask(cfg, world).sampler, DistributedSamplerOrder)
    finally:
        world.close()
