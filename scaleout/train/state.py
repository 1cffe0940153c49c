"""The trainer's checkpoints: what goes in (the replicated state rank 0 writes; with the sharded optimizer
every rank also writes its own pieces) and how a run resumes from the latest one. Exact resume: the data
position is one integer (the data order is a function of it), RNG states are gathered per rank."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from scaleout.checkpoint import gather_rng_states, set_rng_state
from scaleout.log import print0
from scaleout.train.rerun import check_data_position

if TYPE_CHECKING:
    from scaleout.train.loop import Trainer

log = logging.getLogger("scaleout.train")


def checkpoint_state(tr: Trainer, step: int) -> dict[str, Any]:
    """The replicated part of a checkpoint (only rank 0's copy is written; RNG states are gathered to it)."""
    opt_state, _ = tr.sync.optimizer_state(tr.optimizer)
    return {
        "model": tr.task.model.state_dict(),
        "optimizer": opt_state,
        "config": tr.cfg.model_dump(mode="json"),  # self-describing: `scaleout ckpt show/export`
        "schedule": tr.schedule.state_dict(),
        "data_position": step * tr.cfg.train.global_batch,
        "rng": gather_rng_states(tr.world),
        "samples": tr.samples,
        "skipped": tr.skipped,
        "precision": tr.task.precision.state_dict(),
    }


def save_checkpoint(tr: Trainer, step: int) -> None:
    """Collective: every rank takes part (BN statistics, RNG states, sharded pieces), then one barrier."""
    if tr.ckpt is None:
        return
    tr.task.sync_buffers()  # collective: BN statistics equal on every rank, so a resume is exact everywhere
    state = checkpoint_state(tr, step)  # collective: every rank takes part
    _, shards = tr.sync.optimizer_state(tr.optimizer)  # sharded: each rank writes its own
    path = tr.ckpt.save(step, state, world=tr.world, shards=shards)
    if path is not None:
        print0(f"checkpoint: step {step} -> {path}", rank=tr.world.rank)
    tr.world.barrier()


def resume_checkpoint(tr: Trainer) -> int:
    """Load the latest checkpoint (rank 0 chooses; every rank follows); the step to start from (0: none)."""
    cfg = tr.cfg
    if tr.ckpt is None or not cfg.checkpoint.resume:
        return 0
    _, shards = tr.sync.optimizer_state(tr.optimizer)
    found = tr.ckpt.restore(tr.world, shards=shards)
    if found is None:
        return 0
    state, path = found
    check_data_position(state, cfg.train.global_batch, path)  # a changed global batch is refused
    tr.task.model.load_state_dict(state["model"])
    tr.sync.load_optimizer_state(
        tr.optimizer, state["optimizer"]
    )  # shards: read in place by restore()
    tr.schedule.load_state_dict(state["schedule"])
    if state["rng"] is None:
        log.warning("checkpoint %s has RNG states of another world size: RNG streams restart", path)
    else:
        set_rng_state(state["rng"])
    tr.samples, tr.skipped = int(state.get("samples", 0)), int(state.get("skipped", 0))
    tr.task.precision.load_state_dict(state.get("precision", {}))  # the fp16 loss scale
    print0(f"resumed from {path} at step {state['step']}", rank=tr.world.rank)
    return int(state["step"])
