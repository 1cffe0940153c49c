"""Ranks forked from the local launcher, for ``scaleout`` commands and Python scripts.

A fresh interpreter per rank spends ~3 s of CPU importing torch before it does anything; four
emulated ranks on a 2-core machine wait ~6 s for it at every start. The local launcher imports
torch once, then forks each rank from that state and runs the command in the child as
``python -u -m scaleout ...`` (or ``python -u script.py``) would: its own session, stdin from
/dev/null, stdout and stderr on the launcher's pipe, the rank's environment, the launcher's signal
handlers and exit hooks gone, and the process's exit status as the command's. The ranks are the
launcher's children as before (the watchdog, ``poll``/``wait`` and the process-group signals are
unchanged).

Fork is used only where it gives the process the exec would (:func:`why_not`): no node wrapper
(``ip netns exec`` must exec); no thread but the main one, unless it is parked (scaleout.forksafe:
a fork copies no other thread, and a lock one of them held would stay held); no CUDA context; and
the same values as the launcher's for what an interpreter or a native library reads while it
starts (``PYTHON*``, ``LD_*``, ...); and no native thread beyond OpenBLAS's pool (an OpenMP pool,
made by the launcher's first parallel torch op, would leave a forked child hanging in its own first
parallel region: GNU libgomp does not survive a fork). ``SCALEOUT_LAUNCH_FORK=0`` turns it off:
every rank exec'd.
One difference remains by nature: the ranks share the launcher's string-hash seed, where exec'd
interpreters each draw their own (ranks started by srun, mpirun or torchrun still do).
"""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import importlib
import io
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence

from scaleout import forksafe

# What the launcher imports once, before it forks: torch and the scaleout modules a rank's command
# imports on every start.
PRELOAD = ("torch", "torch.distributed", "scaleout.train.trainer")

# Variables an interpreter or a native library reads while it starts (before any command line runs):
# a rank whose value differs from the launcher's is exec'd, so that it gets its own.
_STARTUP_PREFIXES = (
    "PYTHON",
    "LD_",
    "LC_",
    "LANG",
    "MALLOC_",
    "KMP_",
    "GOMP_",
    "MKL_",
    "OPENBLAS_",
    "TORCH_",
)
# ... except these, which the child applies itself (threads) or which change no start-up state.
_APPLIED = frozenset({"PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "OMP_NUM_THREADS"})
# OpenBLAS's thread-count query, by build (numpy's wheels, scipy-openblas, a system OpenBLAS).
_OPENBLAS_THREADS = (
    "scipy_openblas_get_num_threads64_",
    "openblas_get_num_threads64_",
    "openblas_get_num_threads",
)
# The launcher's handlers that the child must not run (it resets them before it unblocks them).
_HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _program(cmd: Sequence[str]) -> list[str] | None:
    """``[sys.executable, "-u", "-m", "scaleout", ...]`` -> ``["-m", "scaleout", ...]``,
    ``[sys.executable, "-u", "x.py", ...]`` -> ``["x.py", ...]``; None for anything else."""
    if len(cmd) < 3 or cmd[0] != sys.executable or cmd[1] != "-u":
        return None
    if cmd[2:4] == ["-m", "scaleout"]:
        return list(cmd[2:])
    if cmd[2].endswith(".py") and not cmd[2].startswith("-"):
        return list(cmd[2:])
    return None


def _startup_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_STARTUP_PREFIXES) and k not in _APPLIED}


def why_not(cmd: Sequence[str], env: Mapping[str, str], wrapped: bool) -> str | None:
    """Why this rank must be exec'd, or None when a fork gives the process the exec would."""
    if os.environ.get("SCALEOUT_LAUNCH_FORK", "1") == "0" or env.get("SCALEOUT_LAUNCH_FORK") == "0":
        return "SCALEOUT_LAUNCH_FORK=0"
    if not hasattr(os, "fork"):
        return "no fork on this platform"
    if wrapped:
        return "a node wrapper runs the command"
    if _program(cmd) is None:
        return "not a scaleout command or a Python script"
    rank_start, own_start = _startup_env(env), _startup_env(os.environ)
    if rank_start != own_start:
        differ = sorted(set(rank_start.items()) ^ set(own_start.items()))
        return f"the rank's {differ[0][0]} differs from the launcher's"
    threads = forksafe.unparked_threads()
    if threading.current_thread() is not threading.main_thread() or threads:
        names = ", ".join(t.name for t in threads) or "the launcher is not in its main thread"
        return f"other threads run: {names}"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "the launcher holds a CUDA context"
    native, pool = _native_threads(), _openblas_pool()
    deadline = time.monotonic() + 0.5
    while native > pool and time.monotonic() < deadline:  # a thread that just ended (a name
        time.sleep(0.01)  # lookup's) leaves /proc a moment after it left threading's list
        native = _native_threads()
    if native > pool:
        # most likely OpenMP's pool, made by the launcher's first parallel torch op: a child forked
        # after that hangs in its own first parallel region (GNU libgomp does not survive a fork)
        return f"{native} native threads run in the launcher (an OpenMP pool?)"
    return None


def _native_threads() -> int:
    """Threads of this process that Python did not start."""
    try:
        return len(os.listdir("/proc/self/task")) - threading.active_count()
    except OSError:
        return 1 << 30  # cannot tell: never fork


