"""One owner per run directory: a lease file that one job at a time holds.

A run's ``train.output_dir`` and ``checkpoint.dir`` each get ``.scaleout-owner.json`` naming the
job that holds them (host, pid, job id, since when). Two launches on one directory would mix their
checkpoints and lose one ``report.json``: the second stops in one line naming the holder, before
anything is written.

Why a lease and not ``fcntl``/``flock``: POSIX locks on NFS go through lockd/NLM (often disabled,
and a lock held by a client that died is only reclaimed by the server's grace logic), flock on NFS
is emulated on top of them or local only, and Lustre needs ``-o flock`` on every client. A file
created with ``link(2)`` (atomic on NFS, Lustre and GPFS: the classic ``lockfile`` idiom) whose
mtime the holder renews works on every one of them and cannot stay stuck: a holder that stops
renewing (killed, its node gone) is stale after :data:`LEASE_S`, and at once when it ran on this
host and its pid is gone. Age is measured against the file system's clock (the mtime of a file
created now in the same directory), so clocks that differ between nodes do not matter.

Who takes it: the launcher, once per job (``scaleout launch``'s preflight: one process, not 2,048
ranks), and renews it from a thread until it exits. A rank never fights its own launcher: rank 0
checks the lease before anything is written (:func:`agree_owner`) and accepts one held by an
ancestor process or by its own Slurm job; where no launcher took it (``srun`` straight into
``scaleout train``, torchrun) rank 0 takes it itself. The same Slurm job id takes a lease over (a
requeue, spares of the same allocation), and so does the same process (a launcher that restarts
its ranks).
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scaleout import forksafe
from scaleout.errors import UserError

LOCK_NAME = ".scaleout-owner.json"
# Seconds without a renewal after which a holder on another host is taken as gone. Longer than
# NFS's longest attribute cache (acregmax 60 s) so a renewal is visible before anyone judges it
# stale; a requeue of the same job does not wait for it (same job id).
LEASE_S = 120.0
RENEW_EVERY = 4  # renewals per lease: three can be missed (a stalled NFS server) before it lapses


class RunDirBusy(UserError):
    """A run directory that another live job holds."""


class LeaseUnwritable(UserError):
    """A run directory where the lease cannot be written (not a directory, read-only, full)."""


@dataclass(frozen=True)
class Owner:
    """Who holds a lease: ``job`` decides a takeover (the same Slurm job: a requeue or a spare)."""

    job: str
    host: str
    pid: int
    token: str

    @classmethod
    def here(cls) -> Owner:
        host, pid = socket.gethostname(), os.getpid()
        job = os.environ.get("SLURM_JOB_ID")
        ident = f"slurm:{job}" if job else f"local:{host}:{pid}"
        return cls(ident, host, pid, secrets.token_hex(8))

    def record(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "host": self.host,
            "pid": self.pid,
            "token": self.token,
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "lease_s": LEASE_S,
        }


def run_dirs(cfg: Any) -> list[Path]:
    """The directories a run writes and must own: train.output_dir and checkpoint.dir (once if
    they are the same)."""
    dirs = [Path(cfg.train.output_dir)]
    if cfg.checkpoint.dir:
        dirs.append(Path(cfg.checkpoint.dir))
    out: list[Path] = []
    for d in dirs:
        if d.resolve() not in {o.resolve() for o in out}:
            out.append(d)
    return out


def fs_now(directory: Path) -> float:
    """The file system's clock: the mtime of a file made now in ``directory`` (this host's clock
    when nothing can be created there, e.g. a full disk with no inode left)."""
    probe = directory / f".scaleout-clock.{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except OSError:
        return time.time()
    try:
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


def read_holder(lock: Path) -> tuple[dict[str, Any], float] | None:
    """(the holder's record, its lease's mtime), or None when there is no lease. An unreadable or
    half-written record (a holder killed while writing: it never links one, but a user's editor
    might) counts as a holder with no identity."""
    try:
        mtime = lock.stat().st_mtime
        text = lock.read_text(errors="replace")
    except FileNotFoundError:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        record = {}
    return (record if isinstance(record, dict) else {}), mtime


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def ancestors() -> set[int]:
    """This process's ancestors' pids (Linux /proc; empty elsewhere)."""
    out, pid = set(), os.getppid()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


def is_ours(holder: dict[str, Any], me: Owner) -> bool:
    """The same job (a requeue, a spare, a restart) or, on this host, the launcher above us."""
    if holder.get("job") == me.job or holder.get("token") == me.token:
        return True
    return holder.get("host") == me.host and holder.get("pid") in ancestors() | {me.pid}


def stale_why(holder: dict[str, Any], mtime: float, now: float) -> str | None:
    """Why a lease no longer holds (its holder is gone), or None while it does."""
    age = now - mtime
    lease = float(holder.get("lease_s") or LEASE_S)
    if age > lease:
        return f"not renewed for {age:.0f} s (lease {lease:.0f} s)"
    pid = holder.get("pid")
    if holder.get("host") == socket.gethostname() and isinstance(pid, int) and not _pid_alive(pid):
        return f"its process {pid} on this host is gone"
    return None


def describe(directory: Path, holder: dict[str, Any], mtime: float, now: float) -> str:
    who = (
        f"job {holder.get('job', '?')} (host {holder.get('host', '?')}, pid "
        f"{holder.get('pid', '?')}, since {holder.get('since', '?')}, renewed "
        f"{now - mtime:.0f} s ago)"
    )
    lease = float(holder.get("lease_s") or LEASE_S)
    return (
        f"{directory} is in use by {who}: one job per run directory; wait for it to end, or use "
        f"another directory (a job that died frees it {lease:.0f} s after its last renewal; "
        f"{directory / LOCK_NAME} names the holder)"
    )


def _write_new(lock: Path, record: dict[str, Any]) -> bool:
    """Create ``lock`` holding ``record`` if it does not exist: write a private file, then
    ``link`` it to the lock's name (atomic and exclusive, on NFS too). True when created."""
    tmp = lock.with_name(f"{lock.name}.{record['token']}.tmp")
    tmp.write_text(json.dumps(record) + "\n")
    try:
        os.link(tmp, lock)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def _replace(lock: Path, record: dict[str, Any]) -> None:
    tmp = lock.with_name(f"{lock.name}.{record['token']}.tmp")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, lock)


