"""Model families: the extension point of what is trained (``model.arch``).

A family is one folder, ``scaleout/families/<name>/``, whose ``__init__.py`` registers a
:class:`Family` in :data:`FAMILIES`. What the config schema, the simulator, the report and the
MLPerf log read from a family is torch-free (its name, config section, FLOP and parameter formulas,
benchmark and metric names, checks): importing this package never imports torch. The runtime (model,
data, the task) is imported when :meth:`Family.build_task` runs, inside a rank. See
docs/extending.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

from scaleout.section import FAMILIES

if TYPE_CHECKING:
    from scaleout.families.task import Task
    from scaleout.world import World


class Family:
    """What scaleout knows about one model family. Subclass it, set the class attributes, implement
    :meth:`build_task` (and the formulas), and register an instance with :func:`register`."""

    name: ClassVar[str]  # the model.arch value; also the key of its config section, model.<name>
    config: ClassVar[type[BaseModel] | None] = None  # the pydantic section model.<name> (or none)
    data_sources: ClassVar[tuple[str, ...]] = ("synthetic",)  # the data.source values it reads
    benchmark: ClassVar[str | None] = (
        None  # MLPerf benchmark name (mlperf_logging's); None: not one
    )
    metric: ClassVar[str] = "accuracy"  # the evaluation's quality metric (train.target is in it)
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

    def epoch_of(self, samples: int, rows: int) -> int:
        """MLPerf's epoch number after ``samples`` samples of a ``rows``-sample training set."""
        return samples // max(rows, 1)

    def check(self, cfg: Any, world_size: int) -> None:
        """Checks that need the world size (Config.check_world); raise ConfigError naming the
        key."""

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


# The built-in families register themselves (torch-free declarations).
from scaleout.families import bert as _bert  # noqa: E402,F401
from scaleout.families import resnet as _resnet  # noqa: E402,F401
