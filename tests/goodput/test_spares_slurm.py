"""Issue 28 items 4-5 on the real local Slurm with the real batch script
(slurm/bert_256node.sh under `scaleout slurm run`), shrunk to the tiny BERT config:

- spares: `sbatch -N 3 --ntasks-per-node 2 ... launch.nnodes=2`; the ranks of the step's second
  node are SIGSTOPped after the first checkpoint: the hang verdict names that node, it goes to
  runs/<name>/quarantine.json, a new step starts on the other two nodes in the same job (no
  requeue), resumes from the checkpoint and completes. The recovery time (fault -> next training
  step) is printed and kept in run.json.
- crash loop: a rank that raises at the same step on every attempt (SCALEOUT_INJECT_CRASH): after
  K=2 attempts the job stops with one line, is not requeued, and no node is quarantined (a
  software error names no node).
- no spares: the same SIGSTOP with -N 2 requeues the job with the node in its ExcNodeList
  (requeuehold, update, release); the requeued job resumes on two other nodes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import uuid
from pathlib import Path

import pytest

from scaleout.launchers.slurm import sbatch
from tests.goodput.test_preempt_slurm import _tiny
from tests.slurmutil import REPO, wait_for_text

SCRIPT = "slurm/bert_256node.sh"


def _submit(cluster, tmp: Path, name: str, nodes: int, overrides: list[str], env=None) -> int:
    job_env = {
        **cluster.env,
        "RUN_ROOT": str(tmp),
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO), cluster.env.get("PYTHONPATH", "")) if p
        ),
        **(env or {}),
    }
    return sbatch(
        [
            "--chdir",
            str(REPO),
            "-J",
            name,
            "-N",
            str(nodes),
            "--ntasks-per-node",
            "2",
            "-o",
            str(tmp / f"{name}.out"),
            SCRIPT,
            *overrides,
        ],
        env=job_env,
    )


def _node_processes(job: int, node: str) -> list[int]:
    """The live processes of job ``job``'s steps on emulated node ``node`` (by their environment;
    every emulated node is this host), slurmstepd excluded."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            comm = (d / "comm").read_text().strip()
        except OSError:
            continue
        if (
            f"SLURM_JOB_ID={job}".encode() in env
            and f"SLURMD_NODENAME={node}".encode() in env
            and b"SLURM_STEP_ID=batch" not in env
            and comm != "slurmstepd"
        ):
            found.append(int(d.name))
    return found


def _steps(overrides: list[str], **kw: object) -> list[str]:
    return [*overrides, *(f"{k.replace('__', '.')}={v}" for k, v in kw.items())]


def _hung_node_overrides(steps: int) -> list[str]:
    """A 2-node tiny run that checkpoints every 3 steps and times a silent peer out in 8 s."""
    return [
        *_tiny(),
        "launch.nnodes=2",
        f"train.max_steps={steps}",
        f"optim.total_steps={steps}",
        "optim.warmup_steps=2",
        "train.eval_every=1000",
        "train.target=null",
        "checkpoint.every_steps=3",
        "train.global_batch=16",
        "train.step_timeout_s=8",
    ]


@pytest.mark.slurm
@pytest.mark.drill  # minutes: `python3 -m pytest -m drill` (README, Tests)
@pytest.mark.timeout(900)
def test_sigstopped_node_is_quarantined_and_the_job_continues_on_the_spare(slurm_cluster, tmp_path):
    name = f"spare-{uuid.uuid4().hex[:6]}"
    steps = 30
    overrides = _hung_node_overrides(steps)
    job = _submit(slurm_cluster, tmp_path, name, 3, overrides)
    log, run_dir = tmp_path / f"{name}.out", tmp_path / name
    try:
        wait_for_text(log, r"checkpoint: step 3 ->", timeout_s=400)
        stopped = _node_processes(job, "n2")
        assert stopped, "no process of the step on n2"
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        t_fault = time.time()
        state = slurm_cluster.wait(job, timeout_s=600)
    finally:
        slurm_cluster.run(["scancel", str(job)], check=False)
    text = log.read_text()
    assert state == "COMPLETED", text[-5000:]
    assert slurm_cluster.info(job).get("Restarts") == "0"  # continued in the allocation
    q = json.loads((run_dir / "quarantine.json").read_text())
    assert list(q["nodes"]) == ["n2"], q
    assert q["nodes"]["n2"][0]["source"] == "heartbeat", q
    assert "node n2 quarantined" in text, text[-5000:]
    assert re.search(r"step on n1,n3 \(spares: none; quarantined: n2\)", text), text[-5000:]
    resumed = [int(s) for s in re.findall(r"resumed from .* at step (\d+)", text)]
    assert len(resumed) == 1 and resumed[0] >= 3, text[-5000:]
    record = json.loads((run_dir / "ckpt" / "run.json").read_text())
    first, second = record["attempts"]
    assert first["outcome"] == "died" and first["nodes"] == ["n1", "n2"]
    assert second["outcome"] == "completed" and second["nodes"] == ["n1", "n3"]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "max_steps", report["status"]
    # Recovery: from the SIGSTOP to the first training step of the new step, from rank 0's
    # metrics (wall times); the supervisor's own figure starts at the step's death.
    times = [
        json.loads(ln)["time"]
        for ln in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"type": "train"' in ln
    ]
    recovery = min(t for t in times if t > t_fault) - t_fault
    print(
        f"\n[spares] recovery: {recovery:.1f} s from SIGSTOP of n2 to the next training step "
        f"(of which {first['recovery_s']:.1f} s after the step's death; step timeout 8 s)"
    )
    assert recovery < 300


