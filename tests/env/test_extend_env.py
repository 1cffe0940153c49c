"""Adding a launcher environment (and a launcher) is one file: this one (docs/extending.md).

A toy PBS-like environment registers itself here and goes through the real path: detection by
priority, ``read`` -> WorldSpec, the config accepting ``launch.env=pbs``, ``scaleout.init()``
building a World from it; a toy launcher registers, starts ranks that read the toy environment and
names the one that failed. Both are unregistered at the end, so no other test sees them.
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

import scaleout
from scaleout.cli import smoke
from scaleout.config import load_config
from scaleout.env import (
    ENVIRONMENTS,
    Environment,
    WorldSpec,
    detect_environment,
    detection_order,
    rank_variables,
    register,
)
from scaleout.env.base import free_port, master
from scaleout.errors import ConfigError, LaunchEnvError
from scaleout.launchers import LAUNCHERS, Launcher, LaunchOptions, LaunchResult, make_launcher
from scaleout.launchers import register as register_launcher
from scaleout.launchers.base import RankExit

PBS_VARS = {
    "rank": "PBS_TASKNUM",
    "node_rank": "PBS_NODENUM",
    "num_nodes": "PBS_NUM_NODES",
    "local_size": "PBS_NUM_PPN",
    "world_size": "PBS_NP",
}


class PbsEnv(Environment):
    """A PBS-ish job: global task number, node number, nodes, tasks per node, tasks."""

    name = "pbs"
    priority = 45  # after MPI (mpirun inside a PBS job sets both), before Slurm
    variables = PBS_VARS

    def detect(self, env: Mapping[str, str]) -> bool:
        return self.variables["rank"] in env

    def read(self, env: Mapping[str, str]) -> WorldSpec:
        v = self.read_ints(env)
        addr, port = master(env, self.name)
        return WorldSpec(
            **v,
            local_rank=v["rank"] % v["local_size"],
            master_addr=addr,
            master_port=port,
            launcher=self.name,
            tasks_per_node=(v["local_size"],) * v["num_nodes"],
        )


def pbs_env(rank: int, nnodes: int, nproc: int) -> dict[str, str]:
    values = dict(rank=rank, node_rank=rank // nproc, num_nodes=nnodes, local_size=nproc)
    return {PBS_VARS[k]: str(v) for k, v in {**values, "world_size": nnodes * nproc}.items()}


class InlineJob:
    """Ranks as threads of this process, each running ``python -c CODE`` with its own
    ``environ``."""

    def __init__(self, code: str, nnodes: int, nproc: int):
        self.nproc = nproc
        self.codes: dict[int, int] = {}
        self.threads = [
            threading.Thread(target=self._rank, args=(code, r, pbs_env(r, nnodes, nproc)))
            for r in range(nnodes * nproc)
        ]
        for t in self.threads:
            t.start()

    def _rank(self, code: str, rank: int, environ: dict[str, str]) -> None:
        try:
            exec(code, {"environ": environ})
            self.codes[rank] = 0
        except SystemExit as exc:
            self.codes[rank] = int(exc.code or 0)

    def stop(self) -> None:
        pass

    def wait(self, timeout_s: float | None = None) -> LaunchResult:
        for t in self.threads:
            t.join(timeout_s)
        bad = sorted(r for r, c in self.codes.items() if c != 0)
        if not bad:
            return LaunchResult(0, None, f"all {len(self.threads)} ranks exited 0", "succeeded")
        failed = RankExit.of(bad[0], self.nproc, self.codes[bad[0]])
        return LaunchResult(1, failed, failed.describe(), "failed")


class InlineLauncher(Launcher):
    name = "inline"

    @classmethod
    def from_options(cls, options: LaunchOptions) -> InlineLauncher:
        return cls()

    def start(
        self,
        argv: Sequence[str],
        nnodes: int,
        nproc_per_node: int,
        *,
        log: Path | None = None,
        name: str = "scaleout",
    ) -> InlineJob:
        assert list(argv[:2]) == ["python", "-c"], argv
        return InlineJob(argv[2], nnodes, nproc_per_node)


@pytest.fixture(autouse=True)
def toys() -> Iterator[None]:
    register(PbsEnv)
    register_launcher(InlineLauncher)
    try:
        yield
    finally:
        ENVIRONMENTS.unregister("pbs")
        LAUNCHERS.unregister("inline")


@pytest.mark.unit
def test_detected_by_priority_and_read() -> None:
    assert detection_order() == ("local", "torchrun", "horovod", "mpi", "pbs", "slurm", "single")
    env = pbs_env(5, nnodes=2, nproc=4)
    spec = detect_environment(env).read(env)
    assert (spec.rank, spec.local_rank, spec.node_rank, spec.num_nodes, spec.world_size) == (
        5,
        1,
        1,
        2,
        8,
    )
    assert spec.launcher == "pbs" and spec.tasks_per_node == (4, 4)
    slurm = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0"}
    assert detect_environment({**env, **slurm}).name == "pbs"  # 45 before slurm's 50
    assert detect_environment({**env, "OMPI_COMM_WORLD_RANK": "0"}).name == "mpi"  # 40 first
    with pytest.raises(LaunchEnvError, match="pbs environment: PBS_NP is not set"):
        PbsEnv().read({k: v for k, v in env.items() if k != "PBS_NP"})
    # scaleout.log finds the rank before any World exists
    assert "PBS_TASKNUM" in rank_variables()


@pytest.mark.unit
def test_the_config_and_the_cli_accept_it() -> None:
    assert load_config(None, ["launch.env=pbs"]).launch.env == "pbs"
    parser = argparse.ArgumentParser()
    smoke.add_arguments(parser)  # scaleout smoke --env's help lists the registered environments
    assert "pbs, slurm, single" in " ".join(parser.format_help().split())


@pytest.mark.unit
def test_a_toy_launcher_runs_ranks_and_names_the_failed_one() -> None:
    code = (
        "from scaleout.env import detect_environment\n"
        "spec = detect_environment(environ).read(environ)\n"
        "assert spec.launcher == 'pbs' and spec.world_size == 4\n"
        "raise SystemExit(7 if spec.rank == 2 else 0)\n"
    )
    launcher = make_launcher("inline", LaunchOptions())
    with launcher:
        result = launcher.start(["python", "-c", code], 2, 2).wait(timeout_s=30)
    assert result.state == "failed" and result.failed == RankExit(2, 1, 0, 7)
    assert result.message == "rank 2 (node 1, local rank 0) exited with code 7"
    ok = launcher.start(["python", "-c", "pass"], 1, 2).wait()
    assert ok.ok and ok.failed is None


@pytest.mark.multi_process
def test_init_builds_a_world_from_it() -> None:
    """scaleout.init() through the toy environment: a one-process world (a real gloo process
    group)."""
    cfg = load_config(None, ["launch.env=pbs"])
    env = {**pbs_env(0, 1, 1), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    world = scaleout.init(cfg, env=env)
    try:
        assert (world.launcher, world.rank, world.world_size, world.num_nodes) == ("pbs", 0, 1, 1)
    finally:
        world.close()


@pytest.mark.unit
def test_unregistered_it_is_gone() -> None:
    """After the toys are removed (as the fixture does at the end of every test) the names are
    free."""
    ENVIRONMENTS.unregister("pbs")
    LAUNCHERS.unregister("inline")
    assert "pbs" not in detection_order() and "inline" not in LAUNCHERS
    with pytest.raises(ConfigError, match="launch.env='pbs'"):
        load_config(None, ["launch.env=pbs"])
    register(PbsEnv)  # the fixture unregisters again
    register_launcher(InlineLauncher)
