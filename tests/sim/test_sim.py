"""The cost model: textbook formulas, calibration machinery, step/overlap model, published checks,
CLI.

Everything here is pure arithmetic (no processes); the fit on real gloo measurements is in
tests/sim/test_sim_calibrate.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from scaleout.cli import main
from scaleout.comm.torus2d import square_x as square_torus_x
from scaleout.errors import ConfigError, TopologyError
from scaleout.sim.calibrate import Sample, cross_validate, fit, split_default
from scaleout.sim.cluster import PARAMS, Cluster, Constants, custom_cluster, get_cluster
from scaleout.sim.collectives import allreduce_cost, plan_for
from scaleout.sim.step import (
    TrainSpec,
    bucket_sizes,
    get_model,
    gpu_counts,
    step_time,
    sweep,
    time_to_train,
)
from scaleout.sim.validate import horovod_542, mlperf_bert, nccl_busbw_a100

IDX = {k: i for i, k in enumerate(PARAMS)}


def toy(g: int = 4, nics: int = 1, backend: str = "nccl", **consts: float) -> Cluster:
    c = dict(
        base=1e-5,
        alpha_intra=2e-6,
        alpha_inter=1e-5,
        beta_intra=1 / 100e9,
        beta_inter=1 / 10e9,
        gamma=0.0,
    )
    c.update(consts)
    return Cluster("toy", g, nics, Constants(**c), streams_per_ring=1, backend=backend)


def coeffs(alg: str, cluster: Cluster, nodes: int, n: float, **kw) -> np.ndarray:
    return plan_for(alg, cluster, nodes, n, **kw).linearize(np.array(cluster.constants.vector()))


@pytest.mark.unit
def test_ring_matches_textbook_and_busbw_tends_to_link_bandwidth():
    c = toy(g=8)
    n = 1 << 30
    t = allreduce_cost("flat", c, 1, n)
    want = 1e-5 + 2 * 7 * (2e-6 + n / 8 / 100e9)
    assert t.time == pytest.approx(want, rel=1e-12)
    assert t.busbw == pytest.approx(100e9, rel=0.01)  # nccl-tests busbw = link bandwidth on a ring
    # the registry's names only
    with pytest.raises(ConfigError, match="'ring'.*flat, hierarchical"):
        allreduce_cost("ring", c, 1, n)


@pytest.mark.unit
@pytest.mark.parametrize("g, k", [(2, 2), (4, 4), (8, 16)])
def test_bytes_through_a_node_link_flat_vs_hierarchical(g, k):
    """DESIGN facts: flat ring 2(p-1)/p * n leaves each node, hierarchical 2(k-1)/k * n (one
    NIC)."""
    c, n, p = toy(g=g, alpha_inter=0.0, alpha_intra=0.0), 1e6, g * k
    flat = coeffs("flat", c, k, n)[IDX["beta_inter"]]
    hier = coeffs("hierarchical", c, k, n, chunks=1)[IDX["beta_inter"]]
    assert flat == pytest.approx(2 * (p - 1) / p * n)
    assert hier == pytest.approx(2 * (k - 1) / k * n)


@pytest.mark.unit
def test_latency_steps_ring_tree_torus():
    c = toy(g=8)
    k, p = 512, 4096
    lat = lambda alg, **kw: coeffs(alg, c, k, 1e3, **kw)  # noqa: E731
    ring = lat("flat")
    assert ring[IDX["alpha_inter"]] + ring[IDX["alpha_intra"]] == 2 * (p - 1)
    tree = lat("tree")
    assert tree[IDX["alpha_inter"]] == 2 * math.log2(k)
    x = square_torus_x(8, k)
    assert x == 64
    torus = lat("torus2d", torus_x=x, chunks=1)
    assert torus[IDX["alpha_inter"]] + torus[IDX["alpha_intra"]] == 2 * (x - 1) + 2 * (p // x - 1)
    assert (
        allreduce_cost("torus2d", c, k, 1e3, torus_x="square").time
        < allreduce_cost("flat", c, k, 1e3).time / 10
    )


@pytest.mark.unit
def test_multi_nic_ring_uses_every_nic():
    one, eight = toy(g=8, nics=1), replace(toy(g=8, nics=8), streams_per_ring=8)
    n = 1 << 28
    assert allreduce_cost("flat", one, 4, n).bandwidth == pytest.approx(
        8 * allreduce_cost("flat", eight, 4, n).bandwidth, rel=0.01
    )


@pytest.mark.unit
def test_gloo_pipeline_uses_grid_chunks():
    c = toy(g=2, backend="gloo")
    small, big = coeffs("hierarchical", c, 2, 1 << 20), coeffs("hierarchical", c, 2, 64 << 20)
    assert small[IDX["base"]] == 3  # one chunk: three stage calls
    assert big[IDX["base"]] == 3 + 15  # 16 chunks of 4 MiB: + 15 repeats of the slowest stage


@pytest.mark.unit
def test_fit_recovers_constants_from_model_generated_data():
    truth = toy(g=2, backend="gloo", gamma=1 / 3e9, beta_inter=1 / 0.12e9)
    rows = []
    for alg, opts in (("flat", {}), ("hierarchical", {}), ("torus2d", {"torus_x": 4})):
        for k in (2, 4):
            for n in (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20):
                cl = replace(truth, gpus_per_node=2)
                t = plan_for(alg, cl, k, n, **opts).cost(np.array(truth.constants.vector()))
                rows.append(Sample(alg, n, k, 2, t, None, opts.get("torus_x")))
    f, checks = cross_validate(
        rows, split_default(rows, ["torus2d"]), prior=get_cluster("netns-1g")
    )
    assert max(abs(c.error) for c in checks) < 1e-6
    assert f.constants.beta_inter == pytest.approx(truth.constants.beta_inter, rel=1e-6)
    assert f.constants.gamma == pytest.approx(truth.constants.gamma, rel=1e-6)


@pytest.mark.unit
def test_fit_scales_beta_inter_by_link_rate():
    truth = toy(g=2, backend="gloo", beta_inter=1 / 0.125e9)  # 1 Gbit/s
    rows = []
    for rate in (1e9, 0.5e9):
        for n in (1 << 20, 8 << 20, 64 << 20):
            cl = truth.with_constants(beta_inter=8 / rate)
            t = plan_for("flat", cl, 2, n).cost(np.array(cl.constants.vector()))
            rows.append(Sample("flat", n, 2, 2, t, rate))
    f = fit(rows)
    assert f.ref_rate in (1e9, 0.5e9)
    assert f.train_rms < 1e-6


@pytest.mark.unit
def test_overlap_hides_communication_behind_backward():
    c, m = get_cluster("dgx-a100"), get_model("bert-large")
    slow = TrainSpec(
        local_batch=64, algorithm="tree"
    )  # ~250 ms of compute: comm fits under backward
    r = step_time(m, slow, c, 64)
    last_bucket = allreduce_cost("tree", c, 64, bucket_sizes(m.params * m.grad_bytes, 25)[-1]).time
    assert 0 <= r.exposed <= last_bucket + 1e-12
    serial = step_time(m, replace(slow, overlap=False), c, 64)
    assert serial.step == pytest.approx(serial.compute + serial.comm + serial.optimizer)
    assert serial.step > r.step


@pytest.mark.unit
def test_efficiency_falls_with_scale_and_one_node_is_nearly_free():
    c, m = get_cluster("dgx-a100"), get_model("bert-large")
    rows = sweep(m, TrainSpec(local_batch=4), c, ["flat"], gpu_counts(c, 4096))
    effs = [r.efficiency for r in rows]
    assert effs == sorted(effs, reverse=True)
    assert effs[0] > 0.95 and effs[-1] < 0.05  # 8190 network steps per bucket at 4096 GPUs
    assert [r.gpus for r in rows] == [8 * 2**i for i in range(10)]


@pytest.mark.full_system
def test_time_to_train_counts_steps():
    c, m = get_cluster("dgx-a100"), get_model("bert-large")
    t = time_to_train(m, TrainSpec(local_batch=4, algorithm="tree"), c, 512)
    # the preset converges where NVIDIA's 512-node runs did: 5533303 sequences (logs), not at
    # MAX_STEPS=470
    assert t.steps == 338 and t.evals == 17
    assert t.total == pytest.approx(338 * t.step + t.eval_time)


@pytest.mark.unit
def test_validation_b_nccl_tests_busbw():
    v = nccl_busbw_a100()
    print(
        f"\n(b) predicted {v.predicted:.1f} GB/s vs nccl-tests ~{v.reference:g} GB/s "
        f"({v.error:+.1%})"
    )
    assert v.ok, f"{v.predicted:.1f} GB/s is not within 15 % of {v.reference}"


@pytest.mark.full_system
def test_validation_c_mlperf_bert_time_to_train():
    v = mlperf_bert()
    print(
        f"\n(c) predicted {v.predicted:.3f} min vs published {v.reference} min ({v.error:+.1%}); "
        f"{v.details}"
    )
    assert v.ok, f"{v.predicted:.3f} min is not within 30 % of {v.reference}"
    # With SHARP and the sharded update modelled, communication no longer dominates, so the MFU
    # guess matters: 30 % and the assumed 40 % are inside the tolerance (50 % gives -35 %,
    # docs/simulate.md).
    assert (
        mlperf_bert(mfu=0.3).ok
        and mlperf_bert(mfu=0.3).predicted > v.predicted > mlperf_bert(mfu=0.5).predicted
    )
    # DDP's replicated all-reduce on a flat ring without SHARP at 4096 GPUs would miss by far
    assert not mlperf_bert(algorithm="flat", optimizer="replicated", sharp=False).ok


@pytest.mark.unit
def test_validation_d_horovod_ring_vs_hierarchical():
    ring, hier, ablation = horovod_542()
    print(
        f"\n(d) ring {ring.predicted:.0f} % vs hierarchical {hier.predicted:.0f} % "
        f"(Horovod #542: 66 % vs 91 %); ablation {ablation}"
    )
    assert hier.predicted - ring.predicted >= 15  # published gap: 25 points
    assert abs(ring.predicted - 66) < 15 and abs(hier.predicted - 91) < 15
    # most of the gap is the single TCP stream per ring: with RDMA-like streams the ring recovers
    assert ablation["ring, one stream fills the NIC"] > ring.predicted + 10


@pytest.mark.unit
@pytest.mark.parametrize(
    "call, err, needle",
    [
        (lambda: get_cluster("dgx-z100"), ConfigError, "dgx-z100"),
        (lambda: get_model("gpt5"), ConfigError, "gpt5"),
        (
            lambda: allreduce_cost("butterfly", get_cluster("dgx-a100"), 2, 1e6),
            ConfigError,
            "butterfly",
        ),
        (
            lambda: allreduce_cost("torus2d", get_cluster("dgx-a100"), 2, 1e6, torus_x=3),
            TopologyError,
            "x=3",
        ),
        (lambda: allreduce_cost("flat", get_cluster("dgx-a100"), 0, 1e6), TopologyError, "got 0"),
        (lambda: custom_cluster(get_cluster("dgx-a100"), inter_gbit=-5), ConfigError, "-5"),
        (
            lambda: step_time(
                get_model("bert-large"), TrainSpec(local_batch=0), get_cluster("dgx-a100"), 1
            ),
            ConfigError,
            "local batch",
        ),
        (
            lambda: step_time(
                get_model("bert-large"), TrainSpec(local_batch=4), get_cluster("netns-1g"), 1
            ),
            ConfigError,
            "samples per second",
        ),
        (lambda: gpu_counts(get_cluster("dgx-a100"), 4), ConfigError, "whole number"),
    ],
)
def test_bad_input_is_a_one_line_error(call, err, needle):
    with pytest.raises(err, match=needle) as exc:
        call()
    assert "\n" not in str(exc.value)


@pytest.mark.full_system
def test_cli_validate_scale_calibrate(tmp_path, capsys):
    out = tmp_path / "v.json"
    assert main(["simulate", "validate", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "MLPerf v2.0 BERT" in text and "assumptions (c)" in text
    checks = json.loads(out.read_text())["checks"]
    assert [c["status"] for c in checks] == [
        "ok",
        "ok",
        "compare",
        "compare",
        "ok",
        "ok",
        "ok",
        "ok",
        "ok",
    ]

    png, js = tmp_path / "s.png", tmp_path / "s.json"
    # matplotlib: extra "plot", which the test extra installs too (never a silently smaller check)
    assert (
        main(
            [
                "simulate",
                "scale",
                "--preset",
                "dgx-h100",
                "--model",
                "resnet50",
                "sim.local_batch=256",
                "--max-gpus",
                "64",
                "--out",
                str(js),
                "--png",
                str(png),
            ]
        )
        == 0
    )
    rows = json.loads(js.read_text())["rows"]
    assert {r["gpus"] for r in rows} == {8, 16, 32, 64} and len(rows) == 16
    assert png.stat().st_size > 10_000

    truth = get_cluster("netns-1g")
    bench = []
    for alg in ("flat", "hierarchical", "torus2d"):
        for n in (1 << 20, 4 << 20, 16 << 20, 64 << 20):
            t = plan_for(alg, replace(truth, gpus_per_node=2), 2, n).cost(
                np.array(truth.constants.vector())
            )
            bench.append(
                {
                    "algorithm": alg,
                    "nbytes": n,
                    "nnodes": 2,
                    "nproc_per_node": 2,
                    "time_s": t,
                    "link_rate_bps": 1e9,
                }
            )
    src = tmp_path / "bench.json"
    src.write_text(json.dumps({"rows": bench}))
    assert main(["simulate", "calibrate", str(src), "--holdout", "torus2d", "--out", ""]) == 0
    assert "held-out rows: 8" in capsys.readouterr().out

    assert main(["simulate", "scale", "--preset", "nope", "--out", ""]) == 2
    assert "nope" in capsys.readouterr().err
