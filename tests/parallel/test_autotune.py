"""comm.algorithm=auto (scaleout/parallel/autotune.py): the config accepts it and rejects bad values
in one line; every rank picks the same plan from all-reduced timings even when its own would pick
another; the plan switch between steps trains exactly as that plan from the start; the trainer
records the decision in report.json and the MLPerf log; `scaleout bench auto` runs."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from scaleout.config import load_config
from scaleout.errors import ConfigError
from tests.distutil import run_dist

# tiny settings for the multi-process tests: two small probe sizes, one timed call each, one A/B
# step per plan (set in the rank processes before an AutoComm is built)
FAST = {
    "PROBE_BYTES": (4 << 10, 16 << 10),
    "PROBE_REPEATS": 1,
    "PROBE_BUDGET_S": 0.5,
    "AB_STEPS": 1,
}


@contextlib.contextmanager
def _fast() -> Iterator[None]:
    """FAST in this rank process while inside (the pools outlive the test)."""
    import scaleout.parallel.autotune as autotune

    saved = {k: getattr(autotune, k) for k in FAST}
    for k, v in FAST.items():
        setattr(autotune, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(autotune, k, v)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


# -- config ---------------------------------------------------------------------------------------
@pytest.mark.unit
def test_config_accepts_auto_and_rejects_bad_values_in_one_line() -> None:
    cfg = load_config(overrides=["comm.algorithm=auto", "comm.chunk_mb=2", "comm.bucket_mb=4"])
    assert cfg.comm.auto and cfg.comm.chunk_mb == 2.0
    from scaleout.parallel.autotune import Space

    space = Space.from_config(cfg.comm, ["flat", "hierarchical"])
    assert space.bucket_mb == (4.0,) and space.chunk_mb == (2.0,)  # what the config sets stays
    assert set(space.wires) == {"none", "bf16"} and len(space.first_bucket_mb) == 2
    with pytest.raises(ConfigError, match=r"comm.algorithm='autotune': expected one of .*auto"):
        load_config(overrides=["comm.algorithm=autotune"])
    for key in ("optim.sharded", "train.deterministic"):
        with pytest.raises(ConfigError, match=f"comm.algorithm=auto with {key}=true") as e:
            load_config(overrides=["comm.algorithm=auto", f"{key}=true"])
        assert "\n" not in str(e.value)


@pytest.mark.unit
def test_the_simulator_prices_auto_as_the_fastest_named_algorithm() -> None:
    """comm.algorithm=auto in a config given to the simulator (simulate, sweep, plan): each
    named algorithm is priced at the config's bucket size and auto is the fastest one, named in
    ``chosen``; on a slow inter-node link that is not flat (one ring over every rank)."""
    from dataclasses import replace

    from scaleout.sim.cluster import custom_cluster, get_cluster
    from scaleout.sim.fromconfig import from_config
    from scaleout.sim.step import step_time

    cfg = load_config("bert_tiny_cpu", ["comm.algorithm=auto"])
    run = from_config(cfg)
    assert run.train.algorithm == "auto"
    cluster = get_cluster("dgx-a100")
    for nodes in (2, 16):
        auto = step_time(run.model, run.train, cluster, nodes)
        named = {
            a: step_time(run.model, replace(run.train, algorithm=a), cluster, nodes).step
            for a in ("flat", "hierarchical", "torus2d")
        }
        assert auto.algorithm == "auto" and auto.chosen == min(named, key=named.get), named
        assert auto.step == min(named.values()), (auto, named)
    slow = custom_cluster(cluster, inter_gbit=1.0)
    assert step_time(run.model, run.train, slow, 16).chosen != "flat"


# -- the model's ranking (no ranks) ---------------------------------------------------------------
def _probe(times: dict[str, float], nnodes: int = 2, per_node: int = 2) -> object:
    """A probe table where algorithm a takes times[a] x (50 us + bytes / 100 MB/s)."""
    from scaleout.parallel.autotune import Probe

    rows = [
        {
            "algorithm": a,
            "nbytes": n,
            "wire": "none",
            "times": [f * (5e-5 + n / 1e8)],
            "time_s": f * (5e-5 + n / 1e8),
        }
        for a, f in times.items()
        for n in (4 << 10, 64 << 10, 1 << 20)
    ]
    return Probe(rows, rows, 0.0, 0.1, nnodes, per_node, "gloo")


@pytest.mark.unit
def test_ranking_prices_buckets_on_the_profile() -> None:
    from scaleout.parallel.autotune import (
        CommPlan,
        Profile,
        Space,
        cost_model,
        pick_pair,
        predict,
        rank_plans,
    )

    model = cost_model(_probe({"flat": 1.0, "hierarchical": 3.0}))
    # measured points are reproduced (the correction), between them it interpolates
    assert math.isclose(model.all_reduce_s("flat", 64 << 10), 5e-5 + (64 << 10) / 1e8, rel_tol=1e-6)
    # 8 gradients of 256 KiB, one ready every 10 ms from the start of backward (80 ms)
    prof = Profile(
        [256 << 10] * 8, ["f"] * 8, [0.01 * (i + 1) for i in range(8)], 0.08, 0.2, 0.0, 0
    )
    one = predict(CommPlan("flat", 25.0), prof, model)  # one bucket: all of it after backward
    assert one.buckets == 1 and math.isclose(one.exposed_s, one.comm_s, rel_tol=1e-9)
    small = predict(CommPlan("flat", 0.25), prof, model)  # a bucket per gradient: hidden
    assert small.buckets == 8 and small.exposed_s < 0.2 * one.exposed_s
    ranked = rank_plans(Space(("flat", "hierarchical"), wires=("none",)).plans(), prof, model)
    assert ranked[0].plan.algorithm == "flat"
    pair = pick_pair(ranked)
    assert [s.plan.algorithm for s in pair] == ["flat", "hierarchical"]
    # the same table with the algorithms' speeds swapped picks the other algorithm
    swapped = cost_model(_probe({"flat": 3.0, "hierarchical": 1.0}))
    ranked = rank_plans(Space(("flat", "hierarchical"), wires=("none",)).plans(), prof, swapped)
    assert ranked[0].plan.algorithm == "hierarchical"


# -- every rank, the same plan --------------------------------------------------------------------
def _skewed_choice(world) -> dict:
    """Rank 0's own timings make flat 100x slower, rank 1's hierarchical: alone they would choose
    differently; all-reduced, every rank chooses alike."""
    import scaleout
    from scaleout.config.schema import CommConfig
    from scaleout.parallel.autotune import AutoComm, Probe, Space, cost_model, rank_plans

    torch.manual_seed(0)
    dp = scaleout.DataParallel(Net(), world, "flat", 25.0)
    slow = {0: "flat", 1: "hierarchical"}.get(world.rank)
    comm = CommConfig(algorithm="auto", compression="none")
    with _fast():  # the constants are read when AutoComm is built
        tuner = AutoComm(
            dp,
            comm,
            world,
            space=Space(("flat", "hierarchical"), (0.001, 1.0), (None,), (None,), ("none",)),
            skew=lambda alg, nbytes, wire: 100.0 if alg == slow else 1.0,
        )
    probe = tuner.start()
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(world.rank))
    while not tuner.done:
        dp.zero_grad()
        dp(x).pow(2).mean().backward()
        tuner.after_step(0.01 * (1 + world.rank))  # step times differ by rank too
    mine = Probe(probe.local, probe.local, 0.0, 0.0, probe.nnodes, probe.nproc_per_node, "gloo")
    own = rank_plans(tuner.space.plans(), tuner.profile, cost_model(mine))[0].plan
    return {
        "chosen": tuner.chosen.label(),
        "pair": [s.plan.label() for s in tuner.pair],
        "own_best_algorithm": own.algorithm,
        "diverged": tuner.diverged,
        "algorithm_now": dp.algorithm,
        "buckets_now": len(dp.buckets),
        "rows": [(r["algorithm"], r["nbytes"], r["time_s"]) for r in probe.rows],
    }


@pytest.mark.multi_process
def test_every_rank_picks_the_same_plan_from_all_reduced_timings() -> None:
    res = run_dist(_skewed_choice, 2, 2, timeout=120)
    assert res[0]["own_best_algorithm"] == "hierarchical"  # rank 0 alone: flat looks 100x slow
    assert res[1]["own_best_algorithm"] == "flat"  # rank 1 alone: hierarchical does
    assert len({r["chosen"] for r in res}) == 1, [r["chosen"] for r in res]
    assert len({tuple(r["pair"]) for r in res}) == 1
    assert len({tuple(r["rows"]) for r in res}) == 1  # the one table every rank decided from
    assert res[0]["chosen"] in res[0]["pair"] and not any(r["diverged"] for r in res)
    assert len({(r["algorithm_now"], r["buckets_now"]) for r in res}) == 1


# -- the switch trains as the plan from the start -------------------------------------------------
def _switch_matches(world) -> dict:
    import scaleout

    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(world.rank))

    def train(dp: scaleout.DataParallel, switch_after: int | None) -> list[float]:
        opt = torch.optim.SGD(dp.parameters(), lr=0.1)
        losses = []
        for step in range(4):
            loss = dp(x).pow(2).mean()
            loss.backward()
            opt.step()
            dp.zero_grad()
            losses.append(float(loss))
            if step + 1 == switch_after:
                dp.set_plan("hierarchical", 0.004, 0.002, chunk_bytes=2048)
        return losses

    torch.manual_seed(0)
    switched = scaleout.DataParallel(Net(), world, "flat", 25.0)
    a = train(switched, switch_after=2)
    torch.manual_seed(0)
    fixed = scaleout.DataParallel(Net(), world, "flat", 25.0)
    b = train(fixed, switch_after=None)
    torch.manual_seed(0)
    planned = scaleout.DataParallel(
        Net(), world, "hierarchical", 0.004, first_bucket_mb=0.002, chunk_bytes=2048
    )
    c = train(planned, switch_after=None)
    return {
        "switched": a,
        "flat": b,
        "planned": c,
        "buckets": [len(switched.buckets), len(planned.buckets)],
        "params_close": all(
            torch.allclose(p, q, rtol=1e-5, atol=1e-6)
            for p, q in zip(switched.parameters(), planned.parameters(), strict=True)
        ),
    }


@pytest.mark.multi_process
def test_plan_switch_after_step_trains_as_that_plan_from_the_start() -> None:
    for r in run_dist(_switch_matches, 2, 2, timeout=120):
        assert r["switched"][:2] == r["flat"][:2]  # before the switch: the flat run's steps
        # after it: the hierarchical plan's, as from the start (up to the sums' order)
        assert r["buckets"][0] == r["buckets"][1] > 1
        assert r["params_close"]
        for s, p in zip(r["switched"][2:], r["planned"][2:], strict=True):
            assert math.isclose(s, p, rel_tol=1e-5), (r["switched"], r["planned"])


# -- the trainer ----------------------------------------------------------------------------------
SMALL_BERT = [
    "model.arch=bert",
    "data.source=synthetic",
    "data.max_seq_len=32",
    "data.max_predictions=5",
    "data.packing=lpfhp",
    "model.bert.vocab_size=64",
    "model.bert.hidden=16",
    "model.bert.layers=1",
    "model.bert.heads=2",
    "model.bert.intermediate=32",
    "model.bert.max_position=32",
    "data.eval_samples=8",
    "train.global_batch=8",
    "train.eval_every=100",
    "train.progress=false",
    "optim.warmup_steps=1",
    "optim.total_steps=8",
]


def _train_losses(world, out: str, overrides: list[str]) -> list[float | None]:
    from scaleout.train.trainer import Trainer

    cfg = load_config(None, [*SMALL_BERT, f"train.output_dir={out}", *overrides])
    with _fast():
        trainer = Trainer(cfg, world)
        trainer.train()
    return trainer.losses


@pytest.mark.multi_process
def test_trainer_records_the_auto_plan_and_trains_as_that_plan(tmp_path: Path) -> None:
    steps = 2 + 2 * FAST["AB_STEPS"] + 2  # profile at step 2, the A/B, two steps on the choice
    auto = run_dist(
        _train_losses,
        1,
        2,
        args=(str(tmp_path / "auto"), ["comm.algorithm=auto", f"train.max_steps={steps}"]),
        timeout=120,
    )
    report = json.loads((tmp_path / "auto" / "report.json").read_text())["comm_auto"]
    chosen = report["chosen"]
    assert chosen is not None and report["decided_after_step"] == 2 + 2 * FAST["AB_STEPS"]
    assert report["probe"]["seconds"] > 0 and report["predicted_step_s"] > 0
    assert report["measured_step_s"] > 0 and len(report["ab"]) == 2
    events = [
        json.loads(line.split(":::MLLOG", 1)[1])
        for line in (tmp_path / "auto" / "mlperf.log").read_text().splitlines()
        if ":::MLLOG" in line
    ]
    keys = [e["key"] for e in events]
    assert keys.index("scaleout_comm_probe") < keys.index("run_start")  # before the clock
    plan = events[keys.index("scaleout_comm_plan")]
    assert (
        plan["value"] == chosen["label"]
        and plan["metadata"]["step"] == report["decided_after_step"]
    )
    assert plan["metadata"]["predicted_step_s"] == report["predicted_step_s"]
    # the same run with the chosen plan fixed from the start: the same losses (allclose: the
    # first steps summed in flat's and the A/B plans' order)
    fixed = [
        f"comm.algorithm={chosen['algorithm']}",
        f"comm.bucket_mb={chosen['bucket_mb']}",
        f"comm.compression={chosen['compression']}",
        f"train.max_steps={steps}",
    ]
    if chosen["first_bucket_mb"] is not None:
        fixed.append(f"comm.first_bucket_mb={chosen['first_bucket_mb']}")
    if chosen["chunk_mb"] is not None:
        fixed.append(f"comm.chunk_mb={chosen['chunk_mb']}")
    plain = run_dist(_train_losses, 1, 2, args=(str(tmp_path / "fixed"), fixed), timeout=120)
    lossy = any(a["plan"]["compression"] != "none" for a in report["ab"])  # a bf16 step ran
    rtol = 2e-2 if lossy else 1e-4
    for a, b in zip(auto[0], plain[0], strict=True):
        assert math.isclose(a, b, rel_tol=rtol), (auto[0], plain[0], chosen)


# -- the benchmark ------------------------------------------------------------------------------
def _bench(world, out: str) -> dict:
    from scaleout.bench import auto

    p = argparse.ArgumentParser()
    auto.add_arguments(p)
    args = p.parse_args([*auto.SMOKE_ARGS, "--out", out])
    return auto.body(args, world)


@pytest.mark.multi_process
def test_bench_auto_smoke_in_ranks(tmp_path: Path) -> None:
    """`scaleout bench auto` with its SMOKE_ARGS in the shared 1 x 2 ranks (test_bench.py leaves
    it to this test: SMOKE_TEST)."""
    res = run_dist(_bench, 1, 2, args=(str(tmp_path / "auto.json"),), timeout=120)
    assert res[0] == res[1]
    payload = json.loads((tmp_path / "auto.json").read_text())
    assert payload["bench"] == "auto" and payload["ratio"] > 0 and payload["probe_s"] > 0
    assert sum(r["auto"] for r in payload["rows"]) == 1