def _openblas_pool() -> int:
    """The worker threads OpenBLAS (numpy's BLAS) starts when it loads: they survive a fork (it
    stops and restarts them around one). 0 when no OpenBLAS is loaded."""
    try:
        with open("/proc/self/maps") as f:
            libs = sorted({ln.split()[-1] for ln in f if "openblas" in ln.lower() and ".so" in ln})
    except OSError:
        return 0
    pool = 0
    for path in libs:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for symbol in _OPENBLAS_THREADS:
            get = getattr(lib, symbol, None)
            if get is not None:
                pool += max(int(get()) - 1, 0)
                break
    return pool


def preload() -> None:
    """Import what every rank would import (once, in the launcher)."""
    for name in PRELOAD:
        importlib.import_module(name)


class ForkedRank:
    """The launcher's handle on a forked rank: what it uses of :class:`subprocess.Popen`."""

    def __init__(self, pid: int, stdout: io.BufferedReader | None):
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its status is lost
                self.returncode = 255
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            while self.returncode is None:
                try:
                    _, status = os.waitpid(self.pid, 0)
                except ChildProcessError:
                    self.returncode = 255
                    break
                self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.02)
        return self.returncode


def fork(
    cmd: Sequence[str], env: Mapping[str, str], capture: bool, close: Sequence[int]
) -> ForkedRank:
    """Fork one rank running ``cmd`` (see :func:`why_not`) with ``env``. ``capture``: its stdout and
    stderr on a pipe (``ForkedRank.stdout``), else the launcher's. ``close``: the launcher's file
    descriptors the rank must not hold (the watchdog's pipe: its end of input is how the watchdog
    learns that the launcher died)."""
    program = _program(cmd)
    assert program is not None
    r, w = os.pipe() if capture else (-1, -1)
    for stream in (sys.stdout, sys.stderr):  # nothing buffered here may be written twice
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _HANDLED)
    try:
        with forksafe.forking():
            pid = os.fork()
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        if capture:
            os.close(r)
            os.close(w)
        raise
    if pid == 0:  # the child: never returns
        _child(program, dict(env), r, w, close, blocked)
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    if not capture:
        return ForkedRank(pid, None)
    os.close(w)
    return ForkedRank(pid, os.fdopen(r, "rb"))


def _child(
    program: list[str], env: dict[str, str], r: int, w: int, close: Sequence[int], mask
) -> None:
    code: int = 1
    try:
        os.setsid()  # own process group: killpg reaches the rank's children too
        forksafe.after_fork_in_child()
        for fd in (*close, r, *_inherited()):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        if w >= 0:
            os.dup2(w, 1)
            os.dup2(w, 2)
            os.close(w)
        for sig in _HANDLED:
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        atexit._clear()  # the launcher's exit hooks are the launcher's
        os.environ.clear()
        os.environ.update(env)
        # the encodings this interpreter chose for its own streams at start (PYTHONIOENCODING, the
        # locale, UTF-8 mode): the environment that decided them is the rank's too (why_not)
        streams = (sys.__stdin__, sys.__stdout__, sys.__stderr__)
        kinds = [
            {"encoding": getattr(o, "encoding", None), "errors": getattr(o, "errors", None)}
            for o in streams
        ]
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), **kinds[0])
        sys.stdout = io.TextIOWrapper(
            io.FileIO(1, "w", closefd=False), write_through=True, **kinds[1]
        )
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), write_through=True, **kinds[2]
        )
        if faulthandler.is_enabled():
            faulthandler.enable(sys.stderr)
        torch = sys.modules.get("torch")
        threads = env.get("OMP_NUM_THREADS", "")
        if torch is not None and threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))  # libgomp read the launcher's value when it loaded
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed()  # as a fresh interpreter: its own draw (random reseeds at fork)
        if program[0] == "-m":
            sys.path[0] = os.getcwd()  # as python -m puts it
            sys.argv = ["-m", *program[2:]]  # runpy puts __main__.py's path in argv[0], as -m does
            runpy.run_module("scaleout", run_name="__main__", alter_sys=True)  # sys.exit()s
            code = 0
        else:
            script = program[0]
            sys.path[0] = os.path.dirname(os.path.abspath(script))
            sys.argv = list(program)
            runpy.run_path(script, run_name="__main__")
            code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        code = 130
    except BaseException as exc:  # noqa: BLE001 -- as the interpreter: the traceback, exit 1
        try:
            traceback.print_exception(type(exc), exc, _from_the_command(exc.__traceback__))
        finally:
            code = 1
    finally:
        try:
            threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads, as at exit
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:  # noqa: BLE001
            pass
        os._exit(code)


def _from_the_command(tb):
    """The traceback without this module's and runpy's frames (an exec'd rank has neither)."""
    while tb is not None and tb.tb_next is not None:
        name = tb.tb_frame.f_code.co_filename
        if name != __file__ and not name.startswith("<frozen runpy"):
            break
        tb = tb.tb_next
    return tb


def _inherited() -> list[int]:
    """Descriptors above 2 without close-on-exec: the launcher inherited them from whatever started
    it (Python makes its own close-on-exec), and an exec'd rank would not hold them (Popen closes
    them); a rank that kept one could hold a pipe its reader waits to see closed."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if fd > 2 and os.get_inheritable(fd):
                out.append(fd)
        except OSError:  # listdir's own descriptor, closed by now
            pass
    return out


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except Exception:  # noqa: BLE001
        pass
    return 1
