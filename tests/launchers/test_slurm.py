"""Real Slurm: the local cluster (slurmctld + slurmdbd + 4 slurmd as nodes n1..n4), started by
the session fixture in tests/slurmutil.py when it is not running. Nothing here is mocked."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from scaleout.env.nodelist import expand_nodelist
from scaleout.errors import NodelistError
from tests.slurmutil import REPO, wait_for_text

pytestmark = pytest.mark.slurm
TRAIN = "tests/scripts/tiny_train.py"


NODELISTS = [
    "n1",
    "n[1-4]",
    "gpu[001-004,007]",
    "rack[1-2]-n[01-02]",
    "a,b[1-3],c-d",
    "node[9-11]",
    "x[08-10]",
    "dgx[1,3]-gpu[0-1]",
    "h[0-2],g[10-11]",
    "n[01-3]",
    "n[007]",
    "c[1-2,5-6],d",
]


def test_nodelist_matches_scontrol(slurm_cluster):
    for nodelist in NODELISTS:
        want = slurm_cluster.run(["scontrol", "show", "hostnames", nodelist]).stdout.split()
        assert expand_nodelist(nodelist) == want, nodelist
    # Both refuse a descending range. (Slurm 22.05 also refuses text after the last bracket,
    # 'n[1-2]x', which our parser accepts: a leniency on input Slurm never produces.)
    assert (
        "Invalid hostlist"
        in slurm_cluster.run(["scontrol", "show", "hostnames", "n[10-8]"], check=False).stderr
    )
    with pytest.raises(NodelistError, match="descending"):
        expand_nodelist("n[10-8]")


def test_production_scripts_shrink_on_the_command_line(slurm_cluster):
    """The 256-node headers are accepted on the 4-node cluster once -N/--ntasks-per-node override
    them."""
    for script, extra in [
        ("slurm/bert_256node.sh", []),
        ("slurm/resnet50_128node.sh", []),
        ("slurm/scaling_sweep.sh", ["--array=0-1"]),
    ]:
        p = slurm_cluster.run(
            ["sbatch", "--test-only", "-N", "2", "--ntasks-per-node", "2", *extra, script],
            check=False,
        )
        assert p.returncode == 0 and "to start at" in p.stderr, (script, p.stderr)
    # ... and without the override the real size is refused here: proof the header asks for 256
    # nodes.
    p = slurm_cluster.run(["sbatch", "--test-only", "slurm/bert_256node.sh"], check=False)
    assert p.returncode != 0 and "node" in p.stderr.lower()


def _worlds(text: str) -> list[dict]:
    return sorted(
        (json.loads(ln.split("WORLD ", 1)[1]) for ln in text.splitlines() if "WORLD " in ln),
        key=lambda r: r["rank"],
    )


def test_srun_environment_maps_to_world(slurm_cluster, tmp_path):
    """SLURM_* of srun tasks -> World on 2x2, 4x1 and an uneven 3-over-2 step; the batch script
    is not a rank."""
    jobs = {
        "2x2": slurm_cluster.sbatch(
            [
                "-N2",
                "--ntasks-per-node=2",
                "-o",
                f"{tmp_path}/2x2.out",
                "tests/scripts/batch_env.sh",
            ]
        ),
        "4x1": slurm_cluster.sbatch(
            [
                "-N4",
                "--ntasks-per-node=1",
                "-o",
                f"{tmp_path}/4x1.out",
                "--wrap",
                "srun python3 tests/scripts/world_report.py",
            ]
        ),
        "3on2": slurm_cluster.sbatch(
            [
                "-N2",
                "-n3",
                "-o",
                f"{tmp_path}/3on2.out",
                "--wrap",
                "srun python3 tests/scripts/world_report.py",
            ]
        ),
    }
    for name, job in jobs.items():
        assert slurm_cluster.wait(job, timeout_s=300) == "COMPLETED", (
            name,
            (tmp_path / f"{name}.out").read_text(),
        )
    out = (tmp_path / "2x2.out").read_text()
    assert "BATCH step_id=unset procid=0 env=single" in out, (
        out
    )  # SLURM_PROCID alone is not an srun task
    w = _worlds(out)
    assert [(r["rank"], r["node_rank"], r["local_rank"]) for r in w] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 1, 0),
        (3, 1, 1),
    ]
    assert all(
        r["launcher"] == "slurm"
        and r["num_nodes"] == 2
        and r["world_size"] == 4
        and r["allreduce_ok"]
        for r in w
    )
    assert {r["master_addr"] for r in w} == {
        "n1"
    }  # first host of the nodelist; resolves via /etc/hosts
    assert [r["slurmd_nodename"] for r in w] == ["n1", "n1", "n2", "n2"]
    assert w[0]["ranks_per_node"] == [[0, 1], [2, 3]]

    w = _worlds((tmp_path / "4x1.out").read_text())
    assert [(r["node_rank"], r["local_size"], r["slurmd_nodename"]) for r in w] == [
        (0, 1, "n1"),
        (1, 1, "n2"),
        (2, 1, "n3"),
        (3, 1, "n4"),
    ]
    assert all(r["num_nodes"] == 4 and r["allreduce_ok"] for r in w)

    w = _worlds((tmp_path / "3on2.out").read_text())  # SLURM_TASKS_PER_NODE=2,1
    assert [(r["node_rank"], r["local_size"]) for r in w] == [(0, 2), (0, 2), (1, 1)]
    assert w[0]["ranks_per_node"] == [[0, 1], [2]] and all(r["allreduce_ok"] for r in w)


def _one_rank_signalled(world):
    import os
    import signal

    from scaleout.goodput import preempt

    guard = preempt.install()
    try:
        before = guard.should_stop(world)
        if world.rank == 1:
            os.kill(os.getpid(), signal.SIGUSR2)  # only rank 1 gets the notice
        after = guard.should_stop(world)  # ... and every rank agrees to stop at this step
        return before, after, guard.wants_requeue, guard.terminating
    finally:
        guard.uninstall()


def test_preempt_notice_is_agreed_by_all_ranks():
    from tests.distutil import run_dist

    assert run_dist(_one_rank_signalled, 1, 2, timeout=300) == [(False, True, True, False)] * 2


def test_preempt_signals_and_requeue_outside_slurm():
    import signal

    from scaleout.errors import UserError
    from scaleout.goodput import preempt

    assert (
        preempt.signal_from_name("usr2") is signal.SIGUSR2
        and preempt.signal_from_name("SIGTERM") is signal.SIGTERM
    )
    with pytest.raises(UserError, match="'USR9'.*expected a signal name"):
        preempt.signal_from_name("USR9")
    with pytest.raises(UserError, match="both a notice and a terminate"):
        preempt.install(notice="TERM")
    prev = signal.getsignal(signal.SIGTERM)
    with preempt.install(notice="USR1") as guard:
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.terminating and guard.should_stop(None) and not guard.wants_requeue
    assert signal.getsignal(signal.SIGTERM) == prev  # handlers restored
    with preempt.install(
        notice="USR1"
    ) as guard:  # a notice, then the time limit's SIGTERM: still requeue
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.terminating and guard.wants_requeue
    assert preempt.requeue({}) is False and preempt.restart_count({"SLURM_RESTART_COUNT": "2"}) == 2


def _train_job(cluster, tmp: Path, name: str, steps: int) -> int:
    cmd = (
        f"srun python3 {TRAIN} --ckpt {tmp}/{name}-ckpt --out {tmp}/{name}.pt --steps {steps} "
        "--step-sleep 0.4"
    )
    return cluster.sbatch(
        [
            "-N2",
            "--ntasks-per-node=1",
            "--requeue",
            "--open-mode=append",
            "-J",
            name,
            "-o",
            f"{tmp}/{name}.out",
            "--wrap",
            cmd,
        ]
    )


def test_preemption_requeue_resumes_to_identical_weights(slurm_cluster, tmp_path):
    """Two preemptions on the real cluster, and the same run uninterrupted (scaleout launch, 2
    emulated nodes):
    - notice: SIGUSR2 to the tasks (what --signal=USR2@T sends) -> agreed stop, checkpoint, rank 0
      requeues;
    - terminate: `scontrol requeue` from outside -> SIGTERM -> rank 0 saves the last completed step.
    Both requeued jobs resume from their checkpoint and end with exactly the uninterrupted run's
    weights."""
    steps = 30
    usr2 = _train_job(slurm_cluster, tmp_path, "usr2", steps)
    term = _train_job(slurm_cluster, tmp_path, "term", steps)
    ref = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "scaleout",
            "launch",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--",
            "python",
            TRAIN,
            "--ckpt",
            f"{tmp_path}/ref-ckpt",
            "--out",
            f"{tmp_path}/ref.pt",
            "--steps",
            str(steps),
        ],
        cwd=REPO,
        env=slurm_cluster.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    wait_for_text(tmp_path / "usr2.out", r"step 6 ", timeout_s=300)
    slurm_cluster.run(["scancel", "--signal=USR2", str(usr2)])
    wait_for_text(tmp_path / "term.out", r"step 6 ", timeout_s=300)
    slurm_cluster.run(["scontrol", "requeue", str(term)])
    for job in (usr2, term):
        slurm_cluster.release_requeued(job, restart=1)
    for job, name in ((usr2, "usr2"), (term, "term")):
        assert slurm_cluster.wait(job, timeout_s=300) == "COMPLETED", (
            tmp_path / f"{name}.out"
        ).read_text()
    ref_out, _ = ref.communicate(timeout=300)
    assert ref.returncode == 0, ref_out

    usr2_log = (tmp_path / "usr2.out").read_text()
    assert "preempted by SIGUSR2" in usr2_log and "checkpoint step" in usr2_log
    term_log = (tmp_path / "term.out").read_text()
    assert "(SIGTERM)" in term_log, term_log
    reference = torch.load(tmp_path / "ref.pt", weights_only=True)
    for name, log in (("usr2", usr2_log), ("term", term_log)):
        resumed = [int(s) for s in re.findall(r"start step (\d+) restart 1", log)]
        assert len(resumed) == 2 and 0 < resumed[0] < steps, log  # both ranks resumed mid-run
        assert f"done {steps} steps" in log
        final = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        for key, value in reference.items():
            assert torch.equal(final[key], value), (
                f"{name}: {key} differs from the uninterrupted run"
            )
    assert slurm_cluster.info(usr2).get("Restarts") == "1"


def test_scancel_leaves_no_process(slurm_cluster, tmp_path):
    tag = f"scaleout-scancel-{uuid.uuid4().hex[:8]}"
    job = slurm_cluster.sbatch(
        [
            "-N2",
            "--ntasks-per-node=2",
            "-o",
            f"{tmp_path}/c.out",
            "--wrap",
            f"srun python3 -c 'import time; time.sleep(300)' {tag}",
        ]
    )

    def count() -> int:
        p = subprocess.run(["pgrep", "-f", tag], capture_output=True, text=True)
        return len(p.stdout.split())

    deadline = time.monotonic() + 60
    while count() < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert count() >= 4, "the 4 tasks never started"
    t0 = time.monotonic()
    slurm_cluster.run(["scancel", str(job)])
    while count() and time.monotonic() - t0 < 20:
        time.sleep(0.1)
    assert count() == 0, f"{count()} processes of job {job} survived scancel"
    assert slurm_cluster.wait(job, timeout_s=30) == "CANCELLED"


def test_submitit_job_on_two_nodes(slurm_cluster, tmp_path):
    """`scaleout submit` through submitit on the real cluster: 2 nodes x 2 tasks (GPUs emulated
    by the local cluster's gres), job id printed, rank 0's log followed, result collected from
    every task."""
    p = slurm_cluster.run(
        [
            sys.executable,
            "-m",
            "scaleout",
            "submit",
            "--command",
            "smoke --numel 1000",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "2",
            "--time",
            "5",
            "--folder",
            f"{tmp_path}/%j",
        ],
        timeout_s=240,
        check=False,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert re.search(r"submitted slurm job \d+: 2 node\(s\) x 2 task\(s\)", out), out
    assert (
        "launcher environment : slurm" in out and "4 ranks on 2 nodes, ranks per node [2, 2]" in out
    )
    assert re.search(r"job \d+: completed", out), out


def test_submit_rejects_bad_input(slurm_cluster):
    p = slurm_cluster.run(
        [sys.executable, "-m", "scaleout", "submit", "bert_tiny_cpu", "--nnodes", "0"], check=False
    )
    assert p.returncode == 2 and "--nnodes=0: expected an integer >= 1" in p.stderr
    p = slurm_cluster.run(
        [sys.executable, "-m", "scaleout", "submit", "c.yaml", "--array", "optim.lr"], check=False
    )
    assert p.returncode == 2 and "--array 'optim.lr': expected KEY=V1,V2" in p.stderr


def _flatten(prefix: str, obj) -> list[str]:
    if isinstance(obj, dict):
        return [s for k, v in obj.items() for s in _flatten(f"{prefix}{k}.", v)]
    value = (
        json.dumps(obj) if isinstance(obj, (list, tuple)) else ("null" if obj is None else str(obj))
    )
    return [f"{prefix[:-1]}={value}"]


def test_submitit_local_executor_without_slurm(tmp_path):
    """--executor local: submitit's local executor, its SUBMITIT_LOCAL_* variables mapped to
    scaleout's."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "SCALEOUT_", "OMPI_", "PMIX_"))
    }
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "scaleout",
            "submit",
            "--executor",
            "local",
            "--command",
            "smoke --numel 1000",
            "--nproc-per-node",
            "2",
            "--folder",
            f"{tmp_path}/%j",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert "submitted local job" in out and "launcher environment : local" in out
    assert "2 ranks on 1 nodes" in out and "result               : OK" in out


