"""scripts/gpu-check.sh on a machine without CUDA: every GPU row is SKIP with its reason and the
exit status is 0 -- unless nvidia-smi lists a GPU (then torch cannot see a GPU the machine has:
exit 1, one line saying why; a fake nvidia-smi stands in for the real one, which cannot exist
here). A missing dependency is one line naming what to run. The checks' own code runs here on CPU
at tiny shapes (the GPU itself is the only thing missing), so the first GPU run does not trip
over a typo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scaleout.bench import _gpuchecks as g
from tests.distutil import run_dist

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(vocab_size=512, hidden=32, layers=2, heads=2, intermediate=64, max_position=64)


def _path_without_nvidia_smi(extra: Path | None = None) -> str:
    dirs = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d]
    dirs = [d for d in dirs if not (Path(d) / "nvidia-smi").exists()]
    return os.pathsep.join(([str(extra)] if extra else []) + dirs)


def fake_nvidia_smi(folder: Path, lines: list[str]) -> Path:
    """A stand-in ``nvidia-smi`` in ``folder`` (none can exist here): ``-L`` prints ``lines``,
    anything else fails. Returns the folder, to put first on PATH."""
    folder.mkdir(parents=True, exist_ok=True)
    smi = folder / "nvidia-smi"
    listing = "\\n".join(lines)
    smi.write_text(f'#!/bin/sh\n[ "$1" = -L ] && printf "{listing}\\n" && exit 0\nexit 9\n')
    smi.chmod(0o755)
    return folder


def _gpu_check(
    *args: str, path: str, python: str | None = None, script: str = "gpu-check.sh"
) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": path}
    if python:
        env["PYTHON"] = python
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.mark.full_system
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour of the script")
def test_gpu_check_script_skips_every_gpu_row_on_cpu(tmp_path: Path) -> None:
    """No CUDA and no nvidia-smi: the CPU rows run (dependencies), every GPU row SKIPs, exit 0."""
    out = tmp_path / "gpucheck.json"
    r = _gpu_check("--out", str(out), path=_path_without_nvidia_smi(), python=sys.executable)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "| check" in r.stdout and "| result" in r.stdout and "| expected" in r.stdout
    rows = json.loads(out.read_text())["rows"]
    names = [row["check"] for row in rows]
    assert names == [
        "environment",
        "dependencies",
        "nccl",
        "train",
        "capture",
        "varlen",
        "optimizers",
        "bert_large",
        "resnet50",
        "allreduce",
    ]
    assert rows[1]["result"] == "PASS", rows[1]
    gpu_rows = [rows[0], *rows[2:]]
    assert all(row["result"] == "SKIP" and row["number"] for row in gpu_rows), rows


@pytest.mark.full_system
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a GPU that torch cannot see")
def test_gpu_check_fails_when_nvidia_smi_lists_a_gpu_torch_cannot_see(tmp_path: Path) -> None:
    """A GPU box whose torch sees no GPU (CPU wheel, CUDA newer than the driver) must not pass."""
    fake = fake_nvidia_smi(tmp_path / "bin", ["GPU 0: NVIDIA H200 (UUID: GPU-0000-fake)"])
    out = tmp_path / "gpucheck.json"
    r = _gpu_check(
        "--only",
        "nccl",
        "--out",
        str(out),
        path=_path_without_nvidia_smi(fake),
        python=sys.executable,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    [reason] = r.stderr.strip().splitlines()
    assert "nvidia-smi lists 1 GPU(s) (GPU 0: NVIDIA H200)" in reason, reason
    assert "sees none" in reason and torch.__version__ in reason, reason
    env_row = json.loads(out.read_text())["rows"][0]
    assert env_row["check"] == "environment" and env_row["result"] == "FAIL", env_row


@pytest.mark.full_system
def test_gpu_check_says_what_to_run_when_dependencies_are_missing(tmp_path: Path) -> None:
    """An interpreter without the project's dependencies (here: site-packages switched off): one
    line naming what is missing and scripts/setup.sh, exit 2, before any row runs."""
    py = tmp_path / "python"
    py.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    py.chmod(0o755)
    r = _gpu_check(path=_path_without_nvidia_smi(), python=str(py))
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    [line] = r.stderr.strip().splitlines()
    assert "cannot import torch" in line and "pydantic" in line, line
    assert "scripts/setup.sh" in line and "--setup" in line, line


@pytest.mark.unit
def test_varlen_check_runs_and_reports_the_missing_kernel() -> None:
    [(name, result, number, _)] = g.check_varlen("cpu", TINY)
    assert (
        result == "FAIL" and "NOT available" in number
    )  # no CUDA: the varlen path cannot be taken
    assert "max rel diff 0.00e+00" in number  # both paths are the masked SDPA here: identical


@pytest.mark.multi_process
def test_optimizer_and_bert_large_checks_run() -> None:
    rows = g.check_optimizers("cpu", TINY)
    assert [r[0].split()[0] for r in rows] == ["LAMB", "LARS"] and all(
        " ms vs " in r[2] for r in rows
    ), rows
    [(name, result, number, expected)] = g.check_bert_large("cpu", TINY, rows=1, max_rows=2)
    # the bar at the flagship's rows (here 1), the largest batch that fits (here 2) beside it
    assert number.startswith("1 rows: ") and "largest 2 rows: " in number, number
    assert "tokens/s" in number and "bf16 peak" in number, number


@pytest.mark.unit
def test_packed_batch_is_two_sequences_per_row() -> None:
    b = g.packed_batch(6, 64, 512, device="cpu")
    assert b["input_ids"].shape == (6, 64)
    assert ((b["seq_ids"].amax(1) == 2) & ((b["seq_ids"] > 0).sum(1) <= 64)).all()


def _rank_checks(world) -> dict:
    return {"world": g.rank_world(world), "allreduce": g.rank_allreduce(world, mib=1)}


@pytest.mark.multi_process
def test_rank_parts_on_gloo() -> None:
    """The multi-process parts on 2 emulated nodes x 1 rank (gloo here, NCCL on GPUs)."""
    for r in run_dist(_rank_checks, nnodes=2, nproc_per_node=1):
        assert r["world"]["world_size"] == 2 and r["world"]["sum"] == 2.0
        assert all(
            r["allreduce"][a]["equal"] and r["allreduce"][a]["busbw_gbs"] > 0
            for a in ("flat", "hierarchical", "torus2d")
        ), r


@pytest.mark.unit
def test_resnet50_row_runs_on_cpu_at_tiny_shapes() -> None:
    """The ResNet-50 images/s row's own code on CPU (ResNet-18 w4 at 32 px, batches 2 and 4):
    uint8 NHWC inputs normalised in the step, bf16 autocast, LARS; eager only (graphs need CUDA
    and a world). The GPU-decode row SKIPs here in one line: torchvision cannot be imported on
    this machine."""
    from scaleout.families.resnet.config import ResNetConfig

    cfg = ResNetConfig(depth=18, width=4, num_classes=10, image_size=32)
    [(name, result, number, expected)] = g.check_resnet50(None, "cpu", cfg, (2, 4), repeats=1)
    assert name.startswith("ResNet-50") and result in ("PASS", "FAIL"), name
    assert "img/s per GPU (eager) at batch 2: " in number and ", 4: " in number, number
    assert "best " in number and ">= " in expected, (number, expected)
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 -- this machine: its wheel needs CUDA libraries
        [(name, result, number, _)] = g.check_gpu_decode("cpu")
        assert result == "SKIP" and "data.decode=gpu needs torchvision" in number, number
