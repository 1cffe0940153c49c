"""Device discipline and host syncs of the training path, on an emulated CUDA device
(tests/fakecuda.py).

Real multi-process gloo ranks run the real trainer (build, steps, evaluation, checkpoint,
consistency check) while world.device is an emulated ``cuda:0``: any collective on a tensor that is
not on the device raises NCCL's "No backend type associated with device type cpu", and every device
-> host read is recorded with its call site. The GPU is the one thing mocked (none exists here).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from distutil import run_dist
from fakecuda import FakeCuda

FAST = [
    "train.global_batch=8",
    "data.eval_samples=16",
    "optim.warmup_steps=1",
    "optim.total_steps=8",
    "train.progress=false",
    "train.eval_every=2",
    "train.max_steps=2",
    "comm.bucket_mb=0.25",
]


def _train(world: Any, arch_overrides: list[str], out: str) -> tuple[list[str], str]:
    """The whole trainer under FakeCuda; returns (collectives on host tensors, run status)."""
    from scaleout.config import load_config
    from scaleout.train.trainer import Trainer

    base = (
        "bert_tiny_cpu"
        if not any(o.startswith("model.arch=resnet") for o in arch_overrides)
        else "resnet_cpu"
    )
    cfg = load_config(
        base,
        [
            *FAST,
            f"train.output_dir={out}/out",
            f"checkpoint.dir={out}/ckpt",
            "checkpoint.every_steps=1",
            *arch_overrides,
        ],
    )
    with FakeCuda(world) as fc:
        trainer = Trainer(cfg, world)
        # The report reads the GPU's name and peak (torch.cuda.get_device_name): rank-local, no
        # collective.
        trainer._report = lambda *a, **k: None  # noqa: ARG005
        try:
            status = trainer.train().status
        except RuntimeError as exc:
            if not fc.violations:
                raise
            status = f"raised: {str(exc).splitlines()[0]}"
    return fc.violations, status


@pytest.mark.full_system
@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(["comm.algorithm=hierarchical"], id="bert-dataparallel-hierarchical"),
        pytest.param(["optim.sharded=true"], id="bert-sharded-lamb"),
        pytest.param(
            ["model.arch=resnet", "model.resnet.bn_group=2", "comm.algorithm=flat"],
            id="resnet-groupbn-lars",
        ),
    ],
)
def test_every_collective_of_the_training_path_is_on_the_device(
    tmp_path: Path, overrides: list[str]
) -> None:
    """2 nodes x 1 rank; fails on a collective given a host tensor anywhere in
    build/step/eval/save (the evaluation counters were CPU tensors: every multi-GPU run crashed
    at its first evaluation)."""
    results = run_dist(
        _train, nnodes=2, nproc_per_node=1, args=(overrides, str(tmp_path)), timeout=300
    )
    for rank, (violations, status) in enumerate(results):
        assert violations == [], f"rank {rank}: {violations}"
        assert status == "max_steps", f"rank {rank}: {status}"


def _bad_collective(world: Any) -> list[str]:
    import torch.distributed as dist

    with FakeCuda(world) as fc:
        ok = torch.ones(2, device=world.device)
        dist.all_reduce(ok)  # on the device: fine
        try:
            dist.all_reduce(torch.zeros(2, dtype=torch.float64))  # what the evaluation did
        except RuntimeError:
            pass
    return fc.violations


@pytest.mark.multi_process
def test_fakecuda_rejects_a_host_tensor_collective() -> None:
    """The harness itself: a host tensor in a collective is caught, a device tensor is not."""
    for violations in run_dist(_bad_collective, nnodes=1, nproc_per_node=2):
        assert (
            len(violations) == 1
            and "No backend type associated with device type cpu" in violations[0]
        )
        assert "test_device_discipline.py" in violations[0]


def _syncs_per_step(
    world: Any, out: str, every: int, steps: int, config: str, overrides: list[str]
) -> list[list[tuple[str, str]]]:
    """Run the trainer under FakeCuda; the device -> host reads of each train_step, in order."""
    from scaleout.config import load_config
    from scaleout.train.trainer import Trainer

    cfg = load_config(
        config,
        [
            *FAST,
            f"train.output_dir={out}",
            "checkpoint.dir=null",
            "checkpoint.every_steps=0",
            f"train.max_steps={steps}",
            f"train.eval_every={steps}",
            f"train.timing_every={every}",
            *overrides,
        ],
    )
    per_step: list[list[tuple[str, str]]] = []
    with FakeCuda(world) as fc:
        trainer = Trainer(cfg, world)
        trainer._report = lambda *a, **k: None  # noqa: ARG005 -- reads the GPU's name; rank-local
        inner = trainer.train_step

        def counted(step: int) -> Any:
            before = len(fc.syncs)
            try:
                return inner(step)
            finally:
                per_step.append(fc.syncs[before:])

        trainer.train_step = counted
        assert trainer.train().status == "max_steps"
    return per_step


@pytest.mark.full_system
@pytest.mark.parametrize(
    ("config", "overrides"),
    [
        pytest.param(
            "bert_tiny_cpu",
            ["model.bert.static_shapes=true", "comm.algorithm=hierarchical"],
            id="bert-lamb",
        ),
        pytest.param(
            "resnet_cpu",
            ["model.resnet.bn_group=2", "comm.algorithm=flat"],
            id="resnet-groupbn-lars",
        ),
    ],
)
def test_unsampled_steps_read_the_device_once(
    tmp_path: Path, config: str, overrides: list[str]
) -> None:
    """A training step reads nothing from the device but the agreement flags (one read per step,
    which also carries the loss and the reducer's usage); the timers synchronise only on sampled
    steps. Before: one usage .item() per parameter, a float() of the loss, a bool() of the
    finiteness check and of each flag, one .item() per group-BN layer, and two device
    synchronisations per phase on every step. (BERT's default forward selects masked positions by
    value, a documented host sync: the capture-safe forward is the one without.)"""
    every, steps = 3, 7
    for rank, per_step in enumerate(
        run_dist(
            _syncs_per_step,
            nnodes=2,
            nproc_per_node=1,
            args=(str(tmp_path), every, steps, config, overrides),
            timeout=300,
        )
    ):
        assert len(per_step) == steps
        for step, syncs in enumerate(per_step):
            if step == 0:
                # the first step rebuilds the buckets (an object broadcast); it is also sampled
                continue
            timers = [s for s in syncs if s[0] == "synchronize"]
            reads = [s for s in syncs if s[0] != "synchronize"]
            assert bool(timers) == (step % every == 0), f"rank {rank} step {step}: {syncs}"
            assert len(reads) == 1 and "faults.py" in reads[0][1], (
                f"rank {rank} step {step}: {syncs}"
            )
