"""Local launcher supervision with real processes: failures stop everyone, name the rank, leave
no orphans."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = str(Path(__file__).parents[1] / "scripts" / "rank_behaviour.py")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still answers kill(0); treat it as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _pids(pid_dir: Path, expect: int, timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(list(pid_dir.glob("*.pid"))) < expect:
        time.sleep(0.1)
    pids = []
    for f in sorted(pid_dir.glob("*.pid")):
        text = f.read_text().split()
        while len(text) < 2:  # written but not yet flushed
            time.sleep(0.05)
            text = f.read_text().split()
        pids += [int(x) for x in text]
    return pids


def _launch(tmp_path: Path, mode: str, extra_env=None, grace="2"):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    env = {**os.environ, "PID_DIR": str(pid_dir), **(extra_env or {})}
    cmd = [
        sys.executable,
        "-m",
        "scaleout",
        "launch",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--grace",
        grace,
        "--",
        SCRIPT,
        mode,
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, pid_dir


def _finish(proc, timeout=30.0):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


@pytest.mark.full_system
def test_all_ok_prefixes_output(tmp_path: Path) -> None:
    proc, pid_dir = _launch(tmp_path, "ok")
    code, out, err = _finish(proc)
    assert code == 0, err
    for rank in range(4):
        assert f"[rank {rank}] started node={rank // 2} local={rank % 2}" in out
    assert "all 4 ranks exited 0" in out


@pytest.mark.full_system
def test_rank_exit_code_stops_everyone(tmp_path: Path) -> None:
    proc, pid_dir = _launch(tmp_path, "exit3", {"TARGET": "2"})
    t0 = time.monotonic()
    pids = _pids(pid_dir, 4)
    code, out, err = _finish(proc)
    assert code == 3
    assert "rank 2 (node 1, local rank 0) exited with code 3" in err
    assert time.monotonic() - t0 < 15
    assert not [p for p in pids if _alive(p)], "processes left behind"


@pytest.mark.full_system
def test_last_line_names_the_verdicts_root_cause_and_a_shared_traceback_prints_once(
    tmp_path: Path,
) -> None:
    """Ranks 0, 1, 2 print the same traceback and the verdict naming rank 3; rank 1 exits first.
    The launcher's last line names rank 3 before rank 1 (before: only "rank 1 ... exited with
    code 1"), and the traceback is printed once, under one rank, the others' copies one line each
    (before: three copies)."""
    proc, pid_dir = _launch(tmp_path, "verdict", {"TARGET": "3"})
    pids = _pids(pid_dir, 4)
    code, out, err = _finish(proc)
    assert code == 1, err
    assert err.strip().splitlines()[-1] == (
        "scaleout launch: rank 3 (node 1, local rank 1) is behind: step 5 in data, collective #9 "
        "while the others are at #10 (step 5, grad-sync); then rank 1 (node 0, local rank 1) "
        "exited with code 1; stopped the other 3 running ranks"
    )
    assert out.count("Traceback (most recent call last):") == 1
    assert out.count("frame #0: c10::Error::Error()") == 1
    folded = re.findall(
        r"\[rank (\d)\] \(the same 6-line error block as \[rank (\d)\] above\)", out
    )
    shown = {first for _, first in folded}
    assert len(folded) == 2 and len(shown) == 1 and shown.isdisjoint(r for r, _ in folded), out
    assert "was the same on ranks 0,1,2" in out
    assert not [p for p in pids if _alive(p)]


@pytest.mark.full_system
def test_rank_killed_by_sigkill(tmp_path: Path) -> None:
    proc, pid_dir = _launch(tmp_path, "sleep")
    pids = _pids(pid_dir, 4)
    rank1_pid = int((pid_dir / "1.pid").read_text().split()[0])
    t0 = time.monotonic()
    os.kill(rank1_pid, signal.SIGKILL)
    code, out, err = _finish(proc)
    assert time.monotonic() - t0 < 10, "the other ranks must be stopped within 10 s"
    assert code != 0
    assert "rank 1 (node 0, local rank 1) was killed by SIGKILL" in err
    assert not [p for p in pids if _alive(p)]


@pytest.mark.full_system
@pytest.mark.parametrize("mode", ["sleep", "ignoreterm"])
def test_sigterm_to_launcher_stops_every_child(tmp_path: Path, mode: str) -> None:
    proc, pid_dir = _launch(tmp_path, mode, grace="1")
    pids = _pids(pid_dir, 4)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code, out, err = _finish(proc)
    assert code == 128 + signal.SIGTERM
    assert "received SIGTERM; stopped all 4 ranks" in err
    assert time.monotonic() - t0 < 10
    assert not [p for p in pids if _alive(p)]


@pytest.mark.full_system
def test_bad_command_is_one_line_error_before_spawn() -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "scaleout",
            "launch",
            "--nproc-per-node",
            "2",
            "--",
            "no-such-prog-xyz",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert (
        r.stderr.strip() == "scaleout launch: error: command 'no-such-prog-xyz' not found on PATH "
        "(expected a program, a .py file or a scaleout subcommand)"
    )


@pytest.mark.full_system
def test_smoke_job_two_nodes_two_procs() -> None:
    """The distributed smoke job end to end: World, groups and all-reduce checks on 2 x 2 real
    processes."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "scaleout",
            "launch",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "2",
            "--",
            "scaleout",
            "smoke",
            "--numel",
            "4096",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[rank 0]   world                : 4 ranks on 2 nodes, ranks per node [2, 2]" in r.stdout
    assert "torus 2x2" in r.stdout and "result               : OK" in r.stdout


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@pytest.mark.full_system
@pytest.mark.parametrize("mode", ["sleep", "ignoreterm"])
def test_sigkill_of_launcher_leaves_no_rank(tmp_path: Path, mode: str) -> None:
    """SIGKILL cannot be caught: the watchdog stops every rank and its children (SIGTERM, then
    SIGKILL after --grace 2 for a rank that ignores SIGTERM)."""
    proc, pid_dir = _launch(tmp_path, mode)
    pids = _pids(pid_dir, 4)
    t0 = time.monotonic()
    proc.kill()
    proc.communicate(timeout=30)
    left = _wait_gone(pids, 20)
    assert not left, f"processes left behind after SIGKILL of the launcher: {left}"
    assert time.monotonic() - t0 < 2 + 10  # grace + a loaded 2-core machine


