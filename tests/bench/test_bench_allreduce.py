"""`scaleout bench allreduce` speaks nccl-tests: -b/-e/-f/-n/-w/-d, time in us, count, type,
#wrong from an in-place check, and an `# Avg bus bandwidth` line (a real 2-rank gloo run, plus
the check's arithmetic)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scaleout.argtypes import parse_size
from scaleout.bench._nccl_style import count_wrong, fill, size_range
from scaleout.errors import UserError


@pytest.mark.unit
def test_size_range_is_nccl_tests() -> None:
    assert size_range(parse_size("8"), parse_size("128"), 2) == [8, 16, 32, 64, 128]
    assert size_range(parse_size("1K"), parse_size("1M"), 32) == [1024, 32768, 1048576]
    assert size_range(parse_size("4M"), parse_size("4M"), 2) == [4 << 20]
    with pytest.raises(UserError, match="expected 1 <= minbytes <= maxbytes"):
        size_range(64, 8, 2)
    with pytest.raises(UserError, match="-f 1: expected a step factor >= 2"):
        size_range(8, 64, 1)


@pytest.mark.multi_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_count_wrong_finds_corrupted_elements(dtype: torch.dtype) -> None:
    p, n = 5, 3 * (1 << 20) + 7  # more than one check chunk
    total = sum(fill(n, r, torch.float64, "cpu") for r in range(p)).to(dtype)
    assert count_wrong(total, p) == 0
    total[[0, 1 << 20, n - 1]] += 1
    assert count_wrong(total, p) == 3


@pytest.mark.full_system
def test_one_shot_prints_nccl_tests_lines(tmp_path: Path) -> None:
    out = tmp_path / "ar.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "scaleout",
            "bench",
            "allreduce",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "-b",
            "1K",
            "-e",
            "16K",
            "-f",
            "4",
            "-n",
            "2",
            "-w",
            "1",
            "-d",
            "float",
            "--algorithms",
            "flat",
            "--out",
            str(out),
            "--png",
            "",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = [ln.split("] ", 1)[1] if ln.startswith("[rank") else ln for ln in r.stdout.splitlines()]
    rows = [
        ln.split()
        for ln in lines
        if ln.strip() and ln.strip()[0].isdigit() and len(ln.split()) == 9
    ]
    assert [(int(c[0]), int(c[1]), c[2], c[3], c[4], int(c[8])) for c in rows] == [
        (1024, 256, "float", "sum", "-1", 0),
        (4096, 1024, "float", "sum", "-1", 0),
        (16384, 4096, "float", "sum", "-1", 0),
    ]
    data = json.loads(out.read_text())["rows"]
    assert [float(c[5]) for c in rows] == pytest.approx([d["time_s"] * 1e6 for d in data], abs=0.06)
    (avg,) = [ln for ln in lines if ln.startswith("# Avg bus bandwidth")]
    assert float(avg.split(":")[1]) == pytest.approx(
        sum(d["busbw"] for d in data) / 3 / 1e9, rel=1e-3
    )
    assert "#wrong" in r.stdout and "(us)" in r.stdout


@pytest.mark.full_system
def test_sizes_and_b_e_f_exclusive() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "scaleout", "bench", "allreduce", "--sizes", "4KiB", "-b", "8"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "--sizes and -b/-e/-f both given" in r.stderr
