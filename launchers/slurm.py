"""The local Slurm cluster (launchers/slurm_local/start.sh, stop.sh) and small helpers to use a
Slurm cluster.

``LocalSlurm`` wraps the shell scripts: a real slurmctld + slurmdbd + four slurmd (emulated nodes
n1..n4) on this host, state in $SCALEOUT_SLURM_STATE (default /tmp/scaleout-slurm, never the repo;
it must be root's and writable by nobody else, and carry scaleout's marker before anything in it is
deleted). Clients find it through ``SLURM_CONF``; :meth:`LocalSlurm.env` returns an environment with
it set. The job helpers (``sbatch``, ``job_state``, ``wait_job``) work on any Slurm cluster.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scaleout.errors import UserError
from scaleout.goodput.verdict import first_verdict, srun_exits, with_exits
from scaleout.launchers.base import EXIT_TIMED_OUT, Launcher, LaunchOptions, LaunchResult, register
from scaleout.launchers.cpus import CPUS_VAR, cpu_share_lines
from scaleout.resources import package_path

HERE = package_path(
    __package__, "slurm_local"
).resolve()  # start.sh, stop.sh, *.conf.in: package data
DEFAULT_STATE = "/tmp/scaleout-slurm"
NODES = ("n1", "n2", "n3", "n4")
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


@dataclass
class ClusterStatus:
    running: bool
    state_dir: str
    slurm_conf: str
    daemons: dict[str, int | None]  # name -> PID if alive
    nodes: str  # `sinfo -N` output, or why not

    def describe(self) -> str:
        lines = [
            f"local Slurm cluster: {'up' if self.running else 'down'} (state {self.state_dir})"
        ]
        for name, pid in self.daemons.items():
            lines.append(f"  {name:<12} {'pid ' + str(pid) if pid else 'not running'}")
        if self.running:
            lines.append(f"  export SLURM_CONF={self.slurm_conf}")
            lines.extend("  " + ln for ln in self.nodes.splitlines())
        return "\n".join(lines)


def _alive(pidfile: Path, *comms: str) -> int | None:
    """The PID in ``pidfile`` if that process is alive and runs one of ``comms`` (not a reused
    PID)."""
    try:
        pid = int(pidfile.read_text().strip())
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except (OSError, ValueError):
        return None
    return pid if comm in comms else None


class LocalSlurm:
    """Start/stop/inspect the emulated 4-node cluster. Needs root and the Debian slurm-wlm/munge
    packages."""

    def __init__(self, state_dir: str | None = None):
        self.state = Path(state_dir or os.environ.get("SCALEOUT_SLURM_STATE") or DEFAULT_STATE)
        repo = HERE.parent.parent
        if self.state.resolve() == repo or repo in self.state.resolve().parents:
            raise UserError(
                f"SCALEOUT_SLURM_STATE={self.state}: the state folder must be outside the repo "
                f"{repo}"
            )

    @property
    def slurm_conf(self) -> str:
        return str(self.state / "etc" / "slurm.conf")

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = self.slurm_conf
        env["SCALEOUT_SLURM_STATE"] = str(self.state)
        return env

    def _script_env(self) -> dict[str, str]:
        return {**os.environ, "SCALEOUT_SLURM_STATE": str(self.state)}

    def daemons(self) -> dict[str, int | None]:
        run = self.state / "run"
        out: dict[str, int | None] = {"munged": _alive(run / "munge" / "munged.pid", "munged")}
        out["mariadbd"] = _alive(run / "mysql.pid", "mariadbd", "mysqld")
        out["slurmdbd"] = _alive(run / "slurmdbd.pid", "slurmdbd")
        out["slurmctld"] = _alive(run / "slurmctld.pid", "slurmctld")
        for n in NODES:
            out[f"slurmd {n}"] = _alive(run / f"slurmd-{n}.pid", "slurmd")
        return out

    def is_running(self) -> bool:
        d = self.daemons()
        if not (d["munged"] and d["slurmctld"] and all(d[f"slurmd {n}"] for n in NODES)):
            return False
        return self._sinfo(["-h"]) is not None

    def _sinfo(self, args: Sequence[str]) -> str | None:
        if shutil.which("sinfo") is None:
            return None
        p = subprocess.run(
            ["sinfo", *args],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        return p.stdout if p.returncode == 0 else None

    def status(self) -> ClusterStatus:
        running = self.is_running()
        nodes = (self._sinfo(["-N"]) or "sinfo does not answer") if running else "down"
        return ClusterStatus(running, str(self.state), self.slurm_conf, self.daemons(), nodes)

    def start(
        self, accounting: bool = True, install: bool = True, timeout_s: float = 300.0
    ) -> bool:
        """Start the cluster unless it is up. Returns True if this call started it."""
        if self.is_running():
            return False
        args = [] if accounting else ["--no-dbd"]
        if not install:
            args.append("--no-install")
        out = self._script("start.sh", args, timeout_s, "did not start")
        # Another session may have started it while we waited for start.sh's lock: then it is theirs
        # to stop.
        return "already running" not in out

    def stop(self, wipe: bool = False, timeout_s: float = 120.0) -> None:
        self._script("stop.sh", ["--wipe"] if wipe else [], timeout_s, "not stopped")

    def _script(self, name: str, args: list[str], timeout_s: float, failed: str) -> str:
        """Run one of the cluster's scripts (start.sh / stop.sh); its stdout, or UserError naming
        what failed."""
        p = subprocess.run(
            [str(HERE / name), *args],
            env=self._script_env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if p.returncode != 0:
            raise UserError(
                f"local Slurm {failed} (exit {p.returncode}): {(p.stderr or p.stdout).strip()}"
            )
        return p.stdout


def can_run_local_slurm() -> str | None:
    """None if this machine can run the local cluster, else why not (for skip messages)."""
    if os.name != "posix" or os.geteuid() != 0:
        return "the local Slurm cluster needs root (munged/slurmd)"
    if shutil.which("apt-get") is None and shutil.which("slurmctld") is None:
        return (
            "slurmctld is not installed and apt-get is not available (scripts/setup.sh --test "
            "installs it)"
        )
    return None


def sbatch_flags(options: dict[str, Any]) -> list[str]:
    """{"account": "proj", "exclusive": True} -> ["--account=proj", "--exclusive"] (as submitit
    writes them)."""
    return [f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}") for k, v in options.items()]


# -- job helpers (any Slurm cluster)
# ----------------------------------------------------------------
def sbatch(
    args: Sequence[str], env: Mapping[str, str] | None = None, cwd: str | None = None
) -> int:
    """Submit with ``sbatch --parsable`` and return the job id."""
    p = subprocess.run(
        ["sbatch", "--parsable", *args],
        env=dict(env or os.environ),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if p.returncode != 0:
        raise UserError(f"sbatch {' '.join(args)} failed: {(p.stderr or p.stdout).strip()}")
    return int(p.stdout.strip().split(";")[0])


def job_info(job_id: int | str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``scontrol show job`` as a dict (JobState, RestartCnt, ExitCode, NodeList, ...); {} if
    unknown."""
    p = subprocess.run(
        ["scontrol", "show", "job", "-o", str(job_id)],
        env=dict(env or os.environ),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if p.returncode != 0:
        return {}
    return dict(re.findall(r"(\w+)=(\S*)", p.stdout))


def job_state(job_id: int | str, env: Mapping[str, str] | None = None) -> str:
    return job_info(job_id, env).get("JobState", "UNKNOWN")


def wait_job(
    job_id: int | str,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 120.0,
    poll_s: float = 0.25,
    states: set[str] | None = None,
) -> str:
    """Wait until the job reaches one of ``states`` (default: any final state) and return it."""
    want = states or FINAL_STATES
    deadline = time.monotonic() + timeout_s
    state = "UNKNOWN"
    while time.monotonic() < deadline:
        state = job_state(job_id, env)
        if state in want:
            return state
        time.sleep(poll_s)
    raise TimeoutError(
        f"Slurm job {job_id} still {state} after {timeout_s:.0f} s (waiting for {sorted(want)})"
    )


# -- the ``slurm`` launcher: one sbatch job per start, srun starts the ranks
# --------------------------- How long a job may be unknown to scontrol before it counts as failed
# (a controller restart or a job record purged after MinJobAge is seconds, not minutes).
UNKNOWN_GRACE_S = 60.0


def scaleout_command() -> list[str]:
    """How a Slurm task starts scaleout: the installed entry point, else this interpreter's
    module."""
    exe = shutil.which("scaleout")
    return [exe] if exe else [sys.executable, "-u", "-m", "scaleout"]


class SlurmJob:
    """A submitted sbatch job. ``wait`` polls scontrol; Slurm does not say which rank failed, but
    the ranks' hang verdict in the job's output file (``log``), when there is one, names the root
    cause (scaleout/goodput/verdict.py)."""

    def __init__(
        self,
        job_id: int,
        env: Mapping[str, str],
        default_timeout_s: float,
        log: Path | None = None,
    ):
        self.job_id, self.env, self.default_timeout_s = job_id, env, default_timeout_s
        self.log = log

    def _verdict(self) -> str | None:
        if self.log is None:  # the output went to Slurm's default file: not looked for
            return None
        try:
            with open(self.log, errors="replace") as f:
                lines = [line.rstrip("\n") for line in f]
        except OSError:  # no output file
            return None
        verdict = first_verdict(lines)
        if verdict is None:
            return None
        return with_exits(verdict, srun_exits(lines))  # a silent rank srun saw end: crashed

    def stop(self) -> None:
        subprocess.run(
            ["scancel", str(self.job_id)], env=self.env, check=False, capture_output=True
        )

    def wait(self, timeout_s: float | None = None) -> LaunchResult:
        job = self.job_id
        # Queue wait included: by default up to 10x the time limit.
        deadline = time.monotonic() + (timeout_s or self.default_timeout_s)
        unknown_since: float | None = None
        try:
            while (state := job_state(job, self.env)) not in FINAL_STATES:
                now = time.monotonic()
                # UNKNOWN = scontrol cannot answer: the controller is gone or has forgotten the job.
                unknown_since = (unknown_since or now) if state == "UNKNOWN" else None
                if unknown_since is not None and now - unknown_since > UNKNOWN_GRACE_S:
                    return LaunchResult(
                        1,
                        None,
                        f"Slurm job {job}: no answer from scontrol for {UNKNOWN_GRACE_S:.0f} s "
                        f"(controller down?)",
                        "failed",
                    )
                if now > deadline:
                    self.stop()
                    return LaunchResult(
                        EXIT_TIMED_OUT,
                        None,
                        f"Slurm job {job} still {state} at the timeout; cancelled",
                        "timed_out",
                    )
                time.sleep(0.5)
        except BaseException:  # Ctrl-C / SIGTERM of the caller: do not leave the job running
            self.stop()
            raise
        code = job_info(job, env=self.env).get("ExitCode", "?")
        message = f"Slurm job {job} {state} (exit {code})"
        if state == "COMPLETED":
            return LaunchResult(0, None, message, "succeeded")
        verdict = self._verdict()
        if verdict is not None:  # the root cause first
            message = f"{verdict}; then {message}"
        return LaunchResult(
            1, None, message, "stopped" if state == "CANCELLED" else "failed", verdict
        )


@register
class SlurmLauncher(Launcher):
    """One ``sbatch -N nnodes --ntasks-per-node G --wrap "srun <argv>"`` job per start, on the
    cluster ``SLURM_CONF`` names (a real one, or the local one of ``scaleout slurm up``)."""

    name = "slurm"

    def __init__(
        self,
        partition: str | None = None,
        time_min: int = 30,
        gpus: bool = True,
        env: Mapping[str, str] | None = None,
        extra: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
    ):
        self.partition, self.time_min, self.gpus = partition, time_min, gpus
        self.env = (
            env  # None: this process's environment at submission (sbatch exports it to the job)
        )
        self.extra = list(extra)  # extra sbatch flags
        self.extra_env = dict(extra_env or {})

    @classmethod
    def from_options(cls, options: LaunchOptions) -> SlurmLauncher:
        if options.rate is not None:
            raise UserError("--netns works with --launcher local, not slurm")
        return cls(
            partition=options.partition,
            time_min=options.time_min,
            gpus=options.gpus,
            env=options.env,
            extra=sbatch_flags(options.slurm),
            extra_env=options.extra_env,
        )

    def check(self, shapes: Sequence[tuple[int, int]]) -> None:
        if shutil.which("sbatch") is None:
            raise UserError(
                "--launcher slurm: sbatch is not on PATH (is this a Slurm login node? for the "
                "local "
                "cluster: scaleout slurm up; export SLURM_CONF=/tmp/scaleout-slurm/etc/slurm.conf)"
            )

    def sbatch_args(
        self,
        argv: Sequence[str],
        nnodes: int,
        nproc_per_node: int,
        log: Path | None = None,
        name: str = "scaleout",
    ) -> list[str]:
        argv = list(argv)
        cmd = [*scaleout_command(), *argv[1:]] if argv[:1] == ["scaleout"] else argv
        # each task gets its share of the node's CPUs (launchers/cpus.py), not Slurm's default 1
        share = cpu_share_lines(nproc_per_node)
        srun = f'srun --kill-on-bad-exit=1 --cpus-per-task="${CPUS_VAR}" {shlex.join(cmd)}'
        args = ["-N", str(nnodes), "--ntasks-per-node", str(nproc_per_node), "--job-name", name]
        if log is not None:
            args += ["--output", str(log)]
        args += ["--time", str(self.time_min), "--chdir", os.getcwd()]
        if self.gpus:
            # every rank sees its node's GPUs: per-task device cgroups would block CUDA IPC / NVLink
            # P2P
            args.append(f"--gpus-per-node={nproc_per_node}")
            if "--exclusive" not in self.extra:  # whole nodes: their CPUs are the tasks' share
                args.append("--exclusive")
        if self.partition:
            args += ["--partition", self.partition]
        return [*args, *self.extra, "--wrap", "; ".join([*share, srun])]

    def start(
        self,
        argv: Sequence[str],
        nnodes: int,
        nproc_per_node: int,
        *,
        log: Path | None = None,
        name: str = "scaleout",
    ) -> SlurmJob:
        env = {**(os.environ if self.env is None else self.env), **self.extra_env}
        job = sbatch(self.sbatch_args(argv, nnodes, nproc_per_node, log, name), env=env)
        return SlurmJob(job, env, default_timeout_s=10 * 60 * self.time_min, log=log)
