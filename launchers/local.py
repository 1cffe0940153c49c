"""Run M x G processes on this machine as M emulated nodes, and supervise them.

Each child gets the variables ``scaleout.env.LocalEnv`` reads (plus torchrun's RANK/LOCAL_RANK/... so
torch-native scripts work too), its own process group (so a rank's own children die with it), and its
output prefixed with ``[rank N]``. Supervision: when a rank exits non-zero or is killed, every other rank
gets SIGTERM, then SIGKILL after ``grace_s``; the launcher returns non-zero and names the rank. SIGINT or
SIGTERM to the launcher does the same to every child; SIGUSR1/SIGUSR2 (preemption notices) are forwarded
to every rank, as srun forwards them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from scaleout.env.base import free_port
from scaleout.errors import UserError


@dataclass
class RankExit:
    rank: int
    node: int
    local_rank: int
    returncode: int

    def describe(self) -> str:
        where = f"rank {self.rank} (node {self.node}, local rank {self.local_rank})"
        if self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            return f"{where} was killed by {name}"
        return f"{where} exited with code {self.returncode}"


@dataclass
class LaunchResult:
    returncode: int
    failed: RankExit | None
    message: str


def resolve_command(cmd: Sequence[str]) -> list[str]:
    """``scaleout x`` / a bare subcommand / ``script.py`` -> something exec-able with this interpreter."""
    if not cmd:
        raise UserError("no command given after '--' (e.g. scaleout launch --nnodes 2 --nproc-per-node 2 -- scaleout smoke)")
    cmd = list(cmd)
    if cmd[0] == "scaleout":
        return [sys.executable, "-u", "-m", "scaleout", *cmd[1:]]
    if cmd[0].endswith(".py"):
        return [sys.executable, "-u", *cmd]
    if cmd[0] in ("python", "python3"):
        return [sys.executable, "-u", *cmd[1:]]
    from scaleout.cli import _commands

    if cmd[0] in {m.NAME for m in _commands()}:
        return [sys.executable, "-u", "-m", "scaleout", *cmd]
    if shutil.which(cmd[0]) is None and not os.path.exists(cmd[0]):
        raise UserError(f"command {cmd[0]!r} not found on PATH (expected a program, a .py file or a scaleout subcommand)")
    return cmd


def rank_env(
    base: dict[str, str], rank: int, nnodes: int, nproc: int, addr: str, port: int
) -> dict[str, str]:
    node, local = divmod(rank, nproc)
    env = dict(base)
    env.update(
        SCALEOUT_RANK=str(rank),
        SCALEOUT_LOCAL_RANK=str(local),
        SCALEOUT_NODE_RANK=str(node),
        SCALEOUT_NNODES=str(nnodes),
        SCALEOUT_NPROC_PER_NODE=str(nproc),
        SCALEOUT_WORLD_SIZE=str(nnodes * nproc),
        RANK=str(rank),
        LOCAL_RANK=str(local),
        GROUP_RANK=str(node),
        WORLD_SIZE=str(nnodes * nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
        PYTHONUNBUFFERED="1",
    )
    # Each emulated node gets a share of the cores, not all of them (a 2-core box would thrash).
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (nnodes * nproc))))
    return env


def _pump(stream, prefix: str, out) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        out.write(f"{prefix}{line}" if line.endswith("\n") else f"{prefix}{line}\n")
        out.flush()
    stream.close()


class LocalLauncher:
    """Start, watch and stop the ranks. Use :func:`launch` for the one-call form."""

    def __init__(
        self,
        cmd: Sequence[str],
        nnodes: int,
        nproc_per_node: int,
        *,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        env: dict[str, str] | None = None,
        node_wrapper: Callable[[int], list[str]] | None = None,
        rank_env_hook: Callable[[int, dict[str, str]], None] | None = None,
        grace_s: float = 5.0,
        prefix_output: bool = True,
        out=None,
    ):
        if nnodes < 1:
            raise UserError(f"--nnodes={nnodes}: expected an integer >= 1")
        if nproc_per_node < 1:
            raise UserError(f"--nproc-per-node={nproc_per_node}: expected an integer >= 1")
        self.cmd = resolve_command(cmd)
        if self.cmd[1:4] == ["-u", "-m", "scaleout"]:  # a scaleout subcommand: validate it before spawning
            from scaleout.cli import preflight

            preflight(self.cmd[4:], nnodes * nproc_per_node, nproc_per_node)
        self.nnodes, self.nproc = nnodes, nproc_per_node
        self.addr = master_addr
        self.port = master_port or free_port(master_addr if master_addr.startswith("127.") else "0.0.0.0")
        self.base_env = dict(os.environ if env is None else env)
        self.node_wrapper = node_wrapper
        self.rank_env_hook = rank_env_hook
        self.grace_s = grace_s
        self.prefix_output = prefix_output
        self.out = out or sys.stdout
        self.procs: list[subprocess.Popen] = []
        self._pumps: list[threading.Thread] = []
        self._stop_signal: int | None = None

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc

    def start(self) -> None:
        for rank in range(self.world_size):
            env = rank_env(self.base_env, rank, self.nnodes, self.nproc, self.addr, self.port)
            if self.rank_env_hook:
                self.rank_env_hook(rank, env)
            cmd = list(self.cmd)
            if self.node_wrapper:
                cmd = self.node_wrapper(rank // self.nproc) + cmd
            proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.PIPE if self.prefix_output else None,
                stderr=subprocess.STDOUT if self.prefix_output else None,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # own process group: killpg reaches the rank's children too
            )
            self.procs.append(proc)
            if self.prefix_output:
                t = threading.Thread(target=_pump, args=(proc.stdout, f"[rank {rank}] ", self.out), daemon=True)
                t.start()
                self._pumps.append(t)

    def _signal_all(self, sig: int) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self) -> None:
        """SIGTERM every rank's process group, SIGKILL what is left after the grace period."""
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.05)
        self._signal_all(signal.SIGKILL)  # also reaps grandchildren that ignored SIGTERM
        for p in self.procs:
            p.wait()

    def _on_signal(self, signum, _frame) -> None:
        self._stop_signal = signum

    def _forward(self, signum, _frame) -> None:
        """SIGUSR1/SIGUSR2 are preemption notices: pass them to every rank (as srun does), keep running."""
        self._signal_all(signum)

    def wait(self, timeout_s: float | None = None) -> LaunchResult:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        failed: RankExit | None = None
        while True:
            if self._stop_signal is not None:
                self.stop()
                name = signal.Signals(self._stop_signal).name
                return self._finish(128 + self._stop_signal, None, f"received {name}; stopped all {self.world_size} ranks")
            codes = [p.poll() for p in self.procs]
            for rank, code in enumerate(codes):
                if code not in (None, 0):
                    node, local = divmod(rank, self.nproc)
                    failed = RankExit(rank, node, local, code)
                    break
            if failed is not None:
                running = sum(c is None for c in codes)
                self.stop()
                msg = failed.describe() + (f"; stopped the other {running} running ranks" if running else "")
                return self._finish(failed.returncode if failed.returncode > 0 else 1, failed, msg)
            if all(c == 0 for c in codes):
                return self._finish(0, None, f"all {self.world_size} ranks exited 0")
            if deadline is not None and time.monotonic() > deadline:
                self.stop()
                return self._finish(124, None, f"timed out after {timeout_s:.0f} s; stopped all ranks")
            time.sleep(0.05)

    def _finish(self, code: int, failed: RankExit | None, msg: str) -> LaunchResult:
        for t in self._pumps:
            t.join(timeout=2)
        return LaunchResult(code, failed, msg)

    def run(self, timeout_s: float | None = None) -> LaunchResult:
        handlers = {}
        in_main = threading.current_thread() is threading.main_thread()
        if in_main:
            for sig in (signal.SIGINT, signal.SIGTERM):
                handlers[sig] = signal.signal(sig, self._on_signal)
            for sig in (signal.SIGUSR1, signal.SIGUSR2):
                handlers[sig] = signal.signal(sig, self._forward)
        try:
            self.start()
            return self.wait(timeout_s)
        except BaseException:
            self.stop()
            raise
        finally:
            for sig, h in handlers.items():
                signal.signal(sig, h)


def launch(cmd: Sequence[str], nnodes: int, nproc_per_node: int, **kwargs) -> LaunchResult:
    timeout_s = kwargs.pop("timeout_s", None)
    return LocalLauncher(cmd, nnodes, nproc_per_node, **kwargs).run(timeout_s)
