"""Faults at scale, on real processes: a hung peer ends the job within the collective timeout (every
group has it, not only the default one), user scripts exit cleanly without an explicit close, reruns
and non-finite steps lose nothing.

The stuck-rank drill is the real thing: a 2 x 2 hierarchical `scaleout train` under `scaleout
launch`, one rank stuck in step 1 (asleep but alive, or SIGSTOPped); the job must end, non-zero,
its last line naming the stuck rank, well before torch's default 30-minute gloo timeout.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from distutil import run_dist

ROOT = Path(__file__).resolve().parents[2]


# -- every group gets the init / step timeouts
# --------------------------------------------------------
def _timeout_of(group) -> float:
    """The collective timeout gloo applies to ``group`` (what `_set_pg_timeout` changes)."""
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _group_timeouts(world) -> dict[str, list[float]]:
    t = world.torus(2, 2)
    before = [_timeout_of(g) for g in (world.group, world.intra, world.inter, t.row, t.col)]
    world.set_timeout(7)
    after = [_timeout_of(g) for g in (world.group, world.intra, world.inter, t.row, t.col)]
    later = world.partition(
        "bn-pairs", [[0, 3], [1, 2]]
    )  # a group built after set_timeout (group BN)
    return {"before": before, "after": after, "later": [_timeout_of(later)]}


@pytest.mark.multi_process
def test_every_group_gets_the_init_then_the_step_timeout() -> None:
    """Subgroups used to keep torch's 30-minute default whatever set_timeout said."""
    res = run_dist(_group_timeouts, 2, 2, fresh=True, timeout=180)
    for r in res:
        assert r["before"] == [600.0] * 5, r  # scaleout.init()'s init timeout, on the subgroups too
        assert r["after"] == [7.0] * 5 and r["later"] == [7.0], r


def _late_peer_in_intra(world, timeout_s: float, late_s: float) -> tuple[bool, float, str]:
    import torch.distributed as dist

    _ = world.intra, world.inter
    world.set_timeout(timeout_s)
    if world.rank == 3:
        time.sleep(late_s)
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4), group=world.intra)
        return False, time.monotonic() - t0, ""
    except RuntimeError as exc:
        return True, time.monotonic() - t0, str(exc).splitlines()[0]


@pytest.mark.multi_process
def test_hung_peer_in_a_subgroup_times_out_at_the_step_timeout() -> None:
    """Rank 3 reaches the intra-node all-reduce 12 s late; with a 3 s timeout its partner gives
    up in ~3 s (before: it waited the 30-minute default and succeeded when rank 3 arrived, at 12
    s)."""
    res = run_dist(_late_peer_in_intra, 2, 2, args=(3.0, 12.0), fresh=True, timeout=180)
    raised, waited, msg = res[2]
    assert raised and waited < 9.0, res[2]
    assert not res[0][0] and not res[1][0], res  # node 0's group was not affected


# -- a hung rank in a real training run
# ----------------------------------------------------------------
def _train_cmd(
    tmp: Path, *overrides: str, nnodes: int = 2, nproc: int = 2, grace: float | None = None
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "scaleout",
        "launch",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc),
        *(["--grace", str(grace)] if grace is not None else []),
        "--",
        "scaleout",
        "train",
        "bert_tiny_cpu",
        "train.global_batch=16",
        "data.eval_samples=32",
        "optim.warmup_steps=2",
        "optim.total_steps=8",
        "train.progress=false",
        f"train.output_dir={tmp / 'out'}",
        f"checkpoint.dir={tmp / 'ckpt'}",
        *overrides,
    ]


