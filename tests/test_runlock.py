"""One owner per run directory (scaleout/runlock.py, scaleout/train/rundirs.py): the lease, who may
take it over (a stale holder, the same Slurm job, the launcher above a rank), and two real launches
on the same directories: the second stops in one line before writing, the first finishes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scaleout import runlock
from scaleout.config import load_config
from scaleout.errors import UserError
from scaleout.runlock import LOCK_NAME, Owner, RunDirBusy, RunLock, acquire_one
from scaleout.train import rundirs

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "scaleout" / "configs" / "bert_tiny_cpu.yaml")


def _owner(job: str, host: str = "node-a", pid: int = 4242) -> Owner:
    return Owner(job, host, pid, os.urandom(8).hex())


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.unit
def test_a_held_directory_is_refused_in_one_line_naming_the_holder(tmp_path):
    acquire_one(tmp_path, _owner("slurm:111", "node-a", 4242))
    with pytest.raises(RunDirBusy) as err:
        acquire_one(tmp_path, _owner("slurm:222", "node-b", 99))
    line = str(err.value)
    assert "\n" not in line
    assert "slurm:111" in line and "node-a" in line and "4242" in line and str(tmp_path) in line
    assert json.loads((tmp_path / LOCK_NAME).read_text())["job"] == "slurm:111"  # untouched


@pytest.mark.unit
def test_the_same_slurm_job_takes_its_lease_over(tmp_path):
    """A requeue, or a spare of the same allocation: another host and pid, the same job id."""
    acquire_one(tmp_path, _owner("slurm:7", "node-a", 11))
    again = _owner("slurm:7", "node-c", 12)
    acquire_one(tmp_path, again)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == again.token


@pytest.mark.unit
def test_a_lease_not_renewed_for_longer_than_its_term_is_taken_over(tmp_path):
    acquire_one(tmp_path, _owner("slurm:1", "node-far", 5))
    old = time.time() - runlock.LEASE_S - 30
    os.utime(tmp_path / LOCK_NAME, (old, old))
    me = _owner("slurm:2")
    acquire_one(tmp_path, me)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == me.token
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]  # no debris of the break


@pytest.mark.unit
def test_a_holder_on_this_host_whose_process_is_gone_is_stale_at_once(tmp_path):
    """A killed launcher on this host: no need to wait out the lease."""
    acquire_one(tmp_path, _owner("local:x", socket.gethostname(), _dead_pid()))
    me = _owner("local:y")
    acquire_one(tmp_path, me)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == me.token


@pytest.mark.unit
def test_the_lease_is_renewed_while_held_and_removed_at_release(tmp_path, monkeypatch):
    monkeypatch.setattr(runlock, "LEASE_S", 0.4)  # renewed every 0.1 s
    lock = RunLock([tmp_path / "a", tmp_path / "b"]).acquire()
    first = (tmp_path / "a" / LOCK_NAME).stat().st_mtime
    time.sleep(0.5)
    assert (tmp_path / "a" / LOCK_NAME).stat().st_mtime > first
    lock.release()
    assert not (tmp_path / "a" / LOCK_NAME).exists() and not (tmp_path / "b" / LOCK_NAME).exists()


@pytest.mark.unit
def test_a_refused_second_directory_releases_the_first(tmp_path):
    acquire_one(tmp_path / "ckpt", _owner("slurm:1"))
    with pytest.raises(RunDirBusy):
        RunLock([tmp_path / "out", tmp_path / "ckpt"], _owner("slurm:2", pid=99)).acquire()
    assert not (tmp_path / "out").exists()  # nor the folder the lease made for itself


@pytest.mark.unit
def test_a_rank_accepts_the_lease_of_the_launcher_above_it(tmp_path):
    """The launcher holds the lease; its rank (a child process) sees it as its own job's."""
    cfg = load_config(TINY, [f"train.output_dir={tmp_path}/out", f"checkpoint.dir={tmp_path}/ck"])
    lock = runlock.hold_for_process(cfg)
    code = (
        "import sys; from scaleout.config import load_config; from scaleout import runlock; "
        f"cfg = load_config({TINY!r}, sys.argv[1:]); print(runlock.held_by_us(cfg))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SLURM_JOB_ID", None)
    args = [f"train.output_dir={tmp_path}/out", f"checkpoint.dir={tmp_path}/ck"]
    try:
        out = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True)
        holder = json.loads((tmp_path / "out" / LOCK_NAME).read_text())
    finally:
        lock.release()
        runlock._held.clear()
    assert out.stdout.decode().strip() == "True", out.stderr.decode()[-2000:]
    assert holder["pid"] == os.getpid()
    # a process of another job elsewhere is not the holder's
    assert not runlock.is_ours(holder, _owner("local:other", "elsewhere"))


