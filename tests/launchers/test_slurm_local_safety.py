"""Safety of the local Slurm scripts (launchers/slurm_local): they run as root, so a planted state
folder, a stale PID file or a mistyped state path must never become root acting on someone else's
files or processes.

Only refusal paths and stop.sh against fake state folders run here: these never start a daemon and
never touch the shared cluster (its PIDs appear in no file these tests write). Real processes, real
files.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from scaleout.errors import UserError
from scaleout.launchers.slurm import HERE, LocalSlurm, _alive

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the local Slurm scripts run as root")
pytestmark = [pytestmark, pytest.mark.full_system]

START, STOP, COMMON = str(HERE / "start.sh"), str(HERE / "stop.sh"), str(HERE / "common.sh")
MARKER = ".scaleout-slurm-state"


def _run(
    script: str, state: Path, *args: str, hosts: Path | None = None
) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "SCALEOUT_SLURM_STATE": str(state),
        "SCALEOUT_SLURM_HOSTS": str(hosts or state.parent / "hosts"),
    }
    return subprocess.run([script, *args], env=env, capture_output=True, text=True, timeout=60)


def _make(tmp_path: Path, kind: str) -> Path:
    base = tmp_path / "base"
    base.mkdir(mode=0o755)
    os.chmod(base, 0o755)
    state = base / "state"
    if kind == "not-root":
        state.mkdir()
        os.chown(state, 65534, 65534)
    elif kind == "world-writable":
        state.mkdir()
        os.chmod(state, 0o777)
    elif kind == "symlink":
        (base / "real").mkdir()
        state.symlink_to(base / "real")
    elif (
        kind == "foreign"
    ):  # root's, safe mode, but somebody's data: no marker, not an earlier state
        (state / "spool").mkdir(parents=True)
        (state / "important.db").write_text("keep me")
    elif kind == "parent-not-sticky":
        os.chmod(base, 0o777)
        state.mkdir(mode=0o711)
    return state


@pytest.mark.parametrize(
    "kind, message",
    [
        ("not-root", "is owned by uid 65534, expected root (uid 0)"),
        ("world-writable", "has mode 777, expected no group/other write permission"),
        ("symlink", "is a symbolic link; expected a real folder owned by root"),
        ("foreign", f"is not empty and has no {MARKER}: not a scaleout Slurm state folder"),
        ("parent-not-sticky", "world-writable without the sticky bit"),
    ],
)
def test_start_refuses_unsafe_state_folder_before_anything(
    tmp_path: Path, kind: str, message: str
) -> None:
    state = _make(tmp_path, kind)
    before = sorted(p.name for p in state.iterdir()) if state.is_dir() else None
    r = _run(START, state, "--no-install", "--no-dbd")
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(state) in lines[0] and message in lines[0], r.stderr
    assert r.stdout == ""
    # Nothing written: no lock, no marker, no config, no munge key, no hosts entry.
    assert (sorted(p.name for p in state.iterdir()) if state.is_dir() else None) == before
    assert not (state.parent / "hosts").exists()


def test_stop_and_wipe_refuse_a_folder_without_marker(tmp_path: Path) -> None:
    state = _make(tmp_path, "foreign")
    (state / "run").mkdir()
    sleeper = subprocess.Popen(["sleep", "300"])
    try:
        (state / "run" / "slurmd-n1.pid").write_text(str(sleeper.pid))
        r = _run(STOP, state, "--wipe")
        assert (
            r.returncode == 2
            and f"has no {MARKER}" in r.stderr
            and len(r.stderr.strip().splitlines()) == 1
        )
        assert (state / "important.db").read_text() == "keep me" and (state / "spool").is_dir()
        assert sleeper.poll() is None
        with pytest.raises(UserError, match=f"has no {MARKER}"):
            LocalSlurm(str(state)).stop(wipe=True)
    finally:
        sleeper.kill()
        sleeper.wait()


def _fake_daemon(path: Path) -> subprocess.Popen:
    """A process whose /proc/<pid>/comm is path.name (a copy of sleep), with path in its command
    line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy("/bin/sleep", path)
    return subprocess.Popen([str(path), "300"])


def test_stop_signals_only_this_folders_daemons(tmp_path: Path) -> None:
    """PID files naming a plain `sleep`, a `slurmctld` of another folder and a `munged` of this
    folder: only the last is stopped. --wipe then deletes spool/run/log/mysql and keeps configs,
    key and marker."""
    base = tmp_path / "base"
    base.mkdir()
    state = base / "state"
    for sub in ("run/munge", "spool/ctld", "log", "mysql", "etc", "munge"):
        (state / sub).mkdir(parents=True)
    (state / MARKER).write_text("x")
    (state / "etc" / "slurm.conf").write_text("# config\n")
    procs = {
        "slurmd-n1.pid": subprocess.Popen(["sleep", "300"]),
        "slurmctld.pid": _fake_daemon(base / "elsewhere" / "slurmctld"),
        "munge/munged.pid": _fake_daemon(state / "bin" / "munged"),
    }
    try:
        deadline = time.monotonic() + 30
        while (
            time.monotonic() < deadline
            and Path(f"/proc/{procs['munge/munged.pid'].pid}/comm").read_text().strip() != "munged"
        ):
            time.sleep(0.05)
        for name, p in procs.items():
            (state / "run" / name).write_text(f"{p.pid}\n")
        assert (
            _alive(state / "run" / "slurmd-n1.pid", "slurmd") is None
        )  # status agrees: a sleep is no slurmd
        hosts = base / "hosts"
        r = _run(STOP, state, "--wipe", hosts=hosts)
        assert r.returncode == 0, r.stderr
        assert procs["slurmd-n1.pid"].poll() is None and procs["slurmctld.pid"].poll() is None
        assert procs["munge/munged.pid"].wait(timeout=30) == -signal.SIGTERM
        assert "names pid" in r.stdout and "left alone" in r.stdout
        assert sorted(p.name for p in state.iterdir()) == sorted(
            [".lock", MARKER, "bin", "etc", "munge"]
        )
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def _hosts(op: str, state: str, hosts: Path) -> None:
    env = {**os.environ, "S": state, "SCALEOUT_SLURM_HOSTS": str(hosts)}
    subprocess.run(["bash", "-c", f'. "{COMMON}"; {op}'], env=env, check=True, timeout=30)


def test_hosts_line_is_marked_added_once_and_removed_exactly(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    other = "127.0.0.1 n1 n2 n3 n4 # added by scaleout slurm_local for /elsewhere"
    original = f"127.0.0.1 localhost\n::1 localhost\n10.0.0.5 n1x\n{other}\n"
    hosts.write_text(original)
    _hosts("hosts_add; hosts_add", "/st", hosts)  # the other state's line does not count as ours
    ours = "127.0.0.1 n1 n2 n3 n4 # added by scaleout slurm_local for /st"
    assert hosts.read_text() == original + ours + "\n"
    _hosts("hosts_remove; hosts_remove", "/st", hosts)
    assert hosts.read_text() == original
    # Names that already resolve through a line scaleout did not write: nothing to add, nothing to
    # remove.
    legacy = "127.0.0.1 localhost\n127.0.0.1 n1 n2 n3 n4\n"
    hosts.write_text(legacy)
    _hosts("hosts_add", "/st", hosts)
    assert hosts.read_text() == legacy
    _hosts("hosts_remove", "/st", hosts)
    assert hosts.read_text() == legacy
