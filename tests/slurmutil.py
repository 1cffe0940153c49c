"""Session fixture for the real local Slurm cluster (launchers/slurm_local) and job helpers for the
tests.

The cluster is started when it is not running and stopped at the end of the session only if this
session started it. A test module declares its fixture as

    @pytest.fixture(scope="session")
    def cluster():
        yield from slurmutil.cluster_session()
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from scaleout.errors import UserError
from scaleout.launchers.slurm import LocalSlurm, can_run_local_slurm, job_info, sbatch, wait_job

REPO = Path(__file__).resolve().parent.parent
# Launcher variables of the calling process must not leak into jobs (sbatch exports the
# environment).
_LEAKY = re.compile(
    r"^(SLURM_.*|SCALEOUT_(RANK|LOCAL_RANK|NODE_RANK|NNODES|NPROC_PER_NODE|WORLD_SIZE|ENV)|RANK|"
    r"LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_.*|"
    r"OMPI_.*|PMIX_.*|PMI_.*|HOROVOD_.*)$"
)


class Cluster:
    def __init__(self, local: LocalSlurm):
        self.local = local
        base = {k: v for k, v in os.environ.items() if not _LEAKY.match(k)}
        base["OMP_NUM_THREADS"] = "1"  # 2 cores shared by every rank of every emulated node
        self.env = local.env(base)

    def run(
        self, args: Sequence[str], timeout_s: float = 60, check: bool = True
    ) -> subprocess.CompletedProcess:
        p = subprocess.run(
            list(args), env=self.env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s
        )
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
        return p

    def sbatch(self, args: Sequence[str]) -> int:
        return sbatch(["--chdir", str(REPO), *args], env=self.env)

    def wait(self, job: int, timeout_s: float = 120, states: set[str] | None = None) -> str:
        return wait_job(job, env=self.env, timeout_s=timeout_s, states=states)

    def info(self, job: int) -> dict[str, str]:
        return job_info(job, env=self.env)

    def release_requeued(self, job: int, restart: int, timeout_s: float = 120) -> None:
        """Wait until ``job`` is back in the queue after its ``restart``-th requeue, then let it
        start now instead of after the cred_expire hold (11 s here, 121 s by default)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = self.info(job)
            if (
                info.get("JobState") == "PENDING"
                and int(info.get("Restarts", info.get("RestartCnt", "0"))) >= restart
            ):
                self.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], check=False)
                return
            if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"):
                raise AssertionError(
                    f"job {job} ended {info.get('JobState')} instead of being requeued"
                )
            time.sleep(0.2)
        raise AssertionError(f"job {job} not requeued within {timeout_s} s: {self.info(job)}")


def wait_for_text(path: Path, pattern: str, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if re.search(pattern, text):
            return text
        time.sleep(0.1)
    raise AssertionError(f"{pattern!r} did not appear in {path} within {timeout_s} s:\n{text}")


def _live_leases(leases: Path) -> list[Path]:
    live = []
    for f in leases.glob("*.lease"):
        try:
            os.kill(int(f.stem), 0)
            live.append(f)
        except (ValueError, ProcessLookupError):
            f.unlink(missing_ok=True)  # a session that died without cleaning up
        except PermissionError:
            live.append(f)
    return live


def cluster_session():
    """Generator body of a session fixture: start the cluster if needed, yield a Cluster, stop what
    we started.

    Several pytest sessions may share the cluster (engineers, or CI shards): each holds a lease file
    ($STATE/leases/<pid>.lease). The session that started the cluster stops it at its end only if no
    other session holds a lease; otherwise it leaves a marker and the last session out stops it.
    """
    why = can_run_local_slurm()
    if why:
        pytest.skip(why)
    local = LocalSlurm()
    leases = local.state / "leases"
    leases.mkdir(parents=True, exist_ok=True)
    mine = leases / f"{os.getpid()}.lease"
    mine.touch()
    marker = leases / "stop-when-last"
    t0 = time.monotonic()
    try:
        started = local.start(accounting=True, install=shutil.which("apt-get") is not None)
    except UserError as exc:
        mine.unlink(missing_ok=True)
        if "apt-get install failed" in str(exc) or "missing packages" in str(exc):
            pytest.skip(f"Slurm packages are not installed and could not be installed: {exc}")
        raise
    print(
        f"\n[slurm] local cluster {'started' if started else 'already running'} in "
        f"{time.monotonic() - t0:.1f} s "
        f"(SLURM_CONF={local.slurm_conf})"
    )
    try:
        yield Cluster(local)
    finally:
        mine.unlink(missing_ok=True)
        if started or marker.exists():
            if _live_leases(leases):
                marker.touch()  # others still use it: the last one out stops it
            else:
                marker.unlink(missing_ok=True)
                local.stop()
