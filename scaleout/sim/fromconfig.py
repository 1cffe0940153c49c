"""What a training config (``scaleout.config``) tells the simulator: model size, batch, optimizer
placement.

``scaleout simulate scale --config configs/bert_large_256x8.yaml`` simulates the run the config
describes:

- model: parameters, parameter tensors and training FLOPs per sample from the family of
  ``model.arch`` (scaleout/families/<arch>/: ``Family.params`` / ``flops_per_sample``, each family's
  flops.py). A sample is what ``train.global_batch`` counts: for BERT with ``data.packing`` a packed
  row taken as full of Wikipedia-512's mean sequence (2.0013 per row, the packing ceiling),
  otherwise one sequence padded to ``data.max_seq_len``. The bytes-per-parameter assumptions come
  from the family's preset (``Family.sim_preset``: bert-large, resnet50);
- optimizer placement: ``optim.sharded`` -> ``sharded`` (scaleout's ShardedLAMB, ZeRO-1 over the
  world), else ``replicated``; overlap from ``optim.overlap_comm`` (sharded) or ``comm.overlap``;
- bytes on the wire: 2 B per gradient element with ``comm.compression`` bf16/fp16, else 4 B; the
  replicated all-reduce sums them on the wire, ShardedLAMB moves them by all-to-all and sums in
  fp32 (``TrainSpec.wire_a2a``: scaleout.sim.sharded). ShardedLAMB all-gathers the parameters in
  their dtype (fp32: ``train.precision=bf16`` is autocast), 4 B;
- ``comm.algorithm``, ``comm.bucket_mb``, ``comm.torus_x``; ``comm.sharp`` (in-network reduction
  between nodes: ``ConfigRun.sharp``, applied to the cluster by ``scaleout simulate scale``);
- the step as the trainer runs it on CUDA (scaleout.train.capture ``graphed_step``): one CUDA graph
  when ``model.cuda_graphs`` is set and the optimizer can be captured with it (else eager,
  launch-bound), overlapped with backward only where the step's collectives run during it;
- per-GPU batch = train.global_batch / (grad_accum x launch.nnodes x launch.nproc_per_node), samples
  to converge = train.max_steps x global_batch, evaluation every ``train.eval_every`` steps on
  ``data.eval_samples``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from scaleout.sim.collectives import config_row_length
from scaleout.sim.step import ModelSpec, TrainSpec, get_model
from scaleout.train.capture import graphed_step


@dataclass(frozen=True)
class ConfigRun:
    model: ModelSpec
    train: TrainSpec
    nodes: int
    gpus_per_node: int
    source: str
    sharp: bool = False  # comm.sharp: in-network reduction between nodes


def optimizer_of(cfg: Any) -> str:
    if not cfg.optim.sharded:
        return "replicated"
    return "sharded-node" if cfg.optim.shard == "node" else "sharded"


def wire_bytes(cfg: Any) -> tuple[int, int]:
    """(gradient, parameter) bytes per element on the wire for this config's optimizer."""
    return (4 if cfg.comm.compression == "none" else 2), 4  # sharded too: fp32 parameters


def model_of(cfg: Any) -> tuple[ModelSpec, float]:
    """The model of ``cfg`` (its family's formulas), and evaluation samples per training sample."""
    fam = cfg.model.family
    model = replace(
        get_model(fam.sim_preset),
        name=fam.describe(cfg),
        notes="from the config",
        params=float(fam.params(cfg)),
        flops_per_sample=fam.flops_per_sample(cfg),
        param_tensors=fam.param_tensors(cfg),
    )
    return model, fam.sequences_per_sample(cfg)


def from_config(cfg: Any, source: str = "") -> ConfigRun:
    """The simulator's inputs for the run ``cfg`` describes (``comm.algorithm=auto`` is priced as
    the fastest named algorithm: scaleout.sim.step ``step_time``)."""
    model, per_sample = model_of(cfg)
    grad_bytes, param_bytes = wire_bytes(cfg)
    launch, t = cfg.launch, cfg.train
    gpus = launch.nnodes * launch.nproc_per_node
    model = replace(
        model,
        grad_bytes=grad_bytes,
        param_bytes=param_bytes,
        samples_to_converge=float(t.max_steps * t.global_batch),
        eval_samples=cfg.data.eval_samples / per_sample,  # evaluation counts sequences
        eval_every_samples=float(t.eval_every * t.global_batch),
    )
    captured, overlap = graphed_step(cfg)
    train = TrainSpec(
        local_batch=t.global_batch / (t.grad_accum * gpus),
        algorithm=cfg.comm.algorithm,
        bucket_mb=cfg.comm.bucket_mb,
        overlap=overlap,
        torus_x=config_row_length(cfg.comm, launch.nnodes, launch.nproc_per_node),
        optimizer=optimizer_of(cfg),
        cuda_graphs=captured,
        wire_a2a=cfg.comm.compression != "none",
    )
    return ConfigRun(model, train, launch.nnodes, launch.nproc_per_node, source, cfg.comm.sharp)
