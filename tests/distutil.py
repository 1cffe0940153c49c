"""Run a function on N real processes as M emulated nodes (gloo), the way ``scaleout launch`` would.

results = run_dist(fn, nnodes=2, nproc_per_node=2, args=(...,))   # list indexed by rank

``fn(world, *args, **kwargs)`` must be a module-level function (pickled by reference into spawned
processes); its return value must be picklable. Each process gets the variables ``scaleout launch``
sets and calls ``scaleout.init()`` once.

Processes come from a fork server that imported torch and scaleout once per pytest process
(multiprocessing's "forkserver", preloaded): a fresh interpreter per rank paid ~3 s of CPU for that
import, ~6 s of the 2 cores for a 4-rank pool. The processes of a (nnodes, nproc_per_node, env)
shape are also kept as a pool for the whole pytest session and reused by every call (up to
``MAX_POOLED_PROCS`` processes, the least recently used pool closed first); ``fresh=True`` spawns a
one-off set instead (for tests of init itself). A pool process exits when the pytest process that
made it dies without cleaning up (killed by the OOM killer or a signal). A failure on any rank
raises AssertionError with that rank's traceback and discards the pool (its other ranks may be
stuck in a collective); a call that runs past ``timeout`` seconds does the same.
"""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing as mp
import os
import queue as queue_mod
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _start_time(pid: int) -> str | None:
    """The process's start time (/proc/<pid>/stat, field 22); None once it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def _exit_with(parent: int, started: str | None) -> None:
    """A pool process outlives a parent killed without its atexit (the OOM killer, SIGKILL,
    SIGTERM): it would wait on its task queue forever, holding its ~0.5 GB, and every such orphan
    makes the next OOM kill likelier. It exits once that process is gone (dead, a zombie, or its pid
    taken by another process). Not its own parent: that is the fork server, which every process it
    forked keeps alive."""
    while _start_time(parent) == started:
        time.sleep(1.0)
    os._exit(1)


# What the fork server imports once, before it forks any rank: torch (~3 s of CPU) and the scaleout
# modules every pooled function reaches. Importing does not start a thread that fork would lose
# (numpy's OpenBLAS pool stops and restarts itself around fork).
PRELOAD = ["torch", "torch.distributed", "scaleout", "scaleout.world", "scaleout.comm"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _worker(rank, env, tasks, results, parent, started) -> None:
    faulthandler.enable()  # a crash (SIGABRT, SIGSEGV) prints this rank's Python stacks
    threading.Thread(target=_exit_with, args=(parent, started), daemon=True).start()
    os.environ.update(env)
    world = None
    try:
        import torch

        torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
        import scaleout

        world = scaleout.init()
        results.put((rank, "ready", None))
    except BaseException:  # noqa: BLE001 -- report everything to the parent
        results.put((rank, "err", traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, "ok", fn(world, *args, **kwargs)))
        except BaseException:  # noqa: BLE001
            results.put((rank, "err", traceback.format_exc()))
    try:
        world.close()
    except Exception:  # noqa: BLE001
        pass


class DistPool:
    def __init__(
        self,
        nnodes: int,
        nproc_per_node: int,
        env: dict[str, str] | None = None,
        timeout: float = 120.0,
        placement: str = "block",
    ):
        from scaleout.env import free_port
        from scaleout.launchers.local import rank_env

        ctx = _context()
        self.world = nnodes * nproc_per_node
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(self.world)]
        port = free_port()
        self.procs = []
        me = os.getpid()
        for rank in range(self.world):
            e = rank_env({}, rank, nnodes, nproc_per_node, "127.0.0.1", port)
            if (
                placement == "cyclic"
            ):  # as srun --distribution=cyclic / mpirun --map-by node: rank r on node r % M
                node, local = rank % nnodes, rank // nnodes
                e.update(
                    SCALEOUT_NODE_RANK=str(node),
                    SCALEOUT_LOCAL_RANK=str(local),
                    GROUP_RANK=str(node),
                    LOCAL_RANK=str(local),
                )
            e["OMP_NUM_THREADS"] = "1"
            e.update(env or {})
            p = ctx.Process(
                target=_worker,
                args=(rank, e, self.tasks[rank], self.results, me, _start_time(me)),
                daemon=True,
            )
            p.start()
            self.procs.append(p)
        self._collect("ready", timeout)

    def _collect(self, what: str, timeout: float) -> list[Any]:
        got: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(got) + len(errors) < self.world and not errors:
            try:  # a rank that dies without a word (a crash, os._exit) ends the wait at once
                rank, status, value = self.results.get(timeout=min(1.0, timeout))
            except queue_mod.Empty:
                missing = sorted(set(range(self.world)) - set(got))
                dead = {r: self.procs[r].exitcode for r in missing if not self.procs[r].is_alive()}
                if not dead and time.monotonic() < deadline:
                    continue
                self.close(force=True)
                if dead:
                    raise AssertionError(
                        f"ranks {sorted(dead)} died during {what} (exit codes {dead})"
                    ) from None
                raise AssertionError(
                    f"ranks {missing} did not finish ({what}) within {timeout:.0f} s"
                ) from None
            if status == "err":
                errors[rank] = value
            else:
                got[rank] = value
        if errors:
            self.close(force=True)
            rank = min(errors)
            raise AssertionError(f"rank {rank} failed:\n{errors[rank]}")
        return [got[r] for r in range(self.world)]

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        for q in self.tasks:
            q.put((fn, args, kwargs))
        return self._collect(getattr(fn, "__name__", "task"), timeout)

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=5)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()


_POOLS: dict[tuple, DistPool] = {}


def run_dist(
    fn: Callable[..., Any],
    nnodes: int = 1,
    nproc_per_node: int = 2,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    fresh: bool = False,
    placement: str = "block",
) -> list[Any]:
    """Run ``fn(world, *args, **kwargs)`` on every rank; return the results indexed by rank.
    ``placement="cyclic"`` puts rank r on node r % nnodes (block: node r // nproc_per_node)."""
    key = (nnodes, nproc_per_node, tuple(sorted((env or {}).items())), placement)
    if fresh:
        pool = DistPool(nnodes, nproc_per_node, env, timeout, placement)
        try:
            return pool.run(fn, args, kwargs or {}, timeout)
        finally:
            pool.close(force=not pool.alive)
    pool = _POOLS.pop(key, None)  # re-inserted last: _POOLS is in least-recently-used order
    if pool is None or not pool.alive:
        pool = DistPool(nnodes, nproc_per_node, env, timeout, placement)
    _POOLS[key] = pool
    _evict(keep=key)
    try:
        return pool.run(fn, args, kwargs or {}, timeout)
    except AssertionError:
        _POOLS.pop(key, None)
        raise


# Processes kept in pools by one pytest process (an xdist worker): each holds ~0.3-0.6 GB (torch,
# the World, what the last function built), and the suite's shapes add up to ~40 processes per
# worker if every pool is kept, which with 2 workers and a 16-rank test took the 24 GB machine into
# the OOM killer. The least recently used pools beyond this are closed (a respawn costs ~5 s).
MAX_POOLED_PROCS = 8


def _evict(keep: tuple) -> None:
    while sum(p.world for p in _POOLS.values()) > MAX_POOLED_PROCS and len(_POOLS) > 1:
        oldest = next(k for k in _POOLS if k != keep)
        pool = _POOLS.pop(oldest)
        pool.close(force=not pool.alive)


@atexit.register
def _shutdown() -> None:
    for pool in _POOLS.values():
        pool.close(force=not pool.alive)
    _POOLS.clear()