def _run(
    cmd: list[str], timeout: float = 400, env: dict | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def rank_pids(launcher_pid: int) -> dict[int, int]:
    """{rank: pid} of the launcher's children, from each child's SCALEOUT_RANK."""
    try:
        with open(f"/proc/{launcher_pid}/task/{launcher_pid}/children") as f:
            pids = [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return {}
    out = {}
    for pid in pids:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = next(
            (int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"SCALEOUT_RANK=")), None
        )
        if rank is not None:
            out[rank] = pid
    return out


_CAUSES = {
    # an alive rank stuck in forward: the one behind, against where the others wait
    ("hang", 3): r"rank 3 \(node 1, local rank 1\) is behind: step 1 in forward, collective "
    r"#(?P<behind>\d+) while the others are at #(?P<others>\d+) \(step 1, grad-sync\)",
    # a frozen rank: its heartbeat stopped
    # (the position is completed from the collective the live ranks wait in: issue 43 item 5)
    ("stop", 3): r"rank 3 \(node 1, local rank 1\) \(last seen at step [01] in [a-z-]+, "
    r"collective #\d+(; it then took part in every collective up to #\d+: the others wait for "
    r"it in #\d+ at step \d+, [a-z-]+)?\) sent no heartbeat for 2 s: stopped, hung or dead",
    # a frozen rank 0: the store it hosts does not answer either
    ("stop", 0): r"rank 0 \(node 0, local rank 0\), which hosts the rendezvous store, did not "
    r"answer \(.+\): stopped, hung or dead, or its host is unreachable",
}


@pytest.mark.full_system
@pytest.mark.parametrize(("fault", "victim"), list(_CAUSES))
def test_a_stuck_rank_ends_the_job_and_the_launchers_last_line_names_it(
    tmp_path: Path, fault: str, victim: int
) -> None:
    """2 x 2 hierarchical tiny BERT, train.step_timeout_s=2: one rank gets stuck when it enters
    step 1's forward (SCALEOUT_TEST_HANG: asleep with its heartbeat alive, or SIGSTOPped). The job
    must end within 60 s (before the step timeout: torch's 30-minute gloo default on the
    subgroups), non-zero, every reporting rank's verdict naming the stuck rank, and the launcher's
    LAST line naming it as the root cause before the rank that exited first (before: the last line
    named only the first rank to exit, one that merely timed out, and an alive stuck rank was
    named nowhere: "every rank's heartbeat is alive"). The launcher's --grace is 1 s: neither a
    sleeping nor a stopped rank acts on SIGTERM."""
    cmd = _train_cmd(
        tmp_path,
        "data.source=synthetic",  # starts faster than the pydoc corpus; the data do not matter
        "train.step_timeout_s=2",
        "train.max_steps=4",
        "train.eval_every=100000",
        grace=1,
    )
    env = {"SCALEOUT_TEST_HANG": f"1:{victim}:forward" + (":stop" if fault == "stop" else "")}
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **env},
    )
    try:
        text, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        text, _ = proc.communicate()
        pytest.fail(f"the job was still running after 300 s:\n{text[-3000:]}")
    lines = [x for x in text.splitlines() if x.strip()]
    assert proc.returncode != 0, text[-3000:]
    cause = _CAUSES[(fault, victim)]
    verdicts = [x for x in lines if ": verdict: " in x]
    assert verdicts and all(re.search(cause, x) for x in verdicts), text[-3000:]
    last = re.fullmatch(
        rf"scaleout launch: {cause}; then rank (?P<first>\d) \(node \d, local rank \d\) "
        r"exited with code 1; stopped the other \d running ranks",
        lines[-1],
    )
    assert last, lines[-3:]
    assert int(last["first"]) != victim  # the rank that exited first only timed out
    if fault == "hang":  # one collective short: the others issued step 1's bucket all-reduce
        assert int(last["behind"]) < int(last["others"]), lines[-1]
    assert not rank_pids(proc.pid)


# -- reruns lose nothing
# ---------------------------------------------------------------------------------
def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _one_line_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert all(n in lines[0] for n in needles), lines[0]
    return lines[0]


@pytest.mark.full_system
def test_rerun_policy_finished_resumed_refused(tmp_path: Path) -> None:
    """One checkpoint directory through its life, on 2 real ranks:
    1. a run to train.max_steps=2;
    2. the same command again: "already finished", exit 0, not one byte of output or checkpoint
       changes
       (before: it resumed, logged a second run_start..run_stop, overwrote report.json and saved
       ckpt-3);
    3. train.max_steps=4: resumes from step 2, says so in report.json and in the MLPerf log
       (init_checkpoint_step; the real compliance checker accepts the log), keeps segment 1's
       log/report;
    4. a changed global batch, and a non-resuming run in this directory: one-line errors, exit 2,
       before
       anything is spawned or written (launcher preflight), and also inside a rank started without
       it."""
    from scaleout.telemetry.mlperf import check_compliance, split_attempts

    flat = ["comm.algorithm=flat", "train.eval_every=2"]
    first = _run(_train_cmd(tmp_path, *flat, "train.max_steps=2", nnodes=1))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    record = json.loads((ckpt / "run.json").read_text())
    assert record["status"] == "max_steps" and record["step"] == 2 and record["global_batch"] == 16
    before = {"out": _snapshot(out), "ckpt": _snapshot(ckpt)}

    again = _run(_train_cmd(tmp_path, *flat, "train.max_steps=2", nnodes=1))
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "already finished" in again.stdout and "run_start" not in again.stdout
    assert {"out": _snapshot(out), "ckpt": _snapshot(ckpt)} == before

    more = _run(_train_cmd(tmp_path, *flat, "train.max_steps=4", nnodes=1))
    assert more.returncode == 0, more.stdout[-3000:] + more.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert (
        report["resumed_from_step"] == 2
        and report["steps"] == 2
        and report["run_id"] == record["run_id"]
    )
    log = (out / "mlperf.log").read_text()
    events = [json.loads(x.split(":::MLLOG", 1)[1]) for x in log.splitlines() if ":::MLLOG" in x]
    assert [e["value"] for e in events if e["key"] == "init_checkpoint_step"] == [2]
    ok, checker = check_compliance(out / "mlperf.log", "bert", quality_target=report["achieved"])
    assert ok, checker[-3000:]
    assert (
        (out / "mlperf.log").read_bytes().startswith(before["out"]["mlperf.log"])
    )  # segment 1, appended to
    assert len(split_attempts(log)) == 2
    assert (out / "report.json.1").read_bytes() == before["out"]["report.json"]
    assert json.loads((ckpt / "run.json").read_text())["segments"] == 2

    state = {"out": _snapshot(out), "ckpt": _snapshot(ckpt)}
    _one_line_error(
        _run(
            _train_cmd(tmp_path, *flat, "train.max_steps=6", "train.global_batch=32", nnodes=1),
            timeout=120,
        ),
        "train.global_batch=32",
        "batches of 16",
    )
    _one_line_error(
        _run(
            _train_cmd(tmp_path, *flat, "train.max_steps=6", "checkpoint.resume=false", nnodes=1),
            timeout=120,
        ),
        "already holds checkpoints up to step 4",
        "checkpoint.resume=true",
    )
    # the same refusal inside a rank that no launcher preflighted (srun, mpiexec, a single process)
    single = [
        sys.executable,
        "-m",
        "scaleout",
        "train",
        "bert_tiny_cpu",
        "launch.env=single",
        f"train.output_dir={out}",
        f"checkpoint.dir={ckpt}",
        "checkpoint.resume=false",
    ]
    _one_line_error(_run(single, timeout=120), "already holds checkpoints")
    assert {"out": _snapshot(out), "ckpt": _snapshot(ckpt)} == state


