"""What a training config (``scaleout.config``) tells the simulator: model size, batch, optimizer placement.

``scaleout simulate scale --config configs/bert_large_256x8.yaml`` simulates the run the config describes:

- model: BERT parameters and FLOPs from ``model.bert`` (scaleout.sim.step.bert_params /
  bert_flops_per_sequence). A sample is what ``train.global_batch`` counts: with ``data.packing`` a
  packed row (variable-length attention per sequence), taken as full of Wikipedia-512's mean sequence of
  512 / 2.0013 tokens (2.0013 per row, the packing ceiling); without packing, or on other data, one
  sequence padded to ``data.max_seq_len`` (an upper bound). The MLM head runs on ``data.mask_prob`` of
  the tokens with ``unpad_mlm_head``, else on all. ResNet: the ``resnet50`` preset;
- optimizer placement: ``optim.sharded`` -> ``sharded`` (scaleout's ShardedLAMB, ZeRO-1 over the world),
  else ``replicated``; overlap from ``optim.overlap_comm`` (sharded) or ``comm.overlap``;
- bytes on the wire: ShardedLAMB reduce-scatters its fp32 gradient buffer and all-gathers the parameters
  in their dtype (fp32: ``train.precision=bf16`` is autocast), so 4 B each whatever ``comm.compression``
  says; the replicated all-reduce sends 2 B with ``comm.compression`` bf16/fp16, else 4 B;
- ``comm.algorithm``, ``comm.bucket_mb``, ``comm.torus_x``;
- per-GPU batch = train.global_batch / (grad_accum x launch.nnodes x launch.nproc_per_node), samples to
  converge = train.max_steps x global_batch, evaluation every ``train.eval_every`` steps on
  ``data.eval_samples``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from scaleout.sim.collectives import config_row_length
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


def _bert(cfg: Any) -> tuple[ModelSpec, float]:
    """The model, and sequences per sample (packed rows hold several)."""
    b, data = cfg.model.bert, cfg.data
    packed = data.packing != "none" and data.source == "wikipedia" and data.max_seq_len == 512
    tokens = WIKI_512_MEAN_TOKENS if packed else float(data.max_seq_len)
    per_sample = data.max_seq_len / tokens if packed else 1.0
    masked = data.mask_prob if b.unpad_mlm_head else 1.0
    per_seq = bert_flops_per_sequence(
        tokens, b.layers, b.hidden, b.vocab_size, masked, b.intermediate
    )
    model = replace(
        get_model("bert-large"),
        name=f"bert {b.layers}x{b.hidden}",
        notes="from the config",
        params=float(
            bert_params(
                b.vocab_size, b.hidden, b.layers, b.intermediate, b.max_position, b.type_vocab_size
            )
        ),
        flops_per_sample=per_seq * per_sample,
        param_tensors=14
        + 12 * b.layers,  # as scaleout.models.bert registers them (302 at 24 layers)
    )
    return model, per_sample


def from_config(cfg: Any, source: str = "") -> ConfigRun:
    """The simulator's inputs for the run ``cfg`` describes."""
    model, per_sample = _bert(cfg) if cfg.model.arch == "bert" else (get_model("resnet50"), 1.0)
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
    sharded = cfg.optim.sharded
    train = TrainSpec(
        local_batch=t.global_batch / (t.grad_accum * gpus),
        algorithm=cfg.comm.algorithm,
        bucket_mb=cfg.comm.bucket_mb,
        overlap=cfg.optim.overlap_comm if sharded else cfg.comm.overlap,
        torus_x=config_row_length(cfg.comm, launch.nnodes, launch.nproc_per_node),
        optimizer=optimizer_of(cfg),
    )
    return ConfigRun(model, train, launch.nnodes, launch.nproc_per_node, source)
