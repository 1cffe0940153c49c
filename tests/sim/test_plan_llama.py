"""`scaleout plan` for MLPerf llama31_8b: the simulator knows the family's reference model and
its RCP table (mlperf-logging training_6.1.0), and no proposed point exceeds the table's largest
batch, 128 sequences = 128 data-parallel replicas at one sequence each; the plan names the inner
parallelism a wider run needs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scaleout.families import FAMILIES
from scaleout.sim import plan as P
from scaleout.sim.convergence import rcp_curve
from scaleout.sim.step import MODELS

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "llama31_8b_16x8.yaml")


@pytest.mark.unit
def test_the_plan_stays_within_128_replicas_and_names_what_lies_beyond() -> None:
    fam = FAMILIES.get("llama")
    assert fam.sim_preset == "llama31-8b" and "llama31-8b" in MODELS
    curve = rcp_curve("llama31_8b", "6.1.0")
    assert max(b for b, _ in curve.points) == fam.max_global_batch == 128
    work = P.workload(CONFIG)
    cluster = P.load_cluster("dgx-h100")
    grid = P.default_grid(cluster, 1, max_nodes=64)
    assert max(c.global_batch for c in grid.candidates()) > 128  # the grid itself goes wider
    res = P.plan(work, cluster, P.curve_of_family("llama", None), grid)
    assert res.points and max(p.candidate.global_batch for p in res.points) <= 128
    assert max(p.candidate.gpus for p in res.points) == 128
    ceiling, memory = res.notes
    assert "at most 128 data-parallel replicas" in ceiling and "tensor or context" in ceiling
    # 8B with AdamW replicated: 8.0e9 x (2 + 4 + 12) bytes > 80 GB; sharded over the node, it fits
    assert {p.candidate.optimizer for p in res.points} == {"sharded", "sharded-node"}
    assert memory.startswith("replicated points dropped: 1") and "H100-SXM5-80GB's 80 GB" in memory
    fastest = P.choose(res.points, "fastest")
    assert fastest.candidate.global_batch == 128
    P.validate_overrides(CONFIG, fastest.overrides)  # the chosen keys load
    assert "slurm/llama31_8b_16node.sh" in P.sbatch_line("llama", fastest.candidate, [])
    # BERT's RCPs go to 16k sequences and it has no ceiling: nothing dropped there
    bert = P.workload(str(ROOT / "configs" / "bert_large_256x8.yaml"))
    kept, notes = P.within_ceiling(bert.arch, grid.candidates())
    assert len(kept) == len(grid.candidates()) and not notes
    kept, notes = P.within_memory(bert, cluster, grid.candidates())  # 340M parameters fit
    assert len(kept) == len(grid.candidates()) and not notes


@pytest.mark.unit
def test_the_memory_check_follows_the_shard_and_the_device() -> None:
    """model_state_bytes: weights + gradients + optimizer state / shard; a device without a
    capacity (a CPU preset) checks nothing; the H200's 141 GB still refuses the replicated 8B."""
    from dataclasses import replace

    from scaleout.sim.step import model_state_bytes

    work = P.workload(CONFIG)
    model = work.models["replicated"]
    assert model_state_bytes(model, 8) < model_state_bytes(model, 1) / 2
    grid = P.default_grid(P.load_cluster("dgx-h100"), 1, max_nodes=2)
    h200 = P.load_cluster("h200-superpod")
    kept, notes = P.within_memory(work, h200, grid.candidates())
    assert {c.optimizer for c in kept} == {"sharded", "sharded-node"} and "141 GB" in notes[0]
    unknown = replace(h200, device=replace(h200.device, mem_bytes=0.0))
    assert P.within_memory(work, unknown, grid.candidates()) == (grid.candidates(), [])


@pytest.mark.unit
def test_the_cli_prints_the_ceiling() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "scaleout", "plan", CONFIG, "--preset", "dgx-h100"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "RCPs end at 128 samples" in out.stdout and "rcps_llama31_8b.json" in out.stdout
    assert "sbatch -J plan-" in out.stdout and " -N " in out.stdout
    assert "llama31_8b_16node.sh" in out.stdout
    assert "replicated points dropped" in out.stdout
