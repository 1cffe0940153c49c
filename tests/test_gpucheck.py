"""scripts/gpu-check.sh on a machine without CUDA: every GPU row is SKIP with its reason and the
exit status is 0. The checks' own code runs here on CPU at tiny shapes (the GPU itself is the
only thing missing), so the first GPU run does not trip over a typo."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from scaleout.bench import _gpuchecks as g
from tests.distutil import run_dist

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(vocab_size=512, hidden=32, layers=2, heads=2, intermediate=64, max_position=64)


@pytest.mark.full_system
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour of the script")
def test_gpu_check_script_skips_every_gpu_row_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpucheck.json"
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "| check" in r.stdout and "| result" in r.stdout and "| expected" in r.stdout
    rows = json.loads(out.read_text())["rows"]
    names = [row["check"] for row in rows]
    assert names == [
        "environment",
        "nccl",
        "train",
        "capture",
        "varlen",
        "optimizers",
        "bert_large",
        "allreduce",
    ]
    assert all(row["result"] == "SKIP" and row["number"] for row in rows), rows


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
    assert number.startswith("2 rows: ") and "tokens/s" in number and "bf16 peak" in number, number


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