@pytest.mark.slurm
@pytest.mark.drill  # minutes: `python3 -m pytest -m drill` (README, Tests)
@pytest.mark.timeout(900)
def test_a_rank_crashing_at_the_same_step_stops_the_job_after_k_attempts(slurm_cluster, tmp_path):
    name = f"loop-{uuid.uuid4().hex[:6]}"
    overrides = [
        *_tiny(),
        "launch.nnodes=2",
        "train.max_steps=20",
        "train.eval_every=1000",
        "train.target=null",
        "checkpoint.every_steps=2",
        "train.global_batch=16",
        "train.step_timeout_s=8",  # the crashed rank's peers notice at the step timeout
        "launch.crash_loop=2",
    ]
    env = {"SCALEOUT_INJECT_CRASH": "3:1"}
    job = _submit(slurm_cluster, tmp_path, name, 2, overrides, env=env)
    log, run_dir = tmp_path / f"{name}.out", tmp_path / name
    try:
        state = slurm_cluster.wait(job, timeout_s=600)
    finally:
        slurm_cluster.run(["scancel", str(job)], check=False)
    text = log.read_text()
    assert state == "FAILED", text[-5000:]
    assert slurm_cluster.info(job).get("Restarts") == "0", text[-5000:]
    lines = re.findall(r"scaleout slurm run: (2 attempts died .*)", text)
    assert len(lines) == 1 and re.fullmatch(
        r"2 attempts died (at step 3 \(none got past the checkpoint at step 2\)|after step 2 "
        r"\(its checkpoint\) before the next checkpoint): stopping, not requeueing",
        lines[0],
    ), text[-5000:]
    assert "a software error, same nodes again" in text
    assert not (run_dir / "quarantine.json").exists()
    record = json.loads((run_dir / "ckpt" / "run.json").read_text())
    assert [a["outcome"] for a in record["attempts"]] == ["died", "died"]
    assert record["status"] == "crash_loop"


@pytest.mark.slurm
@pytest.mark.drill  # minutes: `python3 -m pytest -m drill` (README, Tests)
@pytest.mark.timeout(900)
def test_without_spares_a_hung_node_requeues_the_job_excluding_it(slurm_cluster, tmp_path):
    """-N 2 with launch.nnodes=2: no spare, so the SIGSTOPped node's quarantine requeues the job
    with ExcNodeList=n2; the requeued job runs on two other nodes and resumes."""
    name = f"noreq-{uuid.uuid4().hex[:6]}"
    steps = 30
    overrides = _hung_node_overrides(steps)
    job = _submit(slurm_cluster, tmp_path, name, 2, overrides)
    log, run_dir = tmp_path / f"{name}.out", tmp_path / name
    try:
        wait_for_text(log, r"checkpoint: step 3 ->", timeout_s=400)
        for pid in _node_processes(job, "n2"):
            os.kill(pid, signal.SIGSTOP)
        wait_for_text(log, r"requeued Slurm job \d+ excluding n2", timeout_s=300)
        slurm_cluster.release_requeued(job, restart=1, timeout_s=180)
        state = slurm_cluster.wait(job, timeout_s=600)
    finally:
        slurm_cluster.run(["scancel", str(job)], check=False)
    text = log.read_text()
    info = slurm_cluster.info(job)
    assert state == "COMPLETED" and info.get("ExcNodeList") == "n2", (info, text[-5000:])
    assert "n2" not in info.get("NodeList", ""), info
    assert re.search(r"restart 1: 2 nodes", text), text[-5000:]
    assert re.search(r"resumed from .* at step [1-9]", text), text[-5000:]
    assert list(json.loads((run_dir / "quarantine.json").read_text())["nodes"]) == ["n2"]
