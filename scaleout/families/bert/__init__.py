"""BERT pre-training (MLM + NSP), MLPerf's ``bert`` benchmark: the family's torch-free declaration.

Folder: ``config.py`` (``model.bert``), ``flops.py`` (FLOP and parameter formulas), ``model.py``,
``convert.py`` (Hugging Face / NVIDIA checkpoints), ``task.py`` (``BertTask``), ``data/`` (corpus,
tokenizer, pre-training samples, MLPerf shards) and ``packing/`` (sequence packing).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scaleout.families.base import Family, Reference, register
from scaleout.families.bert.config import BertConfig
from scaleout.families.bert.flops import WIKI_512_MEAN_TOKENS, bert_params, sequence_training_flops

if TYPE_CHECKING:
    from scaleout.families.task import Task
    from scaleout.world import World

# NVIDIA's BERT (DeepLearningExamples, run_pretraining.py): no weight decay (and, in FusedLAMB, no
# trust ratio) for every parameter whose name contains one of these.
NVIDIA_BERT_NO_DECAY = ("bias", "gamma", "beta", "LayerNorm")


class BertFamily(Family):
    name = "bert"
    config = BertConfig
    data_sources = ("synthetic", "pydoc", "wikipedia")
    benchmark = "bert"
    metric = "mlm_accuracy"
    # HPC-AI500 gives no n for language models; masked-LM accuracy is a top-1 classification
    # accuracy over the vocabulary on a 0..1 scale, so a shortfall costs what it costs image
    # classification.
    quality_exponent = 5.0
    no_decay = NVIDIA_BERT_NO_DECAY
    hf_checkpoints = True
    sim_preset = "bert-large"
    # MLPerf Training BERT-large phase 2 (NVIDIA v2.0 submission: LAMB, fp16 gradients, packed
    # data).
    reference = Reference(
        "bert-large",
        # the published size: the simulator's MLPerf calibration (scaleout.sim.mlperf) was fitted
        # with it (bert_params(BertConfig()) counts 336.2M with the pre-training heads)
        params=335e6,
        # a Wikipedia-512 sequence of mean length (flops.py)
        flops_per_sample=sequence_training_flops(BertConfig()),
        grad_bytes=2,
        # LAMB with fp32 master weights: read p, m, v, g + write p, m, v, fp16 copy ~ 32 B/param.
        opt_bytes_per_param=32.0,
        # NVIDIA v2.0, 512 nodes: median train_samples of the 10 runs at the target (337.7 steps of
        # 16384; MAX_STEPS=470 only sets the LR schedule), result_*.txt of scaleout.sim.mlperf's
        # reference (c).
        samples_to_converge=5533303,
        eval_samples=10000,  # MLPerf BERT eval set
        eval_rule="mlperf-bert",  # EVAL_ITER_SAMPLES, a function of the batch: eval_interval
        notes=(
            "BERT-large 24x1024, 335M params; MLPerf v2.0 NVIDIA config_DGXA100_512x8x2x1_pack.sh"
        ),
        # a packed row of 512 token slots, every slot and the MLM head computed (NVIDIA's
        # PACKING_FACTOR=2 + --pad_fmha, no --dense_seq_output)
        dense_flops_per_sample=sequence_training_flops(
            BertConfig(), tokens=512, masked_fraction=1.0
        ),
    )

    def params(self, cfg: Any) -> int:
        return bert_params(cfg.model.bert)

    def param_tensors(self, cfg: Any) -> int:
        return 14 + 12 * cfg.model.bert.layers  # as model.py registers them (302 at 24 layers)

    def _packed(self, cfg: Any) -> bool:
        d = cfg.data
        return d.packing != "none" and d.source == "wikipedia" and d.max_seq_len == 512

    def sequences_per_sample(self, cfg: Any) -> float:
        """A packed row is taken as full of Wikipedia-512's mean sequence (2.0013 per row)."""
        return cfg.data.max_seq_len / WIKI_512_MEAN_TOKENS if self._packed(cfg) else 1.0

    def flops_per_sample(self, cfg: Any) -> float:
        """With ``data.packing`` on Wikipedia-512 a packed row of mean-length sequences
        (variable-length attention per sequence); otherwise one sequence padded to
        ``data.max_seq_len`` (an upper bound). The MLM head runs on ``data.mask_prob`` of the
        tokens with ``unpad_mlm_head``, else on all."""
        b, d = cfg.model.bert, cfg.data
        tokens = WIKI_512_MEAN_TOKENS if self._packed(cfg) else float(d.max_seq_len)
        masked = d.mask_prob if b.unpad_mlm_head else 1.0
        return sequence_training_flops(b, tokens, masked) * self.sequences_per_sample(cfg)

    def describe(self, cfg: Any) -> str:
        return f"bert {cfg.model.bert.layers}x{cfg.model.bert.hidden}"

    def epoch_of(self, samples: int, rows: int) -> int:
        # MLPerf BERT counts "epochs" in samples (the reference logs samples as epoch_num)
        return samples

    def check_input_files(self, cfg: Any) -> None:
        from scaleout.families.bert.inputs import check_input_files  # deferred: torch, numpy

        check_input_files(cfg)

    def packing_speedup(self, cfg: Any) -> tuple[float, str]:
        """Sequences per packed row of the training corpus at the config's settings (the packed
        recipes' algorithm; lpfhp when ``data.packing`` is none)."""
        from scaleout.families.bert.packing.speedup import corpus_speedup  # deferred: reads data

        return corpus_speedup(cfg)

    def mlperf_hparams(
        self, cfg: Any, steps_per_epoch: int | None = None, world_size: int = 1
    ) -> dict[str, Any]:
        o = cfg.optim
        return {
            "opt_name": o.name,
            "opt_base_learning_rate": o.lr,
            "opt_lamb_epsilon": o.eps,
            "opt_lamb_beta_1": o.betas[0],
            "opt_lamb_beta_2": o.betas[1],
            "opt_lamb_weight_decay_rate": o.weight_decay,
            "opt_learning_rate_warmup_steps": o.warmup_steps,
            "opt_learning_rate_training_steps": o.total_steps or cfg.train.max_steps,
            "num_warmup_steps": o.warmup_steps,
            "start_warmup_step": o.start_warmup_step,
            "max_sequence_length": cfg.data.max_seq_len,
        }

    def build_task(self, cfg: Any, world: World) -> Task:
        from scaleout.families.bert.task import BertTask  # deferred: torch-free declaration

        return BertTask(cfg, world)


BERT = register(BertFamily())
