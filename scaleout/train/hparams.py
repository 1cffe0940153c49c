"""The hyper-parameter keys the MLPerf rules require for a run: the common ones (batch sizes,
precision, parallelism, config file) here, the optimizer's from the model family
(scaleout/families/<arch>/__init__.py)."""

from __future__ import annotations

import os
from typing import Any

import torch

from scaleout.config.schema import Config
from scaleout.telemetry.mlperf import mlperf_numerics


def hyperparameters(
    cfg: Config,
    world_size: int,
    config_file: str = "config.yaml",
    steps_per_epoch: int | None = None,
    sequences_per_row: float | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """The MLPerf hyper-parameter keys of ``cfg`` (BERT/LAMB, ResNet/LARS: the family of
    ``model.arch``).

    ``steps_per_epoch`` (ResNet) turns step counts into the epochs the LARS keys use. The precision
    keys say what runs on ``device`` (scaleout.telemetry.mlperf.mlperf_numerics).

    Batch sizes are in *samples*, never packed rows: with BERT packing, ``train.global_batch``
    counts rows of up to ``data.max_per_pack`` sequences, and ``sequences_per_row`` (the packing's
    speed-up, ~2 on Wikipedia; None where a row is one sample) turns rows into sequences the way
    NVIDIA's packed submissions log it (``global_batch_size = rows x average_packing_rate``, an
    integer rate: run_pretraining.py ``global_batch_size(args)``, training_results_v2.0+).
    """
    t = cfg.train
    family = cfg.model.family
    rate = max(1, round(sequences_per_row)) if sequences_per_row else 1
    micro = t.global_batch // (world_size * t.grad_accum) * rate
    # the gradients' wire dtype: comm.compression for DataParallel's all-reduce and the sharded
    # LAMB's reduce-scatter alike (both honour it; the sharded all-gather moves fp32 parameters)
    compression = cfg.comm.compression
    common: dict[str, Any] = {
        "seed": t.seed,
        "global_batch_size": t.global_batch * rate,
        "gradient_accumulation_steps": t.grad_accum,
        "micro_batch_size": max(micro, 1),
        **mlperf_numerics(t.precision, device, compression, family.convolutions),
        # pure data parallelism: every other degree is 1
        "tensor_parallelism": 1,
        "pipeline_parallelism": 1,
        "context_parallelism": 1,
        "expert_parallelism": 1,
        "config_filename": os.path.basename(config_file),
    }
    return {**common, **family.mlperf_hparams(cfg, steps_per_epoch, world_size)}
