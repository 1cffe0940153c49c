"""Issue 42's bar: every pick of `scaleout plan` on the netns cluster, run as printed, reaches the
target as predicted.

The tiny BERT (`bert_tiny_cpu`) at target 0.09 (reached in a few hundred steps at these batches;
the config's 0.15 sits on a plateau where the step that crosses it is noise, docs/plan.md). The
convergence curve is `tests/data/largebatch_tiny_0p09.json`: steps to 0.09 measured on this machine
with the plan's own schedule rule at global batches 16 and 32 (2 ranks, evaluation every 10 steps;
`scaleout launch --nnodes 1 --nproc-per-node 2 -- scaleout train bert_tiny_cpu train.target=0.09
...`, 2026-12-06). The grid: 1 and 2 emulated nodes x 2 ranks at 8 packed rows per rank. Each
distinct pick (knee, fastest, cheapest) is run once, exactly as printed (`scaleout launch --netns
... -- scaleout train ...`), in its own directory; its report.json must show the target reached
within the printed train.max_steps, at no more than the predicted steps rounded up to one
evaluation interval plus one (a run stops at the first evaluation at the target). Needs root and
iproute2; ~3-4 min on the shared 2-core machine.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("tc") is None or shutil.which("ip") is None,
        reason="needs root and iproute2 (ip, tc)",
    ),
]

ROOT = Path(__file__).resolve().parents[2]
FIT = ROOT / "tests" / "data" / "largebatch_tiny_0p09.json"
TARGET = 0.09


def _plan(pick: str, out: Path) -> dict:
    argv = [
        "plan", "bert_tiny_cpu", f"train.target={TARGET}", "--preset", "netns-1g",
        "--fit", str(FIT), "--nnodes", "1,2", "--nproc-per-node", "2", "--per-gpu-batch", "8",
        # one rank's samples/s measured with the fit's runs (prices time, not steps)
        "--samples-per-s", "14", "--cores", "2", "--algorithms", "hierarchical",
        "--optimizers", "replicated", "--pick", pick, "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "scaleout", *argv], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "scaleout launch --nnodes" in done.stdout and "sbatch" not in done.stdout
    return json.loads(out.read_text())["chosen"]


@pytest.mark.extended  # minutes on 2 cores: python3 -m pytest -m extended (docs/testing.md)
def test_each_plan_pick_run_as_printed_reaches_the_target(tmp_path: Path) -> None:
    picks: dict[str, tuple[list[str], dict]] = {}
    for pick in ("knee", "fastest", "cheapest"):
        chosen = _plan(pick, tmp_path / f"{pick}.json")
        picks.setdefault(chosen["launch"], ([], chosen))[0].append(pick)
    for i, (line, (names, chosen)) in enumerate(picks.items()):
        argv = shlex.split(line)
        assert argv[:2] == ["scaleout", "launch"] and "--netns" in argv, line
        where = tmp_path / f"run{i}"
        where.mkdir()
        done = subprocess.run(
            [sys.executable, "-m", "scaleout", *argv[1:]],
            cwd=where,
            capture_output=True,
            text=True,
            timeout=1200,
        )
        assert done.returncode == 0, f"{names}: {line}\n{done.stdout[-3000:]}{done.stderr[-2000:]}"
        report = json.loads((where / "runs" / "bert_tiny_cpu" / "report.json").read_text())
        sched = chosen["schedule"]
        assert report["status"] == "success" and report["achieved"] >= TARGET, (names, report)
        assert report["steps"] <= sched["total_steps"]
        # as predicted: at the predicted evaluation or the one after it
        assert report["steps"] <= chosen["steps"] + sched["eval_every"], (
            names, report["steps"], chosen["steps"],
        )  # fmt: skip
        # the launcher's moment reached the ranks: the start is counted from the launch
        start = report["untimed_start"]
        assert start["from"] == "allocation" and start["phases_s"]["launch"] is not None
        assert start["total_s"] > 0