def acquire_one(directory: Path, me: Owner) -> None:
    """Hold ``directory`` for ``me`` or raise :class:`RunDirBusy` naming its holder. Creates the
    directory (and nothing else in it) when missing."""
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / LOCK_NAME
    record = me.record()
    for _ in range(3):  # a stale lease broken by someone else in between: look again
        if _write_new(lock, record):
            return
        found = read_holder(lock)
        if found is None:
            continue
        holder, mtime = found
        if is_ours(holder, me):
            _replace(lock, record)
            return
        now = fs_now(directory)
        why = stale_why(holder, mtime, now)
        if why is None:
            raise RunDirBusy(describe(directory, holder, mtime, now))
        # Break it by renaming (one breaker wins the rename of this very file), then check that
        # what was moved is the lease judged stale and not a fresh one created in between.
        moved = lock.with_name(f"{lock.name}.stale-{me.token}")
        try:
            os.rename(lock, moved)
        except FileNotFoundError:
            continue
        again = read_holder(moved)
        if again is not None and again[0].get("token") != holder.get("token"):
            os.rename(moved, lock)  # a live lease: put it back and look again
            continue
        moved.unlink(missing_ok=True)
        print(f"scaleout: taking over {directory}: the previous holder's lease is stale ({why})")
    raise RunDirBusy(f"{directory}: could not take {LOCK_NAME} (another job keeps taking it)")


