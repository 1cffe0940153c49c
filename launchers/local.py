"""Run M x G processes on this machine as M emulated nodes, and supervise them.

Each child gets the variables ``scaleout.env.local.LocalEnv`` reads (plus torchrun's
RANK/LOCAL_RANK/... so torch-native scripts work too), its own process group (so a rank's own
children die with it), and its output prefixed with ``[rank N]``. Supervision: when a rank exits
non-zero or is killed, every other rank gets SIGTERM, then SIGKILL after ``grace_s``; the launcher
returns non-zero and names the rank. SIGINT, SIGTERM or SIGHUP to the launcher does the same to
every child; SIGUSR1/SIGUSR2 (preemption notices) are forwarded to every rank, as srun forwards
them.

When ranks fail, the launcher's last line names the root cause rather than the first rank to exit
(usually one that merely timed out waiting for the culprit): a rank whose collective failed prints
the hang verdict (scaleout/train/liveness.py: a stopped heartbeat, or the rank that is behind) as a
``verdict:`` line (scaleout/goodput/verdict.py), and the launcher puts the first one it read in
front of
"rank 1 ... exited with code 1". Error blocks that several ranks print alike (a Python traceback, a
C++ stack from c10) are printed once: each later copy becomes one line pointing to the first, and a
closing line says which ranks printed it (:class:`TracebackFolder`).

Nothing outlives the launcher: a watchdog process (launchers/watchdog.py) stops the ranks when the
launcher dies without doing so itself (SIGKILL, OOM). A closed stdout (``| head``, a dead ssh) never
blocks the ranks: their pipes are drained and the output dropped.

The default grace is 30 s, the same as Slurm's KillWait default and torchrun's stop timeout: on
SIGTERM the trainer finishes its step and writes a checkpoint (rank 0 gathers and writes the whole
state), which for a real model takes seconds to tens of seconds; a shorter window kills it half-way
and loses that progress.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from scaleout.env.addr import is_loopback, loopback_interface
from scaleout.env.base import free_port, local_rank_env
from scaleout.errors import UserError
from scaleout.goodput.verdict import read_verdict, with_exits
from scaleout.launchers import forkrank
from scaleout.launchers.base import (
    EXIT_TIMED_OUT,
    Launcher,
    LaunchOptions,
    LaunchResult,
    LaunchState,
    RankExit,
    register,
)
from scaleout.launchers.watchdog import start_time

# Slurm's KillWait default and torchrun's stop timeout (see the module docstring).
DEFAULT_GRACE_S = 30.0
# Emulated ranks per core beyond which a local launch is a typo, not a test: each rank is at least
# one process with its own interpreter, and 64 per core already means seconds per scheduling round.
RANKS_PER_CORE_CAP = 64


def max_local_ranks() -> int:
    """The most ranks one local launch may start on this machine (derived from its core count)."""
    return RANKS_PER_CORE_CAP * (os.cpu_count() or 1)


def resolve_command(cmd: Sequence[str]) -> list[str]:
    """``scaleout x`` / ``script.py`` / ``python ...`` / a program -> something exec-able with
    this interpreter. (A bare scaleout subcommand, ``smoke`` for ``scaleout smoke``, is the CLI's
    to resolve: it knows them.)"""
    if not cmd:
        raise UserError(
            "no command given after '--' (e.g. scaleout launch --nnodes 2 --nproc-per-node 2 -- "
            "scaleout smoke)"
        )
    cmd = list(cmd)
    if cmd[0] == "scaleout":
        return [sys.executable, "-u", "-m", "scaleout", *cmd[1:]]
    if cmd[0].endswith(".py"):
        return [sys.executable, "-u", *cmd]
    if cmd[0] in ("python", "python3"):
        return [sys.executable, "-u", *cmd[1:]]
    if shutil.which(cmd[0]) is None and not os.path.exists(cmd[0]):
        raise UserError(
            f"command {cmd[0]!r} not found on PATH (expected a program, a .py file or a scaleout "
            "subcommand)"
        )
    return cmd


def rank_env(
    base: dict[str, str], rank: int, nnodes: int, nproc: int, addr: str, port: int
) -> dict[str, str]:
    """``base`` plus what rank ``rank`` of ``nnodes`` x ``nproc`` reads
    (scaleout.env.base.local_rank_env)."""
    env = dict(base)
    env.update(local_rank_env(rank, nnodes, nproc, addr, port), PYTHONUNBUFFERED="1")
    # Each emulated node gets a share of the cores, not all of them (a 2-core box would thrash).
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (nnodes * nproc))))
    return env


class _Sink:
    """Where every rank's lines go. Once the reader is gone (BrokenPipeError, EIO after a
    hang-up) lines are dropped, but the ranks' pipes keep being drained: a rank must never block
    on a full pipe."""

    def __init__(self, out) -> None:
        self.out = out
        self.lock = threading.Lock()
        self.broken = False

    def write(self, text: str) -> None:
        with self.lock:
            if self.broken:
                return
            try:
                self.out.write(text)
                self.out.flush()
            except (OSError, ValueError):
                self._break()

    def _break(self) -> None:
        self.broken = True
        if self.out is sys.stdout:
            # Point fd 1 at /dev/null so that buffered text and the final message do not raise again
            # (or print "Exception ignored ... BrokenPipeError" at exit): the recipe of Python's
            # signal docs.
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                os.close(devnull)
            except (OSError, ValueError):
                pass


# Error blocks: where one starts, and which lines continue it (see TracebackFolder).
_PY_START = "Traceback (most recent call last):"
_CXX_START = "Exception raised from "
_CHAINED = (
    "During handling of the above exception",
    "The above exception was the direct cause",
    _PY_START,
)
_CXX_FRAME = re.compile(r"^frame #\d+: ")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def _cxx(line: str) -> bool:
    return line.startswith(_CXX_START) or bool(_CXX_FRAME.match(line))


class TracebackFolder:
    """Prints an error block that several ranks print alike only once.

    A block is a Python traceback (from ``Traceback (most recent call last):`` through the
    exception line, chained tracebacks and the C++ frames of a torch error's message) or a c10 C++
    stack (``Exception raised from ...`` and its ``frame #N:`` lines). A rank's block is held back
    until it ends (the next line that does not continue it, or the end of the rank's output); the
    first rank to finish a block gets it printed; every later identical one (identical but for hex
    addresses, which differ per process) becomes one line saying so, and :meth:`summary` lists the
    ranks that printed each folded block. Feed it lines without their newline; it returns
    ``(rank, line)`` pairs to print. Thread-safe (one pump thread per rank)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, tuple[str, list[str]]] = {}  # rank -> (state, lines so far)
        self._first: dict[str, int] = {}  # normalised block -> the rank printed under
        self._ranks: dict[str, list[int]] = {}  # normalised block -> every rank that printed it

    def feed(self, rank: int, line: str) -> list[tuple[int, str]]:
        with self._lock:
            return self._feed(rank, line)

    def close(self, rank: int) -> list[tuple[int, str]]:
        """The end of ``rank``'s output: a block still open ends here."""
        with self._lock:
            return self._end(rank)

    def summary(self) -> list[str]:
        """One line per block that more than one rank printed, in the order they were first
        printed."""
        with self._lock:
            return [
                f"the error block printed under [rank {self._first[key]}] was the same on ranks "
                + ",".join(map(str, sorted(ranks)))
                for key, ranks in self._ranks.items()
                if len(ranks) > 1
            ]

    def _feed(self, rank: int, line: str) -> list[tuple[int, str]]:
        if rank in self._open:
            state, lines = self._open[rank]
            nxt = self._continue(state, line)
            if nxt is not None:
                lines.append(line)
                self._open[rank] = (nxt, lines)
                return []
            out = self._end(rank)
            return out + self._feed(rank, line)
        if line.startswith(_PY_START):
            self._open[rank] = ("body", [line])
            return []
        if line.startswith(_CXX_START):
            self._open[rank] = ("cxx", [line])
            return []
        return [(rank, line)]

    @staticmethod
    def _continue(state: str, line: str) -> str | None:
        """The block's state after ``line`` when ``line`` continues it, else None."""
        if state == "cxx":
            return "cxx" if _cxx(line) else None
        if line.startswith(_CHAINED):
            return "body"
        if line.startswith(" ") or not line.strip():  # File/code/caret lines; blank lines
            return state
        if _cxx(line):
            return "tail"
        # a non-indented line: the exception in the body; after it, the next output
        return "tail" if state == "body" else None

    def _end(self, rank: int) -> list[tuple[int, str]]:
        if rank not in self._open:
            return []
        _, lines = self._open.pop(rank)
        while len(lines) > 1 and not lines[-1].strip():  # trailing blank lines are not the block
            lines.pop()
        key = "\n".join(_ADDRESS.sub("0x?", x) for x in lines)
        first = self._first.setdefault(key, rank)
        self._ranks.setdefault(key, []).append(rank)
        if first == rank or len(lines) < 2:
            return [(rank, x) for x in lines]
        return [(rank, f"(the same {len(lines)}-line error block as [rank {first}] above)")]


class _RankOutput:
    """What the pump threads share: the sink, the traceback folder, the first verdict read."""

    def __init__(self, sink: _Sink) -> None:
        self.sink = sink
        self.folder = TracebackFolder()
        self.verdict: str | None = None

    def line(self, rank: int, text: str) -> None:
        if self.verdict is None:
            self.verdict = read_verdict(text)
        self._write(self.folder.feed(rank, text))

    def close(self, rank: int) -> None:
        self._write(self.folder.close(rank))

    def _write(self, lines: list[tuple[int, str]]) -> None:
        if lines:
            self.sink.write("".join(f"[rank {rank}] {x}\n" for rank, x in lines))


def _pump(stream, rank: int, output: _RankOutput) -> None:
    try:
        for raw in iter(stream.readline, b""):
            output.line(rank, raw.decode(errors="replace").rstrip("\n"))
    finally:
        output.close(rank)
        stream.close()


def check_launch_args(
    nnodes: int,
    nproc_per_node: int,
    grace_s: float,
    timeout_s: float | None = None,
    master_port: int | None = None,
) -> None:
    """One-line errors for impossible launch parameters, before anything is spawned."""
    if nnodes < 1:
        raise UserError(f"--nnodes={nnodes}: expected an integer >= 1")
    if nproc_per_node < 1:
        raise UserError(f"--nproc-per-node={nproc_per_node}: expected an integer >= 1")
    cap = max_local_ranks()
    if nnodes * nproc_per_node > cap:
        raise UserError(
            f"--nnodes={nnodes} x --nproc-per-node={nproc_per_node} = {nnodes * nproc_per_node} "
            "ranks: expected at "
            f"most {cap} on this machine ({RANKS_PER_CORE_CAP} per core x {os.cpu_count()} cores)"
        )
    if not (math.isfinite(grace_s) and 0 <= grace_s <= 3600):
        raise UserError(f"--grace={grace_s}: expected seconds from 0 to 3600")
    if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
        raise UserError(f"--timeout={timeout_s}: expected a positive number of seconds")
    if master_port is not None and not 1 <= master_port <= 65535:
        raise UserError(f"--master-port={master_port}: expected a port from 1 to 65535")


class LocalJob:
    """Start, watch and stop the ranks (:class:`LocalLauncher` makes one; :func:`launch` is the
    one-call form). While it runs (``start`` to the end of ``wait``, in the main thread) SIGINT,
    SIGTERM and SIGHUP stop every rank and SIGUSR1/SIGUSR2 are forwarded to them."""

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
        grace_s: float = DEFAULT_GRACE_S,
        prefix_output: bool = True,
        out=None,
        log: Path | None = None,
        on_orphan: Sequence[Sequence[str]] = (),
        preflight: Callable[[int, int], None] | None = None,
    ):
        check_launch_args(nnodes, nproc_per_node, grace_s, master_port=master_port)
        self.cmd = resolve_command(cmd)
        if (
            preflight is not None
        ):  # the caller's check of the command for this world, before anything spawns
            preflight(nnodes * nproc_per_node, nproc_per_node)
        self.nnodes, self.nproc = nnodes, nproc_per_node
        self.addr = master_addr
        self.port = master_port or free_port(
            master_addr if master_addr.startswith("127.") else "0.0.0.0"
        )
        self.base_env = dict(os.environ if env is None else env)
        # the launch's moment, for report.json's untimed start (scaleout.telemetry.startup)
        self.base_env["SCALEOUT_LAUNCH_UNIX"] = f"{time.time():.3f}"
        if (
            node_wrapper is None
            and is_loopback(self.addr)
            and "GLOO_SOCKET_IFNAME" not in self.base_env
        ):
            # All ranks on this host: keep gloo's sockets on the loopback interface, not reachable
            # from the network (torch's TCPStore itself listens on every interface; torch offers no
            # bind address).
            lo = loopback_interface()
            if lo:
                self.base_env.update(GLOO_SOCKET_IFNAME=lo, TP_SOCKET_IFNAME=lo)
        self.node_wrapper = node_wrapper
        self.rank_env_hook = rank_env_hook
        self.grace_s = grace_s
        self.prefix_output = prefix_output
        # log: a file for the ranks' output, opened here and closed when the job is over
        self._log = open(log, "w") if log is not None else None  # noqa: SIM115
        self.sink = _Sink(self._log or out or sys.stdout)
        self.output = _RankOutput(self.sink)
        self._handlers: dict[int, Any] = {}
        self.on_orphan = [
            list(c) for c in on_orphan
        ]  # run by the watchdog if this launcher dies first
        self.procs: list[subprocess.Popen | forkrank.ForkedRank] = []
        self.fork_why_not: str | None = "not started"  # why the ranks were exec'd; None: forked
        self._pumps: list[threading.Thread] = []
        self._stop_signal: int | None = None
        self._watchdog: subprocess.Popen | None = None

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc

    def _start_watchdog(self) -> None:
        self._watchdog = subprocess.Popen(
            [sys.executable, "-I", str(Path(__file__).with_name("watchdog.py"))],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C / SIGHUP to the launcher's group must not reach it
            text=True,
        )
        self._tell_watchdog(
            f"grace {self.grace_s}", *(f"cleanup {json.dumps(c)}" for c in self.on_orphan)
        )

    def _tell_watchdog(self, *lines: str) -> None:
        if self._watchdog is None or self._watchdog.stdin is None:
            return
        try:
            self._watchdog.stdin.write("".join(f"{line}\n" for line in lines))
            self._watchdog.stdin.flush()
        except OSError:  # it died: nothing to tell; the launcher itself still stops the ranks
            pass

    def _release_watchdog(self) -> None:
        """Every rank is reaped: tell the watchdog it has nothing to do, and reap it."""
        if self._watchdog is None:
            return
        self._tell_watchdog("done")
        try:
            self._watchdog.stdin.close()
            self._watchdog.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self._watchdog.kill()
        self._watchdog = None

    def start(self) -> None:
        self._install_handlers()
        try:
            self._spawn()
        except BaseException:
            self.stop()
            self._restore_handlers()
            self._close_log()
            raise

    def _spawn(self) -> None:
        envs = []
        for rank in range(self.world_size):
            env = rank_env(self.base_env, rank, self.nnodes, self.nproc, self.addr, self.port)
            if self.rank_env_hook:
                self.rank_env_hook(rank, env)
            envs.append(env)
        self.fork_why_not = self._fork_why_not(envs)
        for env in envs:  # how this rank was started, for a rank or a person who asks (docs)
            env["SCALEOUT_RANK_START"] = (
                "fork" if self.fork_why_not is None else (f"exec ({self.fork_why_not})")
            )
        self._start_watchdog()
        for rank, env in enumerate(envs):
            if self.fork_why_not is None:
                proc: subprocess.Popen | forkrank.ForkedRank = forkrank.fork(
                    self.cmd, env, self.prefix_output, self._launcher_fds()
                )
            else:
                cmd = list(self.cmd)
                if self.node_wrapper:
                    cmd = self.node_wrapper(rank // self.nproc) + cmd
                proc = subprocess.Popen(
                    cmd,
                    env=env,
                    stdout=subprocess.PIPE if self.prefix_output else None,
                    stderr=subprocess.STDOUT if self.prefix_output else None,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # own process group: killpg reaches its children too
                )
            self.procs.append(proc)
            self._tell_watchdog(f"rank {proc.pid} {start_time(proc.pid)}")
        if self.prefix_output:  # threads only once every rank is forked: a fork copies none
            for rank, proc in enumerate(self.procs):
                t = threading.Thread(
                    target=_pump, args=(proc.stdout, rank, self.output), daemon=True
                )
                t.start()
                self._pumps.append(t)

    def _fork_why_not(self, envs: list[dict[str, str]]) -> str | None:
        """None when every rank can be forked from this process (launchers/forkrank.py), after
        importing what the ranks would; else why they are exec'd."""
        wrapped = self.node_wrapper is not None
        why = forkrank.why_not(self.cmd, envs[0], wrapped)
        if why is None:
            forkrank.preload()
            why = next((w for e in envs if (w := forkrank.why_not(self.cmd, e, wrapped))), None)
        return why

    def _launcher_fds(self) -> list[int]:
        """This launcher's descriptors a forked rank must not keep: the watchdog's pipe (its end
        of input tells the watchdog the launcher died), the log, the other ranks' pipes."""
        files = [self._watchdog.stdin if self._watchdog else None, self._log]
        files += [p.stdout for p in self.procs]
        return [f.fileno() for f in files if f is not None and not f.closed]

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
        self._release_watchdog()

    def _on_signal(self, signum, _frame) -> None:
        self._stop_signal = signum

    def _forward(self, signum, _frame) -> None:
        """SIGUSR1/SIGUSR2 are preemption notices: pass them to every rank (as srun does), keep
        running."""
        self._signal_all(signum)

    def wait(self, timeout_s: float | None = None) -> LaunchResult:
        try:
            return self._supervise(timeout_s)
        except BaseException:
            self.stop()
            raise
        finally:
            self._restore_handlers()
            self._close_log()

    def _supervise(self, timeout_s: float | None) -> LaunchResult:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        failed: RankExit | None = None
        while True:
            if self._stop_signal is not None:
                self.stop()
                name = signal.Signals(self._stop_signal).name
                return self._finish(
                    128 + self._stop_signal,
                    None,
                    f"received {name}; stopped all {self.world_size} ranks",
                    "stopped",
                )
            codes = [p.poll() for p in self.procs]
            for rank, code in enumerate(codes):
                if code not in (None, 0):
                    failed = RankExit.of(rank, self.nproc, code)
                    break
            if failed is not None:
                running = sum(c is None for c in codes)
                # the ranks that ended on their own: a verdict naming them as silent is completed
                exits = {
                    r: RankExit.of(r, self.nproc, c).how()
                    for r, c in enumerate(codes)
                    if c not in (None, 0)
                }
                self.stop()
                msg = failed.describe() + (
                    f"; stopped the other {running} running ranks" if running else ""
                )
                code = failed.returncode if failed.returncode > 0 else 1
                return self._finish(code, failed, msg, "failed", exits)
            if all(c == 0 for c in codes):
                return self._finish(0, None, f"all {self.world_size} ranks exited 0", "succeeded")
            if deadline is not None and time.monotonic() > deadline:
                self.stop()
                return self._finish(
                    EXIT_TIMED_OUT,
                    None,
                    f"timed out after {timeout_s:.0f} s; stopped all ranks",
                    "timed_out",
                )
            time.sleep(0.05)

    def _finish(
        self,
        code: int,
        failed: RankExit | None,
        msg: str,
        state: LaunchState,
        exits: dict[int, str] | None = None,
    ) -> LaunchResult:
        for p in (
            self.procs
        ):  # all exited (or were stopped): reaping them first makes the watchdog's "done" true
            p.wait()
        self._release_watchdog()
        for t in self._pumps:
            t.join(timeout=2)
        for line in self.output.folder.summary():
            self.sink.write(f"scaleout launch: {line}\n")
        verdict = self.output.verdict
        if verdict is not None and exits:  # a silent rank that exited crashed, it did not hang
            verdict = with_exits(verdict, exits)
        if failed is not None and verdict is not None:  # the root cause first, then who exited
            msg = f"{verdict}; then {msg}"
        self._close_log()
        return LaunchResult(code, failed, msg, state, verdict)

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        # SIGHUP: the terminal or ssh session went away; stop like SIGTERM rather than die and
        # orphan.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._handlers[sig] = signal.signal(sig, self._on_signal)
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            self._handlers[sig] = signal.signal(sig, self._forward)

    def _restore_handlers(self) -> None:
        for sig, h in self._handlers.items():
            signal.signal(sig, h)
        self._handlers = {}

    def run(self, timeout_s: float | None = None) -> LaunchResult:
        self.start()
        return self.wait(timeout_s)


def launch(cmd: Sequence[str], nnodes: int, nproc_per_node: int, **kwargs) -> LaunchResult:
    timeout_s = kwargs.pop("timeout_s", None)
    return LocalJob(cmd, nnodes, nproc_per_node, **kwargs).run(timeout_s)


@register
class LocalLauncher(Launcher):
    """Processes on this machine as emulated nodes. ``job_options``: :class:`LocalJob`'s keywords
    (master_addr, grace_s, prefix_output, preflight...), the same for every start."""

    name = "local"

    def __init__(self, extra_env: Mapping[str, str] | None = None, **job_options: Any):
        self.extra_env = dict(extra_env or {})  # e.g. OMP_NUM_THREADS for every rank
        self.job_options = job_options

    @classmethod
    def from_options(cls, options: LaunchOptions) -> LocalLauncher:
        if options.slurm:
            raise UserError(
                f"--slurm {', '.join(options.slurm)}: sbatch options need --launcher slurm or "
                "submit"
            )
        if options.rate is not None:
            raise UserError("a link rate needs the emulated cluster: --launcher netns (or --netns)")
        return cls(extra_env=options.extra_env)

    def job_kwargs(self, log: Path | None) -> dict[str, Any]:
        """LocalJob's keywords for one start: this launcher's options, the environment, the
        output."""
        kwargs = dict(self.job_options)
        kwargs["env"] = {**(kwargs.get("env") or os.environ), **self.extra_env}
        if log is not None:
            kwargs["log"] = log
        return kwargs

    def start(
        self,
        argv: Sequence[str],
        nnodes: int,
        nproc_per_node: int,
        *,
        log: Path | None = None,
        name: str = "scaleout",
    ) -> LocalJob:
        job = LocalJob(argv, nnodes, nproc_per_node, **self.job_kwargs(log))
        job.start()
        return job
