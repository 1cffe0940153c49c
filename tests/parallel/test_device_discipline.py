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

import numpy as np
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


def _train(world: Any, arch_overrides: list[str], out: str) -> tuple[list[str], str, list[str]]:
    """The whole trainer under FakeCuda; returns (collectives on host tensors, run status, stream
    hazards)."""
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
            *(SYNTHETIC_IMAGES if base == "resnet_cpu" else []),
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
    return fc.violations, status, fc.hazards


# resnet_cpu trains on Fashion-MNIST PNGs (written on first use, read by input workers): these
# tests check the device path, so they take in-memory synthetic images and no worker processes (a
# pooled rank is daemonic and cannot start them).
SYNTHETIC_IMAGES = [
    "data.source=synthetic",
    "data.prepare=none",
    "data.num_workers=0",
    "model.resnet.image_size=32",
]


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
    at its first evaluation), and on a stream hazard (tests/fakecuda.py: a collective or op reading
    data another stream wrote without waiting for it, device collectives from several threads)."""
    results = run_dist(
        _train, nnodes=2, nproc_per_node=1, args=(overrides, str(tmp_path)), timeout=300
    )
    for rank, (violations, status, hazards) in enumerate(results):
        assert violations == [], f"rank {rank}: {violations}"
        assert status == "max_steps", f"rank {rank}: {status}"
        assert hazards == [], f"rank {rank}: {hazards}"


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

    cfg = load_config(
        config,
        [
            *FAST,
            *(SYNTHETIC_IMAGES if config == "resnet_cpu" else []),
            f"train.output_dir={out}",
            "checkpoint.dir=null",
            "checkpoint.every_steps=0",
            f"train.max_steps={steps}",
            f"train.eval_every={steps}",
            f"train.timing_every={every}",
            *overrides,
        ],
    )
    return _per_step(world, cfg)[0]


def _per_step(world: Any, cfg: Any, graphs: bool = False) -> tuple[list[Any], list[Any]]:
    """The trainer's run of ``cfg`` under FakeCuda (``graphs``: with its CUDA-graph capture):
    (device -> host reads, pageable host -> device copies) of each train_step, in order."""
    from scaleout.train.trainer import Trainer

    per_step: list[list[tuple[str, str]]] = []
    h2d: list[list[tuple[str, str]]] = []
    with FakeCuda(world, graphs=graphs) as fc:
        trainer = Trainer(cfg, world)
        trainer._report = lambda *a, **k: None  # noqa: ARG005 -- reads the GPU's name; rank-local
        inner = trainer.train_step

        def counted(step: int) -> Any:
            before, copies = len(fc.syncs), len(fc.h2d)
            try:
                return inner(step)
            finally:
                per_step.append(fc.syncs[before:])
                h2d.append(fc.h2d[copies:])

        trainer.train_step = counted
        assert trainer.train().status == "max_steps"
    return per_step, h2d


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
            assert len(reads) == 1 and "agreement.py" in reads[0][1], (
                f"rank {rank} step {step}: {syncs}"
            )


# configs/bert_large_256x8.yaml at tiny sizes: every feature of the flagship step kept (packed rows
# of <= 3 sequences, unpadded MLM head, its model.cuda_graphs / static-shape choice, hierarchical
# all-reduce with bf16 wire compression, LAMB, bf16 autocast), only the sizes and the data source
# (the MLPerf shards are not here) changed.
FLAGSHIP_TINY = [
    "model.init_checkpoint=null",
    "model.bert.vocab_size=4096",
    "model.bert.hidden=32",
    "model.bert.layers=2",
    "model.bert.heads=2",
    "model.bert.intermediate=64",
    "model.bert.max_position=128",
    "data.source=pydoc",
    "data.path=null",
    "data.max_seq_len=128",
    "data.max_predictions=20",
    "data.eval_samples=16",
    # the input workers are processes of their own (the rank here is a pool process, which cannot
    # start children); their batches reach the step through the same to_device
    "data.num_workers=0",
    "train.global_batch=4",  # 2 packed rows per rank, as the flagship's 2 per GPU
    "train.eval_start_step=0",
    "train.target=null",
    "optim.warmup_steps=1",
    "optim.start_warmup_step=0",
    "optim.total_steps=8",
    "comm.bucket_mb=0.25",
    "train.progress=false",
]


def _flagship_step_traffic(world: Any, out: str, steps: int) -> tuple[list[Any], list[Any], bool]:
    from scaleout.config import load_config

    cfg = load_config(
        "bert_large_256x8",
        [
            *FLAGSHIP_TINY,
            f"train.output_dir={out}",
            "checkpoint.dir=null",
            "checkpoint.every_steps=0",
            f"train.max_steps={steps}",
            f"train.eval_every={steps}",
            f"train.timing_every={steps * 10}",
        ],
    )
    reads, copies = _per_step(world, cfg, graphs=True)
    return reads, copies, cfg.model.cuda_graphs


@pytest.mark.full_system
def test_flagship_step_reads_the_device_once_and_copies_nothing_pageable(tmp_path: Path) -> None:
    """The flagship BERT step (configs/bert_large_256x8.yaml shrunk, FLAGSHIP_TINY), 2 ranks on
    an emulated GPU with its CUDA-graph capture: one device -> host read per step, the
    agreement's (the flagship's sharded LAMB runs device-only under graphs: its skip and usage
    are read with the agreement), and no host -> device copy from pageable memory (each a
    synchronous staging copy on CUDA). Steps 0-2 are the eager warm-ups, step 3 captures (one
    device synchronisation before the capture, once per shape), step 4 replays. Before: the
    default forward's ~10 host syncs (position range check, masked-position and NSP selections),
    the reducer's census and the agreement's Python flags copied with torch.tensor(...,
    device=cuda), the batch copied from pageable memory; then the sharded LAMB's own read of its
    non-finite count and usage."""
    steps = 5
    for rank, (reads, copies, graphs) in enumerate(
        run_dist(
            _flagship_step_traffic,
            nnodes=2,
            nproc_per_node=1,
            args=(str(tmp_path), steps),
            timeout=300,
        )
    ):
        assert graphs, "the flagship config sets model.cuda_graphs"
        assert len(reads) == steps
        for step in range(1, steps):  # step 0 rebuilds the buckets (an object broadcast)
            sites = sorted(site.split(":")[0] for _, site in reads[step])
            expected = ["scaleout/train/agreement.py"]
            if step == 3:  # the capture
                expected = ["scaleout/train/agreement.py", "scaleout/train/capture.py"]
            assert sites == expected, f"rank {rank} step {step}: {reads[step]}"
            assert copies[step] == [], f"rank {rank} step {step}: {copies[step]}"


@pytest.mark.unit
def test_fakecuda_records_pageable_host_to_device_copies() -> None:
    """The harness: copies from pageable host memory are recorded with their call site, copies
    from pinned memory and device-side fills are not."""
    with FakeCuda() as fc:
        dev = fc.device
        x = torch.zeros(3, device=dev)
        torch.tensor([1.0, 2.0], device=dev)  # Python values: pageable
        torch.ones(3).to(dev, non_blocking=True)  # pageable
        x.copy_(torch.ones(3))  # pageable
        staged = torch.empty(3, pin_memory=True)
        assert staged.is_pinned() and torch.ones(3).pin_memory().is_pinned()
        x.copy_(staged, non_blocking=True)  # pinned: an asynchronous DMA
        staged.to(dev, non_blocking=True)
        torch.full((2,), 3.0, device=dev)  # a fill kernel, no copy
        x[0] = 1.0  # a scalar: no host tensor
    assert [k for k, _ in fc.h2d] == ["tensor", "to", "copy_"], fc.h2d
    assert all("test_device_discipline.py" in site for _, site in fc.h2d), fc.h2d


@pytest.mark.unit
@pytest.mark.parametrize("static", [False, True], ids=["default-forward", "static-shapes"])
def test_bert_forward_host_syncs_and_copies(static: bool) -> None:
    """One packed BERT forward + backward on the emulated GPU: the capture-safe forward reads
    nothing from the device; the default forward reads the position range check and one
    value-shaped selection per head (MLM, NSP), and neither copies from pageable memory. Before:
    the default forward made 6 reads (a boolean mask per selected tensor) and 2 pageable copies
    (torch.tensor(count, device=cuda) for the MLM and NSP totals)."""
    from scaleout.data.batches import to_device
    from scaleout.families.bert.config import BertConfig
    from scaleout.families.bert.data.bert_batch import (
        build_batch,
        padded_packs,
        synthetic_sequences,
    )
    from scaleout.families.bert.model import BertForPreTraining

    rng = np.random.default_rng(0)
    seqs = synthetic_sequences(rng.integers(12, 33, 6), 64, seed=0)
    batch = build_batch(seqs, padded_packs(6)[:2] + [[2, 3], [4, 5]], 64, 6, 2)
    torch.manual_seed(0)
    model = BertForPreTraining(
        BertConfig(
            vocab_size=64,
            hidden=16,
            layers=1,
            heads=2,
            intermediate=32,
            max_position=64,
            static_shapes=static,
        )
    )
    with FakeCuda() as fc:
        model.to(fc.device)
        inputs = to_device(batch, fc.device)
        before = len(fc.syncs), len(fc.h2d)
        model(inputs).loss.backward()
        reads, copies = fc.syncs[before[0] :], fc.h2d[before[1] :]
    assert copies == [], copies
    if static:
        assert reads == [], reads
    else:
        assert [k for k, _ in reads] == ["__int__", "nonzero", "nonzero"], reads
