"""srun's PMI plugins on the real local Slurm (issue 26, item 1): ranks that `srun --mpi=pmix` or
`--mpi=pmi2` (or a cluster's `MpiDefault=pmix`) starts are Slurm ranks; an mpirun inside an
allocation is still MPI.

Before the fix every such rank was read as an MPI rank: under PMIx it died at `scaleout.init()`
("mpi environment: OMPI_COMM_WORLD_SIZE is not set"), under PMI2 it hung in Open MPI's init until
killed. PMIx needs Debian's libpmix2 + libpmix-dev (installed by `scripts/setup.sh --test` and by
the cluster's start.sh; a running slurmd picks the library up without a restart, since every step's
slurmstepd loads it). The emulated nodes share one host, so each has its own TmpFS
(launchers/slurm_local/slurm.conf.in): PMIx on several nodes. The variable sets of each launcher are
unit-tested in tests/env/test_env.py.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest

from scaleout.launchers.slurm import scaleout_command
from tests.launchers.test_mpi import MPIEXEC, needs_mpi
from tests.slurmutil import REPO

pytestmark = pytest.mark.slurm

# srun's own time limit (minutes): the code before the fix hung under PMI2 until Slurm killed the
# step.
TIME_LIMIT = "2"


def _smoke(cluster, mpi: str, nodes: int, per_node: int) -> str:
    p = cluster.run(
        [
            "srun",
            f"--mpi={mpi}",
            "-N",
            str(nodes),
            "--ntasks-per-node",
            str(per_node),
            f"--time={TIME_LIMIT}",
            "--kill-on-bad-exit=1",
            *scaleout_command(),
            "smoke",
            "--numel",
            "4096",
        ],
        timeout_s=240,
        check=False,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    return out


def _report(out: str, ranks: int, nodes: int) -> None:
    assert "launcher environment : slurm" in out, out[-3000:]
    assert f"world                : {ranks} ranks on {nodes} nodes" in out, out[-3000:]
    assert "result               : OK" in out, out[-3000:]


def test_pmix_is_usable(slurm_cluster):
    """The test set-up made PMIx work: `srun --mpi=list` lists it even without the library, so a
    step must actually start; every task sees PMIX_RANK = SLURM_PROCID (what the slurm reader
    relies on), on two emulated nodes (per-node TmpFS: without it the second node's step fails on
    /tmp/spmix_appdir_*)."""
    assert "pmix" in slurm_cluster.run(["srun", "--mpi=list"]).stdout
    line = 'echo "TASK $SLURM_PROCID $PMIX_RANK ${PMIX_SIZE-unset} ${OMPI_COMM_WORLD_SIZE-unset}"'
    p = slurm_cluster.run(
        ["srun", "--mpi=pmix", "-N", "2", "--ntasks-per-node", "2", "--time=1", "sh", "-c", line],
        timeout_s=120,
        check=False,
    )
    assert p.returncode == 0, (
        f"srun --mpi=pmix failed (is libpmix-dev installed? scripts/setup.sh --test):\n{p.stderr}"
    )
    tasks = sorted(ln.split()[1:] for ln in p.stdout.splitlines() if ln.startswith("TASK "))
    assert tasks == [[str(r), str(r), "unset", "unset"] for r in range(4)], p.stdout


def test_srun_mpi_pmix_smoke_one_node(slurm_cluster):
    """The issue's bar: `srun --mpi=pmix -N 1 --ntasks-per-node 4 scaleout smoke` passes."""
    _report(_smoke(slurm_cluster, "pmix", 1, 4), 4, 1)


def test_srun_mpi_pmix_smoke_two_nodes(slurm_cluster):
    _report(_smoke(slurm_cluster, "pmix", 2, 2), 4, 2)


def test_srun_mpi_pmi2_smoke_two_nodes(slurm_cluster):
    """The issue's bar: `srun --mpi=pmi2 -N 2 --ntasks-per-node 2 scaleout smoke` passes."""
    _report(_smoke(slurm_cluster, "pmi2", 2, 2), 4, 2)


@pytest.mark.extended  # minutes on 2 cores: python3 -m pytest -m extended (docs/testing.md)
@pytest.mark.timeout(900)
def test_bert_256node_sbatch_under_pmix(slurm_cluster, tmp_path):
    """`sbatch -N 2 --ntasks-per-node 2 slurm/bert_256node.sh <tiny overrides>` with srun's MPI
    type pmix (SLURM_MPI_TYPE, what `MpiDefault=pmix` gives every srun) and the environment
    detected, not forced: the job completes and the ranks were Slurm ranks."""
    from tests.goodput.test_preempt_slurm import _submit, _tiny

    overrides = [o for o in _tiny() if not o.startswith("launch.env=")] + [
        "train.max_steps=3",
        "train.eval_every=3",
        "train.target=null",
        "checkpoint.every_steps=100",
        "train.global_batch=16",
    ]
    name = f"pmix-{uuid.uuid4().hex[:6]}"
    log = tmp_path / "job.out"
    job = _submit(slurm_cluster, tmp_path, name, overrides, env={"SLURM_MPI_TYPE": "pmix"}, log=log)
    try:
        state = slurm_cluster.wait(job, timeout_s=600)
    finally:
        slurm_cluster.run(["scancel", str(job)], check=False)
    text = log.read_text() if log.exists() else ""
    assert state == "COMPLETED", text[-4000:]
    assert "OMPI_COMM_WORLD_SIZE" not in text, text[-4000:]
    report = json.loads((tmp_path / name / "report.json").read_text())
    assert report["status"] == "max_steps" and report["devices"] == 4, report  # ran to the end
    header = _metrics_header(tmp_path / name)
    assert header.get("launcher") == "slurm", header


def _metrics_header(run_dir: Path) -> dict:
    for f in sorted(run_dir.rglob("*.jsonl")):
        first = f.read_text().splitlines()[:1]
        if first and '"launcher"' in first[0]:
            return json.loads(first[0])
    return {}


@pytest.mark.mpi
@needs_mpi
def test_mpirun_inside_an_allocation_is_still_mpi(slurm_cluster):
    """Open MPI 5's mpiexec inside an allocation starts its daemons with srun, so every rank also
    has SLURM_PROCID/SLURM_STEP_ID (the daemon's) and PMIX_RANK (mpirun's own PMIx server): still
    an MPI rank."""
    env = {
        **slurm_cluster.env,
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
    }

    def in_allocation(*argv: str) -> str:
        p = subprocess.run(
            ["salloc", "-N", "1", "--ntasks-per-node", "2", "--time=2", MPIEXEC, "-n", "2", *argv],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
        return p.stdout + p.stderr

    # the premise: the ranks carry an srun task's variables and PMIX_RANK, as an srun --mpi=pmix
    # task does
    line = (
        'echo "RANK ${SLURM_PROCID-unset} ${SLURM_STEP_ID-unset} $PMIX_RANK $OMPI_COMM_WORLD_RANK"'
    )
    seen = sorted(
        ln.split()[1:]
        for ln in in_allocation("sh", "-c", line).splitlines()
        if ln.startswith("RANK ")
    )
    assert [r[2:] for r in seen] == [["0", "0"], ["1", "1"]] and "unset" not in str(seen), seen
    out = in_allocation(*scaleout_command(), "smoke", "--numel", "4096")
    assert "launcher environment : mpi" in out and "result               : OK" in out, out[-3000:]
