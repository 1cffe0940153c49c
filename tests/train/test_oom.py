"""A device out-of-memory in a training step: one line, not the allocator's report under a
traceback."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.unit
def test_step_out_of_memory_is_one_line_naming_rank_step_batch(monkeypatch) -> None:
    """A CUDA out-of-memory in a training step becomes one UserError line naming the rank, the
    step, the per-rank micro-batch and the keys to change. No GPU here: the step raises torch's
    own OutOfMemoryError (what the CUDA allocator raises) through the real Trainer.train loop."""
    from types import SimpleNamespace

    from scaleout.config import load_config
    from scaleout.errors import UserError
    from scaleout.train import trainer as trainer_mod

    cfg = load_config("bert_tiny_cpu", ["train.global_batch=64", "train.grad_accum=2"])
    world = SimpleNamespace(rank=3, world_size=4, device=torch.device("cuda", 3))
    report = "CUDA out of memory. Tried to allocate 2.00 GiB.\nGPU 3 has a total capacity of 80 GiB"
    fake = SimpleNamespace(
        cfg=cfg,
        world=world,
        start_info=SimpleNamespace(kind="new"),
        start_step=5,
        timers=SimpleNamespace(reset=lambda: None),
        task=SimpleNamespace(samples_per_step=lambda n: (64, 64 * 128)),
        optimizer=SimpleNamespace(param_groups=[{"lr": 1e-3}]),
        _start_clock=lambda: 0.0,
        mlperf_log=SimpleNamespace(close=lambda: None),
        checkpointer=None,  # train() also waits for a background checkpoint write
        gc=SimpleNamespace(stop=lambda: None),  # train() restores the garbage collector
    )
    fake._train = lambda: trainer_mod.Trainer._train(fake)  # train() = _train() + closing the log
    fake.run_step = lambda step: trainer_mod.Trainer.run_step(fake, step)  # the loop's body

    def oom(step):
        raise torch.OutOfMemoryError(report)

    fake.train_step = oom
    with pytest.raises(UserError) as info:
        trainer_mod.Trainer.train(fake)
    msg = str(info.value)
    assert "\n" not in msg, msg
    for needle in ("rank 3 step 5", "8 rows per micro-batch", "train.grad_accum", "2.00 GiB"):
        assert needle in msg, (needle, msg)
