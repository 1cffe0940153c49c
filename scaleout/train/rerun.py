"""What a `scaleout train` does when its checkpoint directory already holds a run (the rerun
policy).

A checkpoint directory belongs to one run. ``run.json`` beside the checkpoints records it: an id,
the global batch its data positions were counted in, and how the latest segment ended. Before
anything is spawned or written (launcher preflight, then every rank before ``init``):

=====================================================
==================================================
directory holds                                        outcome
=====================================================
==================================================
no checkpoint                                          a new run (new id)
checkpoints, ``checkpoint.resume=false``               one-line error, exit 2: nothing is
overwritten
checkpoints, run finished (target reached, or latest   one line "already finished", exit 0, nothing
is
checkpoint at or past ``train.max_steps``)             written (a requeue of a finished job is a
no-op)
checkpoints, run.json's global batch differs           one-line error, exit 2 (the saved data
position
                                                       would replay or skip samples)
checkpoints otherwise                                  the run continues from its latest checkpoint;
the
                                                       previous segment's MLPerf log and report are
                                                       kept
                                                       (``mlperf.log.1``, ``report.json.1``, ...)
=====================================================
==================================================
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch.distributed as dist

from scaleout.checkpoint import Checkpointer
from scaleout.config.schema import Config
from scaleout.errors import UserError, excerpt
from scaleout.fsutil import atomic_write
from scaleout.train.observe import RunStatus

if TYPE_CHECKING:
    from scaleout.world import World

RECORD = "run.json"
FINISHED = ("success", "max_steps")


# "new": no checkpoint; "resume": continue from the latest; "finished": a finished run, nothing to
# do.
StartKind = Literal["new", "resume", "finished"]


@dataclass(frozen=True)
class RunStart:
    kind: StartKind
    latest_step: int  # of the newest checkpoint file (0 when none)
    record: dict[str, Any]  # run.json's content ({} when none)
    message: str = ""


def read_record(ckpt_dir: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(ckpt_dir) / RECORD
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise UserError(
            f"{path}: unreadable run record ({exc}); move it away to resume without it"
        ) from exc
    if not isinstance(record, dict):  # valid JSON, not a record: `null`, a list, a number
        raise UserError(
            f"{path}: a run record holds a JSON object, this one {excerpt(record)}; move it away "
            "to resume without it"
        )
    return record


def write_record(ckpt_dir: str | os.PathLike[str], record: dict[str, Any]) -> None:
    """Atomically (tmp + rename) replace run.json (rank 0 only)."""
    path = Path(ckpt_dir) / RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, (json.dumps(record, indent=2) + "\n").encode())


def agree_start(cfg: Config, world: World) -> RunStart:
    """:func:`decide_start` on rank 0, the same outcome on every rank (broadcast after init, as
    ``Checkpointer.restore`` reads the checkpoint): a rank whose view of ``checkpoint.dir`` lags
    (NFS attribute caching after a requeue) must not exit "finished", or refuse, while the others
    wait in a collective until ``train.init_timeout_s``. A refusal is raised on every rank."""
    if world.world_size == 1:
        return decide_start(cfg)
    box: list[Any] = [None]
    if world.rank == 0:
        try:
            box[0] = decide_start(cfg)
        except UserError as exc:
            box[0] = str(exc)
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise UserError(box[0])
    return box[0]


def decide_start(cfg: Config) -> RunStart:
    """Classify this start (see the module docstring); raise UserError for a start that would
    lose data."""
    ck = cfg.checkpoint
    if not ck.dir:
        return RunStart("new", 0, {})
    steps = [s for s, _ in Checkpointer(ck.dir, ck.keep).list()]
    if not steps:
        return RunStart("new", 0, {})
    latest, record = steps[-1], read_record(ck.dir)
    if not ck.resume:
        raise UserError(
            f"checkpoint.dir={ck.dir} already holds checkpoints up to step {latest} and "
            "checkpoint.resume=false: "
            "a new run would mix its checkpoints with them; resume it (checkpoint.resume=true), "
            "use an empty "
            "checkpoint.dir, or move the old files away"
        )
    status = record.get("status")
    if status == "success" or latest >= cfg.train.max_steps:
        why = (
            "reached its target"
            if status == "success"
            else f"reached train.max_steps={cfg.train.max_steps}"
        )
        return RunStart(
            "finished",
            latest,
            record,
            f"the run in checkpoint.dir={ck.dir} already finished (it {why}; latest checkpoint "
            f"step {latest}): "
            "nothing to do. To train further raise train.max_steps; for a new run use another "
            "checkpoint.dir",
        )
    batch = record.get("global_batch")
    if batch is not None and batch != cfg.train.global_batch:
        raise UserError(
            f"train.global_batch={cfg.train.global_batch} but the run in checkpoint.dir={ck.dir} "
            "counted its "
            f"data position in batches of {batch}: resuming would replay or skip samples; resume "
            "with "
            f"train.global_batch={batch} or start a new run in another checkpoint.dir"
        )
    return RunStart("resume", latest, record)


def record_start(cfg: Config, start: RunStart, world_size: int) -> dict[str, Any]:
    """Record (rank 0) that this run or segment started; returns the record (with the run id)."""
    record = dict(start.record) if start.kind == "resume" else {}
    if start.kind == "new" and cfg.checkpoint.dir:
        # `scaleout slurm run`'s attempt history outlives a restart that had no checkpoint yet:
        # the crash-loop guard counts the attempts that died before the first one too.
        attempts = read_record(cfg.checkpoint.dir).get("attempts")
        if attempts:
            record["attempts"] = attempts
    record.setdefault("run_id", uuid.uuid4().hex[:12])
    record.update(
        global_batch=cfg.train.global_batch,
        world_size=world_size,
        status="running",
        segments=int(record.get("segments", 0)) + 1,
        started_unix=time.time(),
    )
    if cfg.checkpoint.dir:
        write_record(cfg.checkpoint.dir, record)
    return record


def record_end(cfg: Config, record: dict[str, Any], status: RunStatus, step: int) -> None:
    """Record (rank 0) how this segment ended: a rerun of a finished run is then refused by
    ``decide_start``."""
    if cfg.checkpoint.dir:
        write_record(
            cfg.checkpoint.dir,
            {**record, "status": status, "step": step, "ended_unix": time.time()},
        )


def set_aside_earlier(path: Path) -> Path | None:
    """Rename an earlier run's or segment's output file to the first free ``<name>.<k>`` (k = 1,
    2, ...) so that nothing this run writes replaces it. Returns the new path, or None if there
    was no file."""
    if not path.exists():
        return None
    k = 1
    while path.with_name(f"{path.name}.{k}").exists():
        k += 1
    target = path.with_name(f"{path.name}.{k}")
    os.replace(path, target)
    return target


def check_data_position(state: dict[str, Any], global_batch: int, path: Any) -> None:
    """The loop reads the data at ``step * train.global_batch``; a checkpoint whose saved
    position differs was written with another global batch. Refuse (rather than silently replay
    or skip samples)."""
    pos, step = state.get("data_position"), int(state.get("step", 0))
    if pos is not None and int(pos) != step * global_batch:
        raise UserError(
            f"checkpoint {path} is at step {step} with data position {pos} (global batch "
            f"{int(pos) // max(step, 1)}), "
            f"but train.global_batch={global_batch}: resuming would replay or skip samples; resume "
            "with the "
            "checkpoint's global batch or start a new run in another checkpoint.dir"
        )