@pytest.mark.full_system
def test_abort_after_k_consecutive_nonfinite_steps(tmp_path: Path) -> None:
    """NaN gradients on rank 1 at steps 1, 3, 4 and 5 with train.max_consecutive_skips=3: every
    rank skips all four, the count restarts after the good step 2, and the run stops at step 5
    (status aborted, exit 1, MLPerf run_stop aborted) instead of skipping to train.max_steps."""
    r = _run(
        _train_cmd(
            tmp_path,
            "comm.algorithm=flat",
            "train.max_steps=12",
            "train.eval_every=12",
            "train.max_consecutive_skips=3",
            nnodes=1,
        ),
        env={"SCALEOUT_INJECT_NAN": "0:1,2:1,3:1,4:1"},
    )
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert (
        "step 5: 3 consecutive steps with non-finite gradients (train.max_consecutive_skips=3)"
        in r.stdout
    )
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["status"] == "aborted" and report["skipped_steps"] == 4 and report["steps"] == 5
    stop = [
        x for x in (tmp_path / "out" / "mlperf.log").read_text().splitlines() if '"run_stop"' in x
    ]
    assert len(stop) == 1 and '"status": "aborted"' in stop[0]


@pytest.mark.full_system
def test_a_rank_that_skips_alone_is_named_at_the_next_step(tmp_path: Path) -> None:
    """The step's agreement rides in the last gradient bucket, so "non-finite" is decided by each
    rank from its own reduced gradients (the same on every rank). A NaN that appears in rank 1's
    copy only, after the reduction (SCALEOUT_INJECT_NAN_REDUCED: a corrupted copy), makes rank 1
    alone skip step 1; the steps skipped so far ride in the next agreement's fingerprint, so
    step 2 names rank 1 on every rank (one line) instead of letting its replica drift."""
    r = _run(
        _train_cmd(
            tmp_path, "comm.algorithm=flat", "train.max_steps=6", "train.eval_every=6", nnodes=1
        ),
        env={"SCALEOUT_INJECT_NAN_REDUCED": "1:1"},
    )
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    line = next((x for x in out.splitlines() if "[rank 0]" in x and "(desync)" in x), "")
    assert "step 2: " in line and "rank 1 0x" in line and "rank 0 0x" not in line, out[-3000:]
    assert "1 steps skipped" in out and "skipped a step the others took" in line, line


# -- user scripts exit cleanly without close()
# -------------------------------------------------------
SCRIPT = ROOT / "tests" / "scripts" / "exit_without_close.py"


def _launch_script(*args: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "scaleout",
        "launch",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--",
        str(SCRIPT),
    ]
    return _run([*cmd, *args], timeout=300)


@pytest.mark.full_system
def test_exit_with_a_callback_still_running_is_orderly() -> None:
    """A done-callback of an all-reduce handle is still running on a gloo worker thread when the
    script ends: before, the interpreter finalized under it and every rank died with SIGABRT
    ("terminate called without an active exception"); scaleout.init()'s exit handler now joins
    those threads first."""
    r = _launch_script("flat", "0.5")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "terminate called" not in r.stdout + r.stderr
    assert r.stdout.count(": done") == 4


@pytest.mark.full_system
@pytest.mark.slow
def test_dataparallel_script_without_close_exits_0_every_time() -> None:
    """3 of 3 runs of a DataParallel script that never calls close() exit 0 on 2 x 2, every
    algorithm once (before: about 1 run in 10 to 1 in 6 died with SIGABRT at interpreter exit;
    the issue's bar was checked with 12 runs, here 3 keep the suite's time: a 1-in-6 failure
    still shows with probability 0.42 per suite run, and
    test_exit_with_a_callback_still_running_is_orderly makes the same exit certain instead of
    rare)."""
    failures = []
    for i in range(3):
        algorithm = ("flat", "hierarchical", "torus2d")[i % 3]
        r = _launch_script(algorithm)
        if r.returncode != 0:
            failures.append((i, algorithm, r.returncode, (r.stdout + r.stderr)[-500:]))
    assert not failures, failures