class RunLock:
    """The leases of one run's directories, renewed by a daemon thread until :meth:`release`."""

    def __init__(self, dirs: list[Path], me: Owner | None = None):
        self.dirs, self.me = dirs, me or Owner.here()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # folders the lease created (leaf first): removed again at release if nothing else came
        # in (a launch refused after its lease was taken leaves no empty run directory behind)
        self._made: list[Path] = []

    def acquire(self) -> RunLock:
        done: list[Path] = []
        try:
            for d in self.dirs:
                missing = [p for p in (d, *d.parents) if not p.exists()]
                try:
                    acquire_one(d, self.me)
                except OSError as exc:
                    raise LeaseUnwritable(
                        f"{d}: cannot write the run's lease {LOCK_NAME} there "
                        f"({exc.strerror or exc}); expected a writable directory"
                    ) from None
                done.append(d)
                self._made += missing
        except BaseException:
            self._release(done)
            raise
        self._thread = threading.Thread(target=self._renew, name="scaleout-runlock", daemon=True)
        self._thread.start()
        return self

    def _renew(self) -> None:
        forksafe.park()  # a launcher may fork its ranks while this thread waits
        try:
            self._renew_loop()
        finally:
            forksafe.unpark()

    def _renew_loop(self) -> None:
        warned: set[Path] = set()
        while not self._stop.wait(LEASE_S / RENEW_EVERY):
            with forksafe.busy():
                self._renew_once(warned)

    def _renew_once(self, warned: set[Path]) -> None:
        for d in self.dirs:
            lock = d / LOCK_NAME
            found = read_holder(lock)
            if found is None or found[0].get("token") != self.me.token:
                if d not in warned:
                    warned.add(d)
                    print(f"scaleout: warning: lost the lease on {d} (another job took it)")
                continue
            try:
                os.utime(lock)  # no times given: the server's clock on NFS
            except OSError:
                pass  # a stalled mount: the next renewal tries again

    def _release(self, dirs: list[Path]) -> None:
        for d in dirs:
            lock = d / LOCK_NAME
            found = read_holder(lock)
            if found is not None and found[0].get("token") == self.me.token:
                lock.unlink(missing_ok=True)
        for p in self._made:
            try:
                p.rmdir()  # only when empty
            except OSError:
                pass

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._release(self.dirs)


_held: dict[tuple[str, ...], RunLock] = {}


def hold_for_process(cfg: Any) -> RunLock:
    """Take the run's leases for this process's lifetime (a launcher's preflight): released at
    exit; a second call for the same directories in the same process is a no-op."""
    dirs = run_dirs(cfg)
    key = tuple(str(d.resolve()) for d in dirs)
    if key in _held:
        return _held[key]
    lock = RunLock(dirs).acquire()
    _held[key] = lock
    atexit.register(lock.release)
    return lock


def held_by_us(cfg: Any, me: Owner | None = None) -> bool:
    """Whether every run directory's lease is held by our launcher or our job (nothing to take)."""
    me = me or Owner.here()
    for d in run_dirs(cfg):
        found = read_holder(d / LOCK_NAME)
        if found is None or not is_ours(found[0], me):
            return False
        if stale_why(found[0], found[1], fs_now(d)) is not None:
            return False
    return True


def agree_owner(cfg: Any, world: Any, then: Callable[[], None] | None = None) -> RunLock | None:
    """Inside the ranks, before anything is written: rank 0 checks the run directories' leases.
    Held by our launcher or our job: nothing to do (None). Free or stale: rank 0 takes them for
    this process (no launcher took them: srun, torchrun) and returns the lock to release at the
    end. Then rank 0 runs ``then`` (what needs the lease: removing debris, checking room). Held by
    another job, or a :class:`UserError` of ``then``: every rank raises the same one line."""
    lock: RunLock | None = None
    error = ""
    if world.rank == 0:
        try:
            if not held_by_us(cfg):
                lock = RunLock(run_dirs(cfg)).acquire()
            if then is not None:
                then()
        except UserError as exc:  # busy, unwritable, no room: the peers must not wait on rank 0
            error = str(exc)
        except OSError as exc:
            error = f"cannot read the run directories' lease ({LOCK_NAME}): {exc}"
        if error and lock is not None:
            lock.release()
    if world.world_size > 1:
        import torch.distributed as dist

        box = [error]
        dist.broadcast_object_list(box, src=0, group=getattr(world, "cpu_group", None))
        error = box[0]
    if error:
        raise UserError(error)
    return lock


def release_held() -> None:
    """Give back what :func:`hold_for_process` took: for a preflight whose ranks are not this
    process's children (``scaleout submit``: the queued job's rank 0 takes the lease itself, under
    its own Slurm job id, when it starts)."""
    for lock in _held.values():
        lock.release()
    _held.clear()
