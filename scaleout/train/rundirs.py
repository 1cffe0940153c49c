"""The run directories (``train.output_dir``, ``checkpoint.dir``) before a run writes to them:
one owner (:mod:`scaleout.runlock`), no debris of a killed write, room to resume.

Called twice, as the rerun policy is: by the launcher's preflight (:func:`prepare_run_dirs`, once
per job, before any rank is spawned) and inside the ranks (:func:`agree_owner`, rank 0 only,
before anything is written), which takes the lease itself when no launcher did (``srun`` straight
into ``scaleout train``). Both run only while this job holds the lease, so the debris they remove
cannot be a live writer's.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from scaleout import runlock
from scaleout.checkpoint import Checkpointer
from scaleout.diskfull import DiskFull, check_room, disk_full, is_disk_full
from scaleout.errors import UserError
from scaleout.goodput.verdict import verdict_line
from scaleout.train.liveness import describe_rank
from scaleout.train.rerun import decide_start

if TYPE_CHECKING:
    from scaleout.config.schema import Config
    from scaleout.world import World

# What a killed writer leaves: scaleout.fsutil.atomic_write_path's temporary files
# (<name>.<pid>-<8 hex>.tmp[.suffix]) and the lease's own (runlock: <lock>.<16 hex>.tmp, a stale
# lease moved aside, a clock probe).
DEBRIS = re.compile(
    r"(\.\d+-[0-9a-f]{8}\.tmp(\.\w+)?"
    rf"|^{re.escape(runlock.LOCK_NAME)}\.([0-9a-f]{{16}}\.tmp|stale-[0-9a-f]{{16}})"
    r"|^\.scaleout-clock\.\d+-[0-9a-f]{8})$"
)


def check_output_dir(cfg: Config) -> None:
    """An empty ``train.output_dir`` would scatter the run's files into the current directory."""
    if not cfg.train.output_dir.strip():
        raise UserError(
            f"train.output_dir={cfg.train.output_dir!r}: expected a directory for the run's "
            "metrics, MLPerf log and report (e.g. train.output_dir=runs/bert)"
        )


def remove_debris(cfg: Config) -> list[Path]:
    """Delete the temporary files killed writes left in the run directories (top level only:
    that is where every atomic write of a run puts them). Returns what was removed."""
    gone = []
    for d in runlock.run_dirs(cfg):
        if not d.is_dir():
            continue
        for p in d.iterdir():
            if DEBRIS.search(p.name) and p.is_file():
                p.unlink(missing_ok=True)
                gone.append(p)
    if gone:
        more = f" and {len(gone) - 1} more" if len(gone) > 1 else ""
        print(f"scaleout: removed the temporary file of an interrupted write: {gone[0]}{more}")
    return gone


def check_room_to_resume(cfg: Config) -> None:
    """A resume needs room for one more checkpoint as large as the newest one: refuse, before
    any rank starts, one onto a disk still too full for it (it would train, then fail to save)."""
    ck = cfg.checkpoint
    if not ck.dir or not Path(ck.dir).is_dir():
        return
    if decide_start(cfg).kind != "resume":  # a finished run writes nothing: it needs no room
        return
    found = Checkpointer(ck.dir, ck.keep).list()
    if not found:
        return
    step, newest = found[-1]
    try:
        size = newest.stat().st_size
    except OSError:
        return
    check_room(ck.dir, size, f"one more checkpoint (step {step}'s is that large)", "checkpoint.dir")


def prepare_run_dirs(cfg: Config) -> None:
    """The launcher's preflight: take the run's leases for this process (held until it exits;
    another job's lease: one line naming it), then remove debris and check the room to resume."""
    check_output_dir(cfg)
    try:
        runlock.hold_for_process(cfg)
    except runlock.LeaseUnwritable:
        check_room_to_resume(cfg)  # a disk too full for the lease: say so in a resume's terms
        raise
    remove_debris(cfg)
    check_room_to_resume(cfg)


def agree_owner(cfg: Config, world: World) -> runlock.RunLock | None:
    """Inside the ranks, before anything is written: the lease (see :func:`runlock.agree_owner`),
    then rank 0 removes debris and checks the room to resume (one line on every rank). The lock to
    release at the end when rank 0 took it itself."""
    check_output_dir(cfg)

    def then() -> None:  # rank 0, holding the lease (srun: no launcher preflight ran)
        remove_debris(cfg)
        check_room_to_resume(cfg)

    return runlock.agree_owner(cfg, world, then)


def say_disk_full(world: World, exc: BaseException, where: str) -> DiskFull | None:
    """A rank whose own write found the disk full: the one line to raise instead of ``exc``
    (any writer's ``ENOSPC``: a checkpoint, metrics, the report), printed first as the verdict
    line the launcher reads (scaleout/goodput/verdict.py), so the launcher's last line names this
    rank and the path, not a peer that merely stopped first. ``where``: the directory to name
    when the error does not say which file (a buffered write's flush). None for any other
    error."""
    if isinstance(exc, DiskFull):
        full = exc
    elif is_disk_full(exc):
        path = _full_path(exc)
        full = disk_full(path or where, None, "to")
        full = DiskFull(f"rank {world.rank}: {full}")
    else:
        return None
    text = str(full).splitlines()[0]
    print(verdict_line(describe_rank(world, world.rank), text), file=sys.stderr, flush=True)
    return full


def _full_path(exc: BaseException | None) -> str | None:
    """The file name the ENOSPC in ``exc``'s chain was raised for, when it says."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.filename:
            return str(exc.filename)
        exc = exc.__cause__ or exc.__context__
    return None
