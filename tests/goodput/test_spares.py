"""Issue 28 items 4-5 without a scheduler: the quarantine file, how `scaleout slurm run` names the
bad node of a failed step, the crash-loop guard, the verdict the ranks leave for it, run.json's
attempt history, and one-line errors. The drills on the real local Slurm:
tests/goodput/test_spares_slurm.py."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from scaleout.cli import main
from scaleout.config import load_config
from scaleout.env.base import WorldSpec
from scaleout.errors import UserError
from scaleout.goodput import quarantine
from scaleout.launchers.slurm_supervisor import (
    Allocation,
    bad_input,
    bad_nodes,
    choose_nodes,
    crash_loop,
    read_verdicts,
    replica_nodes,
)
from scaleout.train import replicas, rerun
from scaleout.train.faults import (
    CorruptInjection,
    CrashInjection,
    write_crash,
    write_replica_vote,
    write_verdict,
)
from scaleout.train.liveness import Heartbeat, period_for
from scaleout.world import World


@pytest.mark.unit
def test_quarantine_accumulates_merges_and_lists_exclusions(tmp_path):
    path = quarantine.path_for(tmp_path / "runs" / "r")
    assert quarantine.load(path) == {"nodes": {}} and quarantine.exclude_list(path) == []
    quarantine.record(path, [("n2", "no heartbeat from ranks [2, 3]")], "heartbeat")
    quarantine.record(path, [("n4", "link at 1/10"), ("n2", "link at 1/10")], "doctor")
    nodes = quarantine.load(path)["nodes"]
    assert [e["source"] for e in nodes["n2"]] == ["heartbeat", "doctor"]  # appended in order
    assert json.loads(path.read_text()) == {"nodes": nodes}
    other = quarantine.add({"nodes": {}}, "n1", "slow compute", "straggler")
    assert quarantine.exclude_list(quarantine.merge({"nodes": nodes}, other)) == ["n1", "n2", "n4"]
    path.write_text('{"nodes": ["n2"]}')
    with pytest.raises(UserError, match="quarantine.json"):
        quarantine.load(path)


@pytest.mark.unit
def test_the_bad_node_is_the_heartbeat_verdicts_else_srun_first_signal_death():
    step = ["n1", "n3"]
    verdicts = [{"rank": 0, "node": 0, "stale_ranks": [2, 3], "stale_nodes": [1], "text": "."}]
    assert list(bad_nodes(verdicts, step, [])) == ["n3"]
    assert bad_nodes(verdicts, step, [])["n3"][1] == "heartbeat"
    # An overloaded host starved every heartbeat (seen: all 4 ranks named): the writers' own node
    # is alive, so the node no rank reported from is the one.
    starved = [
        {"rank": r, "node": 0, "stale_ranks": [0, 1, 2, 3], "stale_nodes": [0, 1]} for r in (0, 1)
    ]
    assert list(bad_nodes(starved, step, [])) == ["n3"]
    killed = [
        "srun: error: n3: task 2: Killed",
        "srun: Force Terminated StepId=7.0",
        "srun: error: n1: tasks 0-1: Killed",  # srun's own doing (--kill-on-bad-exit)
    ]
    assert bad_nodes([], step, killed) == {"n3": ("task 2: Killed", "srun")}
    # A rank that exited with an error (a Python exception) names no node; nor does a verdict
    # in which every heartbeat is alive.
    crashed = ["srun: error: n1: task 1: Exited with exit code 1", *killed[1:]]
    everyone = [{"node": 0, "stale_ranks": [], "stale_nodes": []}, {"node": 1, "stale_nodes": []}]
    assert bad_nodes(everyone, step, crashed) == {}
    # A rank that raised (seen: rank 1 of n1) ends its heartbeat as it unwinds, and a peer's
    # verdict then names it: its own crash record says the step died of a software error.
    blamed = [
        {"rank": 2, "node": 1, "stale_ranks": [1], "stale_nodes": [0]},
        {"rank": 1, "node": 0, "crashed": "RuntimeError: injected crash at step 3"},
    ]
    assert bad_nodes(blamed, step, crashed) == {}
    assert list(bad_nodes(blamed[:1], step, crashed)) == ["n1"]
    # srun 22.05's own words when it ends the step (seen on the local cluster)
    real = [
        "srun: error: n1: task 0: Exited with exit code 2",
        "srun: launch/slurm: _step_signal: Terminating StepId=224.0",
        "srun: error: n2: task 3: Terminated",
    ]
    assert bad_nodes([], step, real) == {} and bad_input(real) and not bad_input(crashed)


@pytest.mark.unit
def test_verdicts_written_after_srun_ended_the_step_are_ignored(tmp_path):
    """Slurm wakes a stopped rank (SIGCONT) when it ends the step: that rank then blames rank 0,
    which had already exited (seen on the local cluster)."""
    (tmp_path / "rank0.json").write_text(json.dumps({"rank": 0, "node": 0, "time": 10.0}))
    (tmp_path / "rank2.json").write_text(json.dumps({"rank": 2, "node": 1, "time": 12.0}))
    assert [v["rank"] for v in read_verdicts(tmp_path, before=11.0)] == [0]
    assert [v["rank"] for v in read_verdicts(tmp_path)] == [0, 2]


@pytest.mark.unit
def test_crash_loop_guard_needs_k_deaths_without_progress():
    def died(progress: int, at: int) -> dict:
        return {"outcome": "died", "progress": progress, "died_at_step": at}

    assert crash_loop([died(40, 41), died(40, 41)], 3) is None
    assert crash_loop([died(20, 25), died(40, 41), died(40, 41)], 3) is None  # progress made
    assert crash_loop([died(40, 41), {"outcome": "stopped"}, died(40, 41)], 2) is None
    line = crash_loop([died(20, 25), died(40, 41), died(40, 43), died(40, 40)], 3)
    assert line == (
        "3 attempts died at step 43 (none got past the checkpoint at step 40): stopping, "
        "not requeueing"
    )
    assert crash_loop([died(6, 6), died(6, 6)], 2) == (
        "2 attempts died after step 6 (its checkpoint) before the next checkpoint: stopping, "
        "not requeueing"
    )


@pytest.mark.unit
def test_spares_and_quarantine_choose_the_step_nodes():
    alloc = Allocation.from_env(
        {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "2(x3)"}
    )
    assert (alloc.nodes, alloc.tasks_per_node) == (["n1", "n2", "n3"], 2)
    assert choose_nodes(alloc.nodes, set(), 2) == ["n1", "n2"]
    assert choose_nodes(alloc.nodes, {"n2", "n9"}, 2) == ["n1", "n3"]
    assert choose_nodes(alloc.nodes, {"n2", "n3"}, 2) is None  # -> requeue excluding them


@pytest.mark.unit
def test_a_failing_rank_leaves_the_stale_nodes_for_the_supervisor(tmp_path):
    spec = WorldSpec(1, 1, 0, 2, 2, 4, "127.0.0.1", 1, "slurm", tasks_per_node=(2, 2))
    world = World(spec, torch.device("cpu"), "gloo", node_of=(0, 0, 1, 1))
    write_verdict(world, "no heartbeat", [2, 3], env={"SCALEOUT_VERDICT_DIR": str(tmp_path)})
    got = json.loads((tmp_path / "rank1.json").read_text())
    want = {"rank": 1, "node": 0, "stale_ranks": [2, 3], "stale_nodes": [1], "text": "no heartbeat"}
    assert time.time() - got.pop("time") < 60 and got == want
    write_verdict(world, "x", [0], env={})  # no folder asked for: nothing written, no error
    assert [p.name for p in tmp_path.iterdir()] == ["rank1.json"]
    write_crash(world, RuntimeError("boom\nmore"), env={"SCALEOUT_VERDICT_DIR": str(tmp_path)})
    got = json.loads((tmp_path / "rank1.json").read_text())
    assert (got["node"], got["crashed"]) == (0, "RuntimeError: boom")


@pytest.mark.unit
def test_the_replica_vote_names_the_minority_and_the_supervisor_its_node(tmp_path):
    assert replicas.odd_ones_out([1.5, 1.5, 1.5]) is None
    assert replicas.odd_ones_out([1.5, 1.5, 2.0, 1.5]) == [2]
    assert replicas.odd_ones_out([1.0, 1.0, 2.0, 2.0]) == []  # a tie names nobody
    assert replicas.odd_ones_out([1.0, 2.0, 3.0]) == []
    vote = replicas.Vote(False, [2], [1])
    assert vote.sentence(4).startswith("replica vote: ranks [2] (node 1) hold weights that differ")
    spec = WorldSpec(0, 0, 0, 2, 2, 4, "127.0.0.1", 1, "slurm", tasks_per_node=(2, 2))
    world = World(spec, torch.device("cpu"), "gloo", node_of=(0, 0, 1, 1))
    env = {"SCALEOUT_VERDICT_DIR": str(tmp_path)}
    write_verdict(world, "no heartbeat", [3], env=env)  # rank 0's hang verdict is kept
    write_replica_vote(world, vote.sentence(4), [2], env=env)
    verdicts = read_verdicts(tmp_path)
    assert sorted(str(v.get("odd_nodes", "hang")) for v in verdicts) == ["[1]", "hang"]
    assert replica_nodes(verdicts, ["n3", "n5"]) == {"n5": vote.sentence(4)}
    assert replica_nodes([{"odd_nodes": [7]}], ["n3", "n5"]) == {}  # not a node of this step
    # the injection that makes such a replica: a finite change to the reduced gradient
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.zeros(3)
    hook = CorruptInjection.from_env(3, {"SCALEOUT_INJECT_CORRUPT": "2:3"})
    assert CorruptInjection.from_env(1, {"SCALEOUT_INJECT_CORRUPT": "2:3"}) is None
    hook(1, [p])
    assert p.grad.abs().sum() == 0
    hook(2, [p])
    assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


@pytest.mark.unit
def test_crash_injection_raises_on_its_rank_at_its_step():
    env = {"SCALEOUT_INJECT_CRASH": "3:1"}
    assert CrashInjection.from_env(0, env) is None
    hook = CrashInjection.from_env(1, env)
    hook(2, [])
    with pytest.raises(RuntimeError, match="injected crash at step 3"):
        hook(3, [])


@pytest.mark.unit
def test_a_new_start_keeps_the_attempt_history(tmp_path):
    """A restart before the first checkpoint is a "new" start: it must not erase the attempts
    the crash-loop guard counts (old code: record_start began from {})."""
    cfg = load_config("bert_tiny_cpu", [f"checkpoint.dir={tmp_path}"])
    attempts = [{"attempt": "5.0.1", "outcome": "died", "progress": 0}]
    rerun.write_record(tmp_path, {"status": "running", "attempts": attempts})
    start = rerun.decide_start(cfg)
    assert start.kind == "new"
    rerun.record_start(cfg, start, 4)
    assert rerun.read_record(tmp_path)["attempts"] == attempts


@pytest.mark.unit
def test_slurm_run_refuses_more_nodes_than_the_allocation(monkeypatch, capsys):
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2(x2)")
    argv = ["slurm", "run", "--", "scaleout", "train", "bert_tiny_cpu", "launch.nnodes=3"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "scaleout slurm: error: launch.nnodes=3 but the allocation has 2 nodes (n1,n2): "
        "expected launch.nnodes <= the sbatch -N (the rest are spares)"
    ]
    argv = ["slurm", "run", "--", "scaleout", "train", "bert_tiny_cpu", "launch.crash_loop=0"]
    assert main(argv) == 2
    assert "launch.crash_loop" in capsys.readouterr().err


@pytest.mark.unit
def test_kill_descendants_ends_children_and_grandchildren():
    """What a rank does before os._exit on a failed collective: its helpers (here a shell and
    its sleeping child, both ignoring SIGTERM as the data workers do) must not outlive it. Run in
    a child interpreter: in the test process it would kill pytest's own helpers too."""
    code = (
        "import subprocess, sys\n"
        "from scaleout.train.faults import kill_descendants\n"
        "p = subprocess.Popen(['bash', '-c', \"trap '' TERM; sleep 60 & echo $!; wait\"],"
        " stdout=subprocess.PIPE, text=True)\n"
        "grandchild = int(p.stdout.readline())\n"
        "n = kill_descendants()\n"
        "print(n, p.wait(timeout=10), grandchild)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    n, rc, grandchild = map(int, out)
    assert n >= 2 and rc == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{grandchild}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            break  # gone
        if state == "Z":
            break  # killed, not yet reaped by init
        time.sleep(0.05)
    else:
        pytest.fail(f"pid {grandchild} (the grandchild) still running")


@pytest.mark.unit
def test_heartbeat_follows_a_shortened_timeout_at_once():
    """After set_timeout() shortens the collective timeout (600 s -> 4 s: period 30 s -> 1 s), the
    next beat comes within a period or two, not after the 30 s wait begun under the init timeout
    (old code): a rank stopped right after the first step was otherwise judged with every other
    rank "stale" (seen in the spares drill: all 4 ranks named)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    spec = WorldSpec(0, 0, 0, 1, 2, 2, "127.0.0.1", store.port, "local", tasks_per_node=(2,))
    world = World(spec, torch.device("cpu"), "gloo", node_of=(0, 0), timeout_s=600.0)
    beat = Heartbeat(world, lambda: period_for(world.timeout_s))
    try:
        time.sleep(0.3)
        world.timeout_s = 4.0
        deadline = time.monotonic() + 4.0
        while store.get("scaleout/heartbeat/0") == b"0" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert store.get("scaleout/heartbeat/0") != b"0"
    finally:
        beat.close()


# What srun prints when a hung NCCL collective ends every rank through ProcessGroupNCCL's watchdog
# (TORCH_NCCL_ASYNC_ERROR_HANDLING=3: the rethrow in the watchdog thread ends in std::terminate),
# in the order the watchdogs fired: the first is a rank that waited the longest, i.e. a healthy one.
NCCL_TIMEOUT_SRUN = [
    "[rank1]:[E1206 18:00:01.000000 ProcessGroupNCCL.cpp:632] [PG ID 0 PG GUID 0(default_pg) "
    "Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=812, "
    "OpType=ALLREDUCE, NumelIn=16391, NumelOut=16391, Timeout(ms)=300000) ran for 300012 "
    "milliseconds before timing out.",
    "terminate called after throwing an instance of 'c10::DistBackendError'",
    "srun: error: n1: task 1: Aborted (core dumped)",
    "srun: launch/slurm: _step_signal: Terminating StepId=7.0",
    "srun: error: n3: tasks 2-3: Aborted (core dumped)",
]


@pytest.mark.unit
def test_an_nccl_watchdog_abort_without_a_verdict_names_no_node():
    """Every task aborted by NCCL's watchdog and no verdict in the folder (evidence missing): the
    supervisor names nobody. Before: the first "Aborted" task's host, a rank that only waited for
    the hung one, was quarantined at every hang (review gpu-day-two §2)."""
    assert bad_nodes([], ["n1", "n3"], NCCL_TIMEOUT_SRUN) == {}
    # a signal that is not the process aborting itself still names its node
    assert list(bad_nodes([], ["n1", "n3"], ["srun: error: n3: task 2: Bus error"])) == ["n3"]
