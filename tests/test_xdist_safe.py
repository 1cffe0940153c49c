"""The suite's loadgroup scheduler survives a worker that dies (tests/xdist_safe.py): a real
pytest-xdist session of 2 workers in which one test kills its worker ends, reports that test
failed and runs every other test, the rest of the dead worker's group included, once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

CASE = """
import os, time, pytest

@pytest.mark.xdist_group("machine")
@pytest.mark.parametrize("i", range(4))
def test_group_before(i):
    time.sleep(0.2)

@pytest.mark.xdist_group("machine")
def test_group_dies():
    os._exit(1)

@pytest.mark.xdist_group("machine")
@pytest.mark.parametrize("i", range(3))
def test_group_after(i):
    open(os.environ["RAN"], "a").write(f"after{i}\\n")

@pytest.mark.parametrize("i", range(8))
def test_free(i):
    time.sleep(0.1)
"""


@pytest.mark.full_system
def test_a_dead_worker_does_not_hang_the_session(tmp_path: Path) -> None:
    (tmp_path / "test_case.py").write_text(CASE)
    ran = tmp_path / "ran.txt"
    env = {"PYTHONPATH": str(TESTS), "RAN": str(ran), "PATH": "/usr/bin:/bin"}
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "xdist_safe",
            "-n",
            "2",
            "--dist",
            "loadgroup",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            str(tmp_path / "test_case.py"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = p.stdout + p.stderr
    assert "node down" in out, out[-3000:]  # the worker did die
    assert "1 failed, 15 passed" in out, out[-3000:]
    assert "test_group_dies" in out
    assert sorted(ran.read_text().split()) == ["after0", "after1", "after2"], out[-3000:]
