"""``comm.timeline`` honoured by ``scaleout train`` (it used to be accepted and never written), in a
run started without a launcher: rank 0 then takes the run directories' lease itself and releases
it at the end (scaleout/runlock.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scaleout.runlock import LOCK_NAME
from tests.train.test_async_save import SMALL

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.multi_process
def test_scaleout_train_writes_the_comm_timeline(tmp_path):
    trace, out = tmp_path / "trace.json", tmp_path / "out"
    cmd = [sys.executable, "-m", "scaleout", "train", "bert_tiny_cpu", *SMALL, "train.max_steps=2"]
    cmd += ["train.target=null", f"train.output_dir={out}", f"checkpoint.dir={tmp_path}/ck"]
    cmd += [f"comm.timeline={trace}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_JOB_ID", "SLURM_PROCID"):
        env.pop(var, None)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("ph") == "X" for e in events), events[:5]
    assert f"timeline: {trace}" in done.stdout
    assert not (out / LOCK_NAME).exists()  # the lease rank 0 took is released
    assert not (tmp_path / "ck" / LOCK_NAME).exists()
