"""The llama bar run, shrunk: `scaleout launch --nnodes 2 --nproc-per-node 2 -- scaleout train
configs/llama_tiny_cpu.yaml` (2 emulated nodes x 2 real gloo ranks, hierarchical all-reduce, AdamW
with the cosine schedule and clipping) at 64-token rows reaches a log-perplexity target far below
the untrained ln(4096) = 8.3, stops there, and its mlperf.log passes the real checker's open
llama31_8b rules with only the quality threshold set to the run's target (the closed rules pin the
8B's sequence length, evaluation set and schedule: test_llama_mlperf.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scaleout.telemetry.mlperf import check_compliance

ROOT = Path(__file__).resolve().parents[3]
# measured: 7.21 at step 10, 6.39 at 20, 6.27 at 60 (the full config's curve: configs/ comments)
TARGET = 6.5
SHRUNK = [
    "model.llama.seq_len=64",
    "train.global_batch=16",
    "data.eval_samples=32",
    "train.eval_every=10",
    "train.max_steps=60",
    "optim.warmup_steps=5",
    "optim.total_steps=60",
    f"train.target={TARGET}",
    "train.progress=false",
    "checkpoint.dir=null",
    "checkpoint.every_steps=0",
]


@pytest.mark.extended  # minutes on 2 cores: python3 -m pytest -m extended (docs/testing.md)
@pytest.mark.multi_process
def test_the_2x2_run_reaches_its_log_perplexity_target(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "scaleout", "launch", "--nnodes", "2", "--nproc-per-node", "2"]
    cmd += ["--", "scaleout", "train", "configs/llama_tiny_cpu.yaml", *SHRUNK]
    cmd += [f"train.output_dir={tmp_path}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    events = [
        json.loads(line.split(" ", 1)[1])
        for line in (tmp_path / "mlperf.log").read_text().splitlines()
        if line.startswith(":::MLLOG")
    ]
    ppl = [e["value"] for e in events if e["key"] == "eval_accuracy"]
    (stop,) = [e for e in events if e["key"] == "run_stop"]
    assert stop["metadata"]["status"] == "success", ppl
    assert ppl[-1] <= TARGET < min(ppl[:-1], default=9.0)  # stopped at the first eval below it
    assert ppl[0] < 8.3  # and it learned from the first evaluation on
    ok, out = check_compliance(tmp_path / "mlperf.log", "llama31_8b", quality_target=TARGET)
    assert ok, out
