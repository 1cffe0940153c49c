"""Llama 3.1 causal language modelling, MLPerf's ``llama31_8b`` benchmark (BERT's successor): the
family's torch-free declaration.

Folder: ``config.py`` (``model.llama``), ``flops.py`` (parameters and FLOPs from the config),
``model.py`` (the decoder, packed rows kept apart), ``hf.py`` (Hugging Face checkpoints both ways),
``data/`` (Megatron-style indexed token files, the rows cut from them, the offline pydoc corpus in
that layout), ``task.py`` (``LlamaTask``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scaleout.families.base import Family, Reference, register
from scaleout.families.llama.config import LlamaConfig
from scaleout.families.llama.flops import (
    llama_param_tensors,
    llama_params,
    training_flops_per_sequence,
)

if TYPE_CHECKING:
    from scaleout.families.task import Task
    from scaleout.world import World


class LlamaFamily(Family):
    name = "llama"
    config = LlamaConfig
    data_sources = ("pydoc", "c4")
    benchmark = "llama31_8b"
    # the evaluation's mean next-token cross-entropy in nats (MLPerf's target: 3.3); lower is better
    metric = "log_perplexity"
    metric_goal = "min"
    quality_exponent = 1.0
    # RMSNorm weights take no weight decay (Megatron/NeMo's default for Llama); there are no biases
    no_decay = ("norm",)
    sim_preset = "llama31-8b"
    hf_checkpoints = True
    # mlperf-logging rcp_checker/training_6.1.0/rcps_llama31_8b.json: batches 16-128 sequences; a
    # wider run splits each sequence inside a replica, as NVIDIA's 512-GPU v5.1 record (TP2 x CP4)
    max_global_batch = 128
    inner_parallelism = "tensor or context parallelism (NVIDIA's v5.1 record: TP2 x CP4 x DP64)"
    reference = Reference(
        "llama31-8b",
        params=float(llama_params(LlamaConfig())),
        flops_per_sample=training_flops_per_sequence(LlamaConfig()),  # one 8,192-token row
        grad_bytes=2,  # bf16 gradients
        # AdamW with fp32 master weights: read p, m, v, g + write p, m, v, bf16 copy ~ 30 B/param
        opt_bytes_per_param=30.0,
        samples_to_converge=345_900,  # the RCP mean at batch 128 (the table's olympic mean)
        eval_samples=1024,
        eval_rule=None,  # every 12,288 sequences: the config's train.eval_every
        notes="Llama 3.1 8B, seq 8192; MLPerf llama31_8b reference (mlcommons/training "
        "small_llm_pretraining), RCPs of mlperf-logging training_6.1.0",
    )

    def params(self, cfg: Any) -> int:
        return llama_params(cfg.model.llama)

    def param_tensors(self, cfg: Any) -> int:
        return llama_param_tensors(cfg.model.llama)

    def flops_per_sample(self, cfg: Any) -> float:
        return training_flops_per_sequence(cfg.model.llama)

    def describe(self, cfg: Any) -> str:
        c = cfg.model.llama
        return f"llama {c.layers}x{c.hidden} gqa {c.heads}/{c.kv_heads}"

    def mlperf_hparams(
        self, cfg: Any, steps_per_epoch: int | None = None, world_size: int = 1
    ) -> dict[str, Any]:
        o = cfg.optim
        # MLPerf's max_steps is the schedule's horizon (the reference's cosine runs over 1.2 M
        # steps; a run stops at the target long before), which optim.total_steps holds
        total = o.total_steps or cfg.train.max_steps
        shape = "cosine with linear warmup" if o.schedule == "cosine" else "polynomial"
        return {
            "opt_name": o.name,
            "opt_base_learning_rate": o.lr,
            "opt_end_learning_rate": o.end_lr,
            "opt_learning_rate_warmup_steps": o.warmup_steps,
            "opt_learning_rate_decay_steps": max(total - o.warmup_steps, 0),
            "opt_learning_rate_decay_schedule": shape,
            "opt_adamw_beta_1": o.betas[0],
            "opt_adamw_beta_2": o.betas[1],
            "opt_adamw_epsilon": o.eps,
            "opt_adamw_weight_decay": o.weight_decay,
            "opt_gradient_clip_norm": o.clip_grad_norm or 0.0,  # 0: not clipped
            "max_sequence_length": cfg.model.llama.seq_len,
            "max_steps": total,
        }

    def build_task(self, cfg: Any, world: World) -> Task:
        from scaleout.families.llama.task import LlamaTask  # deferred: torch-free declaration

        return LlamaTask(cfg, world)


LLAMA = register(LlamaFamily())
