"""scripts/gpu-deep-check.sh (scaleout bench gpudeep) on a machine without a GPU: it starts, lists
every part as SKIP saying "no GPU" and exits 0, or FAILs when nvidia-smi lists a GPU torch cannot
see (a fake nvidia-smi: none can exist here). A part that crashes or outlives its cap is a FAIL
row, never a pass; the multi-rank part's verdict is checked on made-up rank reports (no GPU here to
make real ones)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scaleout.bench import _deep_emu, gpudeep
from tests.bench.test_gpucheck import _gpu_check, _path_without_nvidia_smi, fake_nvidia_smi

ROOT = Path(__file__).resolve().parents[2]


def _deep_check(tmp: Path, path: str) -> subprocess.CompletedProcess:
    out = str(tmp / "gpudeep.json")
    return _gpu_check("--out", out, path=path, python=sys.executable, script="gpu-deep-check.sh")


@pytest.mark.full_system
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour of the script")
def test_deep_check_reports_no_gpu_cleanly_on_cpu(tmp_path: Path) -> None:
    """No CUDA and no nvidia-smi: every part is listed, SKIP with "no GPU", exit 0, the table
    printed."""
    r = _deep_check(tmp_path, _path_without_nvidia_smi())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "| part" in r.stdout and "nothing was checked" in r.stdout, r.stdout
    rows = json.loads((tmp_path / "gpudeep.json").read_text())["rows"]
    assert [row["part"] for row in rows] == [name for name, _ in gpudeep.PARTS]
    assert all(row["result"] == "SKIP" and "no GPU" in row["number"] for row in rows), rows


@pytest.mark.full_system
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a GPU that torch cannot see")
def test_deep_check_fails_when_nvidia_smi_lists_a_gpu_torch_cannot_see(tmp_path: Path) -> None:
    fake = fake_nvidia_smi(tmp_path / "bin", ["GPU 0: NVIDIA H100 (UUID: GPU-0)"])
    r = _deep_check(tmp_path, _path_without_nvidia_smi(fake))
    assert r.returncode == 1, r.stdout + r.stderr
    rows = json.loads((tmp_path / "gpudeep.json").read_text())["rows"]
    assert all(row["result"] == "FAIL" and "sees none" in row["number"] for row in rows), rows


@pytest.mark.unit
def test_parts_fit_eight_minutes_in_priority_order() -> None:
    caps = dict(gpudeep.PARTS)
    assert sum(caps.values()) < 8 * 60, caps
    assert [n for n, _ in gpudeep.PARTS][:4] == ["facts", "emu", "capture", "watchdog"]
    from scaleout.bench._deep_parts import PARTS

    assert set(PARTS) == set(caps)  # every listed part exists, and nothing else


@pytest.mark.full_system  # the parts run as subprocesses
def test_a_crashing_or_hanging_part_is_a_fail_row(tmp_path: Path) -> None:
    """Run for real here, where there is no GPU: the facts part raises (no CUDA device) -> FAIL
    with the error; the multi-rank part given a cap it cannot meet -> FAIL naming the cap."""
    name, result, number, _ = gpudeep.run_part("facts", 60, tmp_path)
    assert (name, result) == ("facts", "FAIL") and number, number
    name, result, number, _ = gpudeep.run_part("emu", 0.5, tmp_path)
    assert result == "FAIL" and "over its 0.5 s cap" in number, number


def _rank(diff: float = 1e-4, noncontig: bool = True, checksum: float = 1.0) -> dict:
    names = list(_deep_emu.VARIANTS)
    return {
        "rank": 0,
        "hook_thread": "Dummy-1",
        **{n: [checksum, 2.0] for n in names},
        "diff": {n: (0.0 if n == "hierarchical" else diff) for n in names},
        "noncontiguous_ok": noncontig,
    }


@pytest.mark.unit
def test_emu_verdict_fails_on_any_wrong_answer() -> None:
    """Made-up rank reports (what 4 ranks on one GPU would write): PASS only when the replicas
    agree, the algorithms agree within the bar and the non-contiguous all-reduce is right."""
    assert _deep_emu.verdict([_rank()] * 4)[0] == "PASS"
    assert _deep_emu.verdict([_rank()] * 3 + [_rank(checksum=1.5)]) == (
        "FAIL",
        _deep_emu.verdict([_rank()] * 3 + [_rank(checksum=1.5)])[1],
    )
    assert "DIFFER" in _deep_emu.verdict([_rank()] * 3 + [_rank(checksum=1.5)])[1]
    assert _deep_emu.verdict([_rank(diff=0.2)] * 4)[0] == "FAIL"
    result, number = _deep_emu.verdict([_rank(noncontig=False)] * 4)
    assert result == "FAIL" and "WRONG" in number
