"""Ranks forked from the local launcher (launchers/forkrank.py) are the processes an exec would
start: the same session, descriptors, signal dispositions, environment, threads, ``sys.path``,
exit status and traceback. Each test runs the real launcher both ways (``SCALEOUT_LAUNCH_FORK=0``
is the exec) and compares what the ranks report about themselves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from scaleout import forksafe
from scaleout.launchers import forkrank
from scaleout.runlock import RunLock

SCRIPT = Path(__file__).parents[1] / "scripts" / "rank_facts.py"


def _launch(how: str, fork: bool) -> tuple[subprocess.CompletedProcess, int, dict[int, dict]]:
    env = {**os.environ, "SCALEOUT_LAUNCH_FORK": "1" if fork else "0", "FACTS_MARK": "m"}
    env.pop("OMP_NUM_THREADS", None)
    cmd = [sys.executable, "-m", "scaleout", "launch", "--nnodes", "1", "--nproc-per-node", "2"]
    proc = subprocess.Popen(
        [*cmd, "--", "python", str(SCRIPT), how],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(timeout=120)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    facts = {}
    for line in out.splitlines():
        if "FACTS " in line:
            f = json.loads(line.split("FACTS ", 1)[1])
            facts[int(f["rank"])] = f
    return done, proc.pid, facts


@pytest.mark.multi_process
def test_a_forked_rank_is_the_process_an_exec_would_start() -> None:
    forked, launcher, facts = _launch("ok", fork=True)
    execd, launcher_exec, facts_exec = _launch("ok", fork=False)
    assert forked.returncode == execd.returncode == 0, forked.stdout + forked.stderr
    assert sorted(facts) == sorted(facts_exec) == [0, 1]
    for rank in range(2):
        f, e = facts[rank], facts_exec[rank]
        assert f["start"] == "fork" and e["start"] == "exec (SCALEOUT_LAUNCH_FORK=0)", f["start"]
        # what tells the two apart: the fork keeps the launcher's command line
        assert f["cmdline"][:3] == ["-m", "scaleout", "launch"], f["cmdline"]
        assert e["cmdline"][:2] == ["-u", str(SCRIPT)], e["cmdline"]
        assert f["ppid"] == launcher and e["ppid"] == launcher_exec  # the launcher's own children
        for key in ("cmdline", "ppid", "start"):
            f.pop(key), e.pop(key)
        assert f == e, rank
        assert f["fds"] == [0, 1, 2] and f["stdin"] == "/dev/null" and f["own_session"]
        assert f["handlers"]["SIGTERM"] == repr(signal.SIG_DFL) and f["blocked"] == []
        assert f["torch_threads"] == int(f["omp"]) and f["env_from_launch"] == "m"


@pytest.mark.multi_process
def test_a_forked_rank_fails_as_an_exec_would() -> None:
    """Exit status and the traceback (no frame of the launcher's), both ways."""
    for how, code in (("exit3", 3), ("raise", 1)):
        forked, _, _ = _launch(how, fork=True)
        execd, _, _ = _launch(how, fork=False)
        assert forked.returncode == execd.returncode == code, (how, forked.stdout[-2000:])
        said = (forked.stdout + forked.stderr).splitlines()
        last = [ln for ln in said if ln.startswith("scaleout launch:")][-1]
        assert f"exited with code {code}" in last
        if how == "raise":

            def block(text: str) -> list[str]:
                lines = [ln.split("] ", 1)[1] for ln in text.splitlines() if ln.startswith("[rank")]
                return [ln for ln in lines if not ln.startswith(("FACTS", "(the same"))]

            assert block(forked.stdout) == block(execd.stdout), forked.stdout
            assert not any("forkrank" in ln or "runpy" in ln for ln in block(forked.stdout))


@pytest.mark.unit
def test_the_run_leases_renewal_thread_is_parked(tmp_path: Path) -> None:
    """``scaleout launch`` holds the run directory's lease with a renewal thread while its ranks
    start; that thread parks (scaleout.forksafe), so it does not turn the fork off."""
    lock = RunLock([tmp_path / "run"]).acquire()
    try:
        renewal = next(t for t in threading.enumerate() if t.name == "scaleout-runlock")
        deadline = time.monotonic() + 5
        while renewal in forksafe.unparked_threads() and time.monotonic() < deadline:
            time.sleep(0.01)  # it parks as its first step
        assert renewal not in forksafe.unparked_threads()
    finally:
        lock.release()


@pytest.mark.unit
def test_what_must_be_execd_is_execd() -> None:
    """The cases a fork would change, and the lease's renewal thread, which parks."""
    exe = [sys.executable, "-u"]
    env = dict(os.environ)
    assert "wrapper" in forkrank.why_not([*exe, "x.py"], env, True)
    assert "not a scaleout command" in forkrank.why_not(["/bin/echo", "hi"], env, False)
    assert "not a scaleout command" in forkrank.why_not([*exe, "-c", "pass"], env, False)
    assert "PYTHONPATH" in forkrank.why_not(
        [*exe, "x.py"], {**env, "PYTHONPATH": "/elsewhere"}, False
    )
    assert "LD_PRELOAD" in forkrank.why_not([*exe, "x.py"], {**env, "LD_PRELOAD": "x.so"}, False)
    assert forkrank.why_not([*exe, "x.py"], {**env, "SCALEOUT_LAUNCH_FORK": "0"}, False)

    stop = threading.Event()
    plain = threading.Thread(target=stop.wait, name="plain-thread", daemon=True)
    plain.start()
    try:
        assert "plain-thread" in forkrank.why_not([*exe, "x.py"], env, False)
    finally:
        stop.set()
        plain.join()

    def parked() -> None:
        forksafe.park()
        ready.set()
        stop2.wait()
        forksafe.unpark()

    ready, stop2 = threading.Event(), threading.Event()
    t = threading.Thread(target=parked, name="parked-thread", daemon=True)
    t.start()
    ready.wait(5)
    try:
        assert t not in forksafe.unparked_threads()
    finally:
        stop2.set()
        t.join()


@pytest.mark.unit
def test_after_a_parallel_torch_op_the_ranks_are_execd() -> None:
    """GNU libgomp does not survive a fork: a child forked after the parent's first parallel
    region hangs in its own. A launcher whose process made that pool execs its ranks (a fresh
    interpreter here: the pytest worker may hold one already)."""
    code = (
        "import os, sys, torch\n"
        "from scaleout.launchers import forkrank\n"
        "cmd = [sys.executable, '-u', 'x.py']\n"
        "print(forkrank.why_not(cmd, dict(os.environ), False))\n"
        "torch.set_num_threads(2)\n"
        "a = torch.randn(512, 512)\n"
        "(a @ a).sum()\n"
        "print(forkrank.why_not(cmd, dict(os.environ), False))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    before, after = r.stdout.splitlines()
    assert before == "None" and "native threads" in after, r.stdout