def test_time_limit_reached_when_slurmctld_does_not_answer(tmp_path, monkeypatch):
    """A loaded slurmctld times out exactly when jobs end: `scontrol` printing nothing must not make
    a notice
    + time-limit SIGTERM look like a scancel (the job then ended TIMEOUT without its requeue). The
      silent
    controller is a stand-in script (the real one cannot be made to time out on demand); a job in
    state
    TIMEOUT is read as such."""
    from scaleout.goodput import preempt

    fake = tmp_path / "scontrol"
    fake.write_text(
        "#!/bin/sh\necho 'slurm_load_jobs error: Socket timed out on send/recv operation' "
        ">&2\nexit 1\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert preempt.time_limit_reached({"SLURM_JOB_ID": "5"}, tries=2) is True
    fake.write_text("#!/bin/sh\necho 'JobId=5 JobState=TIMEOUT Reason=TimeLimit'\n")
    assert preempt.time_limit_reached({"SLURM_JOB_ID": "5"}, tries=1) is True
    fake.write_text(
        "#!/bin/sh\necho 'JobId=5 JobState=RUNNING RunTime=00:00:10 TimeLimit=00:05:00'\n"
    )
    assert preempt.time_limit_reached({"SLURM_JOB_ID": "5"}, tries=1) is False  # a scancel mid-run


def test_time_limit_reached_reads_the_job(slurm_cluster, tmp_path, monkeypatch):
    """preempt.time_limit_reached on a live job (RunTime < TimeLimit) and Slurm's duration
    formats."""
    from scaleout.goodput import preempt

    assert [
        preempt._slurm_seconds(t) for t in ("00:01:30", "1-02:00:00", "2", "05:07", "UNLIMITED", "")
    ] == [90, 93600, 120, 307, None, None]
    job = slurm_cluster.sbatch(["-N1", "--time=5", "-o", f"{tmp_path}/s.out", "--wrap", "sleep 60"])
    try:
        slurm_cluster.wait(job, timeout_s=60, states={"RUNNING"})
        monkeypatch.setenv("SLURM_CONF", slurm_cluster.env["SLURM_CONF"])
        info = slurm_cluster.info(job)
        assert info["TimeLimit"] == "00:05:00" and preempt._slurm_seconds(info["RunTime"]) < 300
        assert preempt.time_limit_reached({"SLURM_JOB_ID": str(job)}) is False
        assert preempt.time_limit_reached({}) is False  # not in a job
    finally:
        slurm_cluster.run(["scancel", str(job)], check=False)