@pytest.mark.full_system
def test_sighup_to_launcher_stops_every_child(tmp_path: Path) -> None:
    """A closed terminal or ssh session sends SIGHUP: the launcher stops the ranks instead of
    dying."""
    proc, pid_dir = _launch(tmp_path, "sleep")
    pids = _pids(pid_dir, 4)
    proc.send_signal(signal.SIGHUP)
    code, out, err = _finish(proc)
    assert code == 128 + signal.SIGHUP
    assert "received SIGHUP; stopped all 4 ranks" in err
    assert not _wait_gone(pids, 10)


CHATTY = """
import sys
line = "x" * 199 + "\\n"
# 200 kB per rank: more than a pipe holds (64 KiB), so a rank blocks if nobody reads
for i in range(1000):
    sys.stdout.write(f"{i} {line}")
sys.stdout.flush()
"""


@pytest.mark.full_system
def test_closed_stdout_does_not_hang(tmp_path: Path) -> None:
    """`scaleout launch ... | head -1`: after head exits, the ranks' output is drained and
    dropped and the launch ends with the ranks' exit code (before: the pump thread died and the
    ranks blocked forever)."""
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    launch = f"{sys.executable} -m scaleout launch --nnodes 1 --nproc-per-node 2 -- {script}"
    t0 = time.monotonic()
    r = subprocess.run(
        ["bash", "-c", f"{launch} | head -1; echo rc=${{PIPESTATUS[0]}}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.stdout.splitlines()[0].startswith("[rank ") and r.stdout.splitlines()[-1] == "rc=0", (
        r.stdout[-500:]
    )
    assert "BrokenPipe" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert time.monotonic() - t0 < 60


@pytest.mark.unit
def test_default_grace_fits_a_checkpoint() -> None:
    """torchrun waits 30 s and Slurm's KillWait default is 30 s; the launcher's default matches."""
    from scaleout.cli import build_parser
    from scaleout.launchers.local import DEFAULT_GRACE_S

    assert DEFAULT_GRACE_S == 30.0
    args = build_parser().parse_args(["launch", "--", "true"])
    assert args.grace == DEFAULT_GRACE_S


@pytest.mark.full_system
def test_local_launch_keeps_gloo_on_loopback(tmp_path: Path) -> None:
    script = tmp_path / "ifname.py"
    script.write_text("import os; print('IF', os.environ.get('GLOO_SOCKET_IFNAME'))\n")
    r = subprocess.run(
        [sys.executable, "-m", "scaleout", "launch", "--", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"},
    )
    assert r.returncode == 0, r.stderr
    from scaleout.env.addr import loopback_interface

    assert f"[rank 0] IF {loopback_interface()}" in r.stdout
