"""The model-family protocol and its registry: :class:`Family`, :data:`FAMILIES`, :func:`register`.

Kept apart from the package's ``__init__`` (which imports the built-in families so that they
register) so that a family imports what it implements from here, and nothing imports in a circle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

from scaleout.section import FAMILIES

if TYPE_CHECKING:
    from scaleout.families.task import Task
    from scaleout.world import World


@dataclass(frozen=True)
class Reference:
    """The family's reference model at scale, as the simulator's preset of the same ``name``
    prices it (``scaleout simulate --model NAME``, scaleout.sim.step.MODELS): torch-free numbers
    from the family's formulas and its MLPerf reference."""

    name: str
    params: float
    flops_per_sample: float  # training FLOPs (forward + backward) per sample
    grad_bytes: int  # bytes per gradient element on the wire
    opt_bytes_per_param: float  # optimizer HBM traffic per parameter per step
    samples_to_converge: float | None
    eval_samples: float
    eval_rule: str | None  # MLPerf's evaluation schedule (scaleout.sim.step.eval_interval)
    notes: str
    # training FLOPs of one sample at full length with every output computed (a packed row as
    # NVIDIA's MLPerf BERT runs it: scaleout.sim.mlperf); None: flops_per_sample
    dense_flops_per_sample: float | None = None


class Family:
    """What scaleout knows about one model family. Subclass it, set the class attributes, implement
    :meth:`build_task` (and the formulas), and register an instance with :func:`register`."""

    name: ClassVar[str]  # the model.arch value; also the key of its config section, model.<name>
    config: ClassVar[type[BaseModel] | None] = None  # the pydantic section model.<name> (or none)
    data_sources: ClassVar[tuple[str, ...]] = ("synthetic",)  # the data.source values it reads
    # MLPerf benchmark name (mlperf_logging's); None: not one
    benchmark: ClassVar[str | None] = None
    metric: ClassVar[str] = "accuracy"  # the evaluation's quality metric (train.target is in it)
    # "max": the target is reached at or above it (accuracy); "min": at or below (log-perplexity)
    metric_goal: ClassVar[str] = "max"
    # HPC-AI500 quality exponent n of Valid FLOPS = FLOPS x (achieved / target)^n (arXiv 2007.00279)
    quality_exponent: ClassVar[float] = 5.0
    # Training samples of the reference data set (an MLPerf epoch), None where epochs count samples
    train_samples: ClassVar[int | None] = None
    # The MLPerf log counts real epochs, as the ResNet reference and NVIDIA write it: 1-based epoch
    # numbers of steps_per_epoch steps, block_start's epoch_count = the epochs until the next
    # evaluation, epoch_start/epoch_stop around every epoch, train_samples = the training set's
    # size. False (BERT): epoch_num = samples, one-epoch blocks, train_samples = samples trained.
    mlperf_epochs: ClassVar[bool] = False
    # Parameters left without weight decay and trust ratio: name patterns (normalisation layers are
    # always excluded by type, scaleout/optim/groups.py)
    no_decay: ClassVar[tuple[str, ...]] = ("bias",)
    # Its matmuls include convolutions (cuDNN's TF32 flag applies: MLPerf's precision keys)
    convolutions: ClassVar[bool] = False
    # Hugging Face checkpoints: model.init_checkpoint reads one, `scaleout ckpt --format hf` writes
    # one
    hf_checkpoints: ClassVar[bool] = False
    # The simulator preset (scaleout.sim.step.MODELS) whose bytes-per-parameter assumptions it
    # shares
    sim_preset: ClassVar[str] = "bert-large"
    # The reference model the simulator's preset ``reference.name`` is (None: it adds no preset)
    reference: ClassVar[Reference | None] = None
    # The largest global batch (samples) a closed MLPerf result may use: its RCP table's largest
    # (a sample is not split between replicas, so also the most data-parallel replicas); None: no
    # ceiling. ``inner_parallelism`` names what a wider run needs inside each replica.
    max_global_batch: ClassVar[int | None] = None
    inner_parallelism: ClassVar[str | None] = None

    # -- torch-free facts
    # ---------------------------------------------------------------------------

    def params(self, cfg: Any) -> int:
        """Trainable parameters of the model ``cfg`` describes."""
        raise NotImplementedError

    def param_tensors(self, cfg: Any) -> int:
        """Parameter tensors (per-tensor optimizer work such as LAMB's norms)."""
        return 1

    def flops_per_sample(self, cfg: Any) -> float:
        """Training FLOPs (forward + backward) of one sample, as ``train.global_batch`` counts
        them."""
        raise NotImplementedError

    def sequences_per_sample(self, cfg: Any) -> float:
        """Evaluation samples per training sample (a packed BERT row holds several sequences)."""
        return 1.0

    def describe(self, cfg: Any) -> str:
        """A short model name for tables (``bert 24x1024``)."""
        return self.name

    def reached(self, value: float, target: float) -> bool:
        """Whether an evaluation's ``value`` reaches ``target`` (in the metric's direction)."""
        return value <= target if self.metric_goal == "min" else value >= target

    def quality_ratio(self, achieved: float, target: float) -> float:
        """achieved / target, > 1 when better than the target, in the metric's direction."""
        return target / achieved if self.metric_goal == "min" else achieved / target

    def epoch_of(self, samples: int, rows: int) -> int:
        """MLPerf's epoch number after ``samples`` samples of a ``rows``-sample training set."""
        return samples // max(rows, 1)

    def check(self, cfg: Any, world_size: int) -> None:
        """Checks that need the world size (Config.check_world); raise ConfigError naming the
        key."""

    def check_input_files(self, cfg: Any) -> None:
        """Sniff the files under path-valued keys this family reads (``model.init_checkpoint``,
        ``data.path``) before anything is written or spawned; raise UserError naming the key."""

    def packing_speedup(self, cfg: Any) -> tuple[float, str]:
        """(samples per packed row of the configured training corpus, the packing algorithm), as
        measured by packing it; (1.0, "none") for a family that does not pack."""
        return 1.0, "none"

    def mlperf_hparams(
        self, cfg: Any, steps_per_epoch: int | None = None, world_size: int = 1
    ) -> dict[str, Any]:
        """The MLPerf hyper-parameter keys of this family (its optimizer's); the common ones are in
        scaleout.train.hparams."""
        return {"opt_name": cfg.optim.name, "opt_base_learning_rate": cfg.optim.lr}

    # -- runtime
    # ------------------------------------------------------------------------------------
    def build_task(self, cfg: Any, world: World) -> Task:
        """The family's :class:`scaleout.families.task.Task` for this rank (imports torch)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<family {self.name}>"


def register(family: Family) -> Family:
    """Register ``family`` under its name in :data:`FAMILIES` (the table in scaleout/section.py the
    config schema reads when it validates: model.arch, the section model.<name>, data.source)."""
    return FAMILIES.register(family.name, family)


def unregister(name: str) -> None:
    FAMILIES.unregister(name)


def data_sources() -> tuple[str, ...]:
    """Every data.source some family reads, in registration order."""
    out: list[str] = []
    for _, fam in FAMILIES.items():
        out += [s for s in fam.data_sources if s not in out]
    return tuple(out)
