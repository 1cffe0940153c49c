"""The shipped BERT flagship is the fast configuration, priced as the code runs it.

Pure arithmetic on the simulator (no processes): the 256-node DGX A100 cluster is the model's
preset, not hardware, which cannot exist here.
"""

from __future__ import annotations

import json

import pytest

from scaleout.cli import main
from scaleout.config.load import load_config
from scaleout.sim.cluster import get_cluster, with_sharp
from scaleout.sim.fromconfig import from_config
from scaleout.sim.sharded import reduce_time
from scaleout.train.capture import graphed_step

pytestmark = pytest.mark.unit

FLAGSHIP = "configs/bert_large_256x8.yaml"


def test_flagship_enables_what_the_planner_assumes() -> None:
    """bf16 bytes on the wire with fp32 sums (the sharded LAMB's all-to-all), LAMB sharded within
    the node and overlapped, hierarchical, graphs. SHARP stays off: no in-network reduction applies
    to an all-to-all (the plan prices the point the same with it)."""
    cfg = load_config(FLAGSHIP)
    assert (cfg.optim.sharded, cfg.optim.shard, cfg.optim.overlap_comm) == (True, "node", True)
    assert cfg.comm.compression == "bf16" and cfg.comm.algorithm == "hierarchical"
    assert cfg.model.cuda_graphs
    run = from_config(cfg, FLAGSHIP)
    assert run.train.wire_a2a and run.model.grad_bytes == 2
    assert run.train.optimizer == "sharded-node"


def test_simulator_prices_the_step_the_trainer_runs() -> None:
    """Graphs are priced as the trainer captures the step: the sharded LAMB's captured step
    issues its reduce-scatters from backward's hooks (overlapped, capture.sharded_step), except
    under fp16 (eager); the captured DataParallel step reduces after backward, so it is priced
    without overlap."""
    sharded = load_config(FLAGSHIP)
    assert graphed_step(sharded) == (True, True)
    train = from_config(sharded).train
    assert train.cuda_graphs and train.overlap
    fp16 = load_config(FLAGSHIP, ["train.precision=fp16"])
    assert graphed_step(fp16) == (False, True)
    plain = load_config(
        FLAGSHIP, ["optim.sharded=false", "optim.overlap_comm=false", "optim.shard=world"]
    )
    assert graphed_step(plain) == (True, False)
    train = from_config(plain).train
    assert train.cuda_graphs and not train.overlap


def test_compressed_sharded_node_exchange_is_not_a_256_step_ring() -> None:
    """The node-sharded compressed reduce-scatter exchanges with the other nodes by all-to-all
    (one latency), so a 50 MB bucket at 256 nodes costs well under the ~3.6 ms that 255 ring steps
    of 14 us would."""
    a100 = get_cluster("dgx-a100")
    t = reduce_time("sharded-node", "hierarchical", a100, 256, 50e6, wire_a2a=True)
    assert t < 1e-3
    # SHARP cannot speed up an all-to-all: the same time with it on
    sharp = reduce_time(
        "sharded-node", "hierarchical", with_sharp(a100, True), 256, 50e6, wire_a2a=True
    )
    assert sharp == pytest.approx(t)


def test_flagship_simulation_within_1_25x_of_the_plan(tmp_path) -> None:
    """The Bar: `scaleout simulate scale --config FLAGSHIP` at 2,048 GPUs predicts a time to train
    within 1.25x of `scaleout plan FLAGSHIP --nnodes 256 --pick fastest` (base commit: 2.19 vs
    0.29 min: fp32 wire, replicated LAMB, no SHARP)."""
    sim, plan = tmp_path / "sim.json", tmp_path / "plan.json"
    argv = ["simulate", "scale", "--config", FLAGSHIP, "--min-gpus", "2048", "--max-gpus", "2048"]
    assert main([*argv, "--out", str(sim)]) == 0
    assert main(["plan", FLAGSHIP, "--nnodes", "256", "--pick", "fastest", "--out", str(plan)]) == 0
    rows = [r for r in json.loads(sim.read_text())["rows"] if r["gpus"] == 2048]
    simulated = rows[0]["time_to_train_s"]
    planned = json.loads(plan.read_text())["chosen"]["ttt_s"]
    assert max(simulated, planned) / min(simulated, planned) <= 1.25, (simulated, planned)
