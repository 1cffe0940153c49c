"""How a batch script's step fits the allocation it got: ``sbatch -N k slurm/<x>.sh`` alone runs
on k nodes.

The node count comes from the allocation (SLURM_JOB_NODELIST, as SLURM_JOB_NUM_NODES counts it)
minus ``launch.spares``; ranks per node from SLURM_TASKS_PER_NODE. ``launch.nnodes`` given on
the command line still wins (the allocation's other nodes are then the spares). The step gets
``launch.nnodes``/``launch.nproc_per_node`` of the shape it runs on.

A recipe's schedule (steps, warm-up, learning rate, evaluation cadence) belongs to its global
batch (MLCommons' reference convergence points are per global batch: mlperf-logging's
``rcp_checker/training_*/rcps_<benchmark>.json``). So when the step's GPU count differs from the
recipe's, the batch per GPU would change the global batch, and the job refuses in one line
before anything starts unless the command line gives the global batch and its schedule
(:data:`SCHEDULE_KEYS`; ``scaleout plan`` prints them). Keeping the recipe's global batch on
another GPU count keeps its schedule and runs.

Torch-free: the supervisor runs this on the batch host before the first srun.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scaleout.errors import UserError

if TYPE_CHECKING:
    from scaleout.config.schema import Config

# What follows the global batch in a recipe: given together with train.global_batch.
SCHEDULE_KEYS = ("optim.lr", "optim.warmup_steps", "optim.total_steps", "train.max_steps")


def given_keys(overrides: Sequence[str]) -> set[str]:
    """The keys a command line sets (``a.b=c`` -> ``a.b``)."""
    return {o.split("=", 1)[0] for o in overrides if "=" in o}


@dataclass(frozen=True)
class Shape:
    nnodes: int  # nodes the step runs on
    tasks_per_node: int
    overrides: list[str]  # appended to the step's command

    @property
    def world(self) -> int:
        return self.nnodes * self.tasks_per_node


def fit(
    config: str,
    overrides: Sequence[str],
    cfg: Config,
    recipe: Config,
    alloc: Sequence[str],
    tasks_per_node: int,
) -> Shape:
    """The step's shape on the nodes ``alloc`` x ``tasks_per_node``. ``cfg``: the
    config with the command line's overrides, ``recipe``: the file alone. UserError (one line)
    when the allocation cannot run it."""
    given = given_keys(overrides)
    launch, alloc_nodes = cfg.launch, len(alloc)
    if "launch.nnodes" in given:
        nnodes = launch.nnodes
        if nnodes > alloc_nodes:
            raise UserError(
                f"launch.nnodes={nnodes} but the allocation has {alloc_nodes} nodes "
                f"({','.join(alloc)}): expected launch.nnodes <= the sbatch -N (the rest are "
                "spares)"
            )
        if "launch.spares" in given and nnodes + launch.spares != alloc_nodes:
            raise UserError(
                f"launch.nnodes={nnodes} + launch.spares={launch.spares} != the allocation's "
                f"{alloc_nodes} nodes: expected one of the two (the other follows from sbatch -N)"
            )
    else:
        nnodes = alloc_nodes - launch.spares
        if nnodes < 1:
            raise UserError(
                f"launch.spares={launch.spares} leaves no node of the allocation's {alloc_nodes}: "
                f"expected sbatch -N > launch.spares"
            )
    shape_keys = [f"launch.nnodes={nnodes}", f"launch.nproc_per_node={tasks_per_node}"]
    shape = Shape(nnodes, tasks_per_node, [k for k in shape_keys if k.split("=")[0] not in given])
    r_launch, r_batch = recipe.launch, recipe.train.global_batch
    r_world = r_launch.nnodes * r_launch.nproc_per_node
    batch = cfg.train.global_batch
    if shape.world == r_world or ("train.global_batch" in given and batch == r_batch):
        return shape  # the recipe's global batch: its schedule holds
    recipe_shape = f"{r_launch.nnodes}x{r_launch.nproc_per_node}"
    if "train.global_batch" not in given:
        per_gpu = r_batch / r_world
        raise UserError(
            f"{config}: its schedule is for {recipe_shape} GPUs at train.global_batch={r_batch}; "
            f"this step has {nnodes}x{tasks_per_node}: expected train.global_batch="
            f"{round(per_gpu * shape.world)} ({per_gpu:g} per GPU) with its "
            f"{', '.join(SCHEDULE_KEYS)} (`scaleout plan` prints them), "
            f"train.global_batch={r_batch} (the recipe's schedule), or sbatch -N "
            f"{r_launch.nnodes + launch.spares}"
        )
    missing = [k for k in SCHEDULE_KEYS if k not in given]
    if missing:
        raise UserError(
            f"train.global_batch={batch} is not {config}'s {r_batch} but {', '.join(missing)} "
            f"keep its schedule: expected them too (the schedule follows the global batch; "
            "`scaleout plan` prints one)"
        )
    return shape