@pytest.mark.unit
def test_an_empty_output_dir_is_refused_before_spawning(tmp_path):
    from scaleout.cli import preflight

    for empty in ("", "  "):
        with pytest.raises(UserError, match="train.output_dir="):
            argv = ["train", TINY, f"train.output_dir={empty}", f"checkpoint.dir={tmp_path}"]
            preflight(argv, 1, 1)


@pytest.mark.unit
def test_the_next_start_removes_the_temp_files_of_a_killed_write(tmp_path):
    out, ck = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    ck.mkdir()
    debris = [
        ck / "ckpt-00000010.pt.4242-0a1b2c3d.tmp",  # a checkpoint write killed half-way
        ck / "run.json.77-deadbeef.tmp",
        out / "metrics.png.5-00ff00ff.tmp.png",  # a keep_suffix temp file
        out / f"{LOCK_NAME}.0123456789abcdef.tmp",
    ]
    kept = [ck / "ckpt-00000005.pt", ck / "notes.tmp", out / "report.json"]
    for p in debris + kept:
        p.write_bytes(b"x" * 10)
    cfg = load_config(TINY, [f"train.output_dir={out}", f"checkpoint.dir={ck}"])
    assert sorted(rundirs.remove_debris(cfg)) == sorted(debris)
    assert all(p.exists() for p in kept) and not any(p.exists() for p in debris)


@pytest.mark.multi_process
def test_a_second_launch_on_a_held_run_directory_stops_before_writing(tmp_path):
    """Two real launches of bert_tiny_cpu on the same directories: the second stops in one line
    (exit 2, nothing spawned) while the first holds them; the first finishes with its report."""
    out, ck = tmp_path / "out", tmp_path / "ckpt"
    argv = [
        sys.executable, "-m", "scaleout", "launch", "--nnodes", "1", "--nproc-per-node", "1",
        "--", "scaleout", "train", TINY, f"train.output_dir={out}", f"checkpoint.dir={ck}",
        "train.max_steps=2", "checkpoint.every_steps=1", "train.target=null",
        "train.eval_every=1000", "train.progress=false", "train.global_batch=4",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SLURM_JOB_ID", None)
    # the first run's saves take 3 s more each: it surely still runs when the second starts
    slow = {**env, "SCALEOUT_TEST_SLOW_SAVE_S": "3"}
    first = subprocess.Popen(argv, env=slow, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (ck / LOCK_NAME).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (ck / LOCK_NAME).exists(), "the first launch never took the lease"
        second = subprocess.run(argv, env=env, capture_output=True, timeout=120)
        assert first.poll() is None, "the first run ended before the second started: no overlap"
        err = second.stderr.decode().strip()
        assert second.returncode == 2, (second.returncode, err[-2000:])
        assert len(err.splitlines()) == 1 and "in use by job local:" in err, err[-2000:]
        assert "[rank" not in second.stdout.decode()  # nothing was spawned
        text, _ = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, text.decode()[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report and not list(out.glob("report.json.*"))  # one report, none set aside
    assert not (out / LOCK_NAME).exists() and not (ck / LOCK_NAME).exists()  # released


@pytest.mark.unit
def test_a_directory_where_no_lease_can_be_written_is_one_line(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    with pytest.raises(runlock.LeaseUnwritable) as err:
        RunLock([tmp_path / "ok", plain / "out"]).acquire()
    assert str(plain / "out") in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "ok" / LOCK_NAME).exists()  # the first one given back
