"""What a training config (``scaleout.config``) tells the simulator: model size, batch, optimizer placement.

``scaleout simulate scale --config configs/bert_large_256x8.yaml`` simulates the run the config describes:

- model: BERT parameters and FLOPs from ``model.bert`` (scaleout.sim.step.bert_params /
  bert_flops_per_sequence; sequences of ``data.max_seq_len`` tokens, or the Wikipedia-512 mean of
  512 / 2.0013 when the data is Wikipedia at 512 and packed or unpadded); ResNet: the ``resnet50`` preset;
- optimizer placement: ``optim.sharded`` -> ``sharded`` (scaleout's ShardedLAMB, ZeRO-1 over the world),
  else ``replicated``; overlap from ``optim.overlap_comm`` (sharded) or ``comm.overlap``;
- bytes on the wire: ShardedLAMB reduce-scatters its fp32 gradient buffer and all-gathers the parameters
  in their dtype (fp32: ``train.precision=bf16`` is autocast), so 4 B each whatever ``comm.compression``
  says; the replicated all-reduce sends 2 B with ``comm.compression`` bf16/fp16, else 4 B;
- ``comm.algorithm`` (flat = ring), ``comm.bucket_mb``, ``comm.torus_x``;
- per-GPU batch = train.global_batch / (grad_accum x launch.nnodes x launch.nproc_per_node), samples to
  converge = train.max_steps x global_batch, evaluation every ``train.eval_every`` steps on
  ``data.eval_samples``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from scaleout.sim.step import ModelSpec, TrainSpec, bert_flops_per_sequence, bert_params, get_model

WIKI_512_MEAN_TOKENS = 512 / 2.0013  # Graphcore arXiv 2107.02027: the Wikipedia-512 packing ceiling


@dataclass(frozen=True)
class ConfigRun:
    model: ModelSpec
    train: TrainSpec
    nodes: int
    gpus_per_node: int
    source: str


def optimizer_of(cfg: Any) -> str:
    return "sharded" if cfg.optim.sharded else "replicated"


def wire_bytes(cfg: Any) -> tuple[int, int]:
    """(gradient, parameter) bytes per element on the wire for this config's optimizer."""
    if cfg.optim.sharded:
        return 4, 4
    return (4 if cfg.comm.compression == "none" else 2), 4


def _bert(cfg: Any) -> ModelSpec:
    b, data = cfg.model.bert, cfg.data
    real = data.source == "wikipedia" and data.max_seq_len == 512 and data.packing != "none"
    tokens = WIKI_512_MEAN_TOKENS if real else float(data.max_seq_len)
    base = get_model("bert-large")
    return replace(
        base, name=f"bert {b.layers}x{b.hidden}", notes="from the config",
        params=float(bert_params(b.vocab_size, b.hidden, b.layers, b.intermediate, b.max_position, b.type_vocab_size)),
        flops_per_sample=bert_flops_per_sequence(tokens, b.layers, b.hidden, b.vocab_size, intermediate=b.intermediate),
        param_tensors=14 + 12 * b.layers,  # as scaleout.models.bert registers them (302 at 24 layers)
    )


def from_config(cfg: Any, source: str = "") -> ConfigRun:
    """The simulator's inputs for the run ``cfg`` describes."""
    model = _bert(cfg) if cfg.model.arch == "bert" else get_model("resnet50")
    grad_bytes, param_bytes = wire_bytes(cfg)
    launch, t = cfg.launch, cfg.train
    gpus = launch.nnodes * launch.nproc_per_node
    model = replace(model, grad_bytes=grad_bytes, param_bytes=param_bytes,
                    samples_to_converge=float(t.max_steps * t.global_batch),
                    eval_samples=float(cfg.data.eval_samples), eval_every_samples=float(t.eval_every * t.global_batch))
    sharded = cfg.optim.sharded
    train = TrainSpec(
        local_batch=t.global_batch / (t.grad_accum * gpus),
        algorithm="ring" if cfg.comm.algorithm == "flat" else cfg.comm.algorithm,
        bucket_mb=cfg.comm.bucket_mb,
        overlap=cfg.optim.overlap_comm if sharded else cfg.comm.overlap,
        torus_x=cfg.comm.torus_x,
        optimizer=optimizer_of(cfg),
    )
    return ConfigRun(model, train, launch.nnodes, launch.nproc_per_node, source)
