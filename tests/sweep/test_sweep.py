"""scaleout sweep: real local sweeps (real ranks, real gloo, the real trainer), the batch and
node-shape arithmetic, the efficiency formulas, one-line errors before anything starts, and a
real Slurm sweep."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import subprocess

import pytest

from scaleout.argtypes import parse_csv
from scaleout.cli import main
from scaleout.errors import UserError
from scaleout.sweep import (
    PointResult,
    SweepPoint,
    add_efficiency,
    node_shapes,
    plan_points,
    read_point,
)
from scaleout.sweep.results import median_run

# A ResNet-18 of width 4 on 16 px images: the smallest real model the trainer runs (startup
# dominates).
# synthetic images: the sweep's plumbing, not resnet_cpu's Fashion-MNIST (written on first use)
TINY = [
    "data.source=synthetic",
    "data.prepare=none",
    "data.num_workers=0",
    "model.resnet.bn_group=1",
    "model.resnet.width=4",
    "model.resnet.image_size=16",
    "data.eval_samples=16",
]


def _rows(path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def _check_sweep_outputs(
    out, worlds: list[int], per_rank: int, steps: int, warmup: int
) -> list[dict]:
    """What every finished sweep must satisfy, whatever the launcher."""
    rows = _rows(out / "sweep.csv")
    assert [int(r["world"]) for r in rows] == worlds
    assert all(r["status"] == "ok" for r in rows), rows
    for r in rows:
        n = int(r["world"])
        assert int(r["global_batch"]) == per_rank * n and int(r["per_rank_batch"]) == per_rank
        assert int(r["timed_steps"]) == steps - warmup
        step_s, sps = float(r["step_s"]), float(r["samples_per_s"])
        assert 0 < step_s < 60 and sps > 0
        # ResNet samples = images = global batch: throughput is exactly batch / step time.
        assert math.isclose(sps, per_rank * n / step_s, rel_tol=1e-6)
        phases = [
            float(r[f"{k}_s"]) for k in ("data", "compute", "exposed_comm", "optimizer", "other")
        ]
        assert all(v >= 0 for v in phases) and float(r["compute_s"]) > 0
        assert sum(phases) >= step_s * 0.999  # "other" closes the gap: nothing of the step is lost
        report = json.loads(open(r["report"]).read())
        assert report["devices"] == n and report["weights_consistent"] is True
        assert report["timed"]["steps"] == steps - warmup
        assert report["timed"]["samples"] == per_rank * n * (steps - warmup)
    base = rows[0]
    x1 = float(base["samples_per_s"]) / int(base["world"])
    assert math.isclose(float(base["efficiency"]), 1.0)
    for r in rows:
        n = int(r["world"])
        assert math.isclose(
            float(r["efficiency"]), float(r["samples_per_s"]) / n / x1, rel_tol=1e-6
        )
        assert math.isclose(float(r["ideal_samples_per_s"]), x1 * n, rel_tol=1e-6)
    return rows


@pytest.mark.full_system
def test_real_local_sweep_writes_csv_json_md_png(tmp_path, capsys):
    """world 1 (one node) and 2 (two emulated nodes x 1 rank), weak scaling, 3 steps of which 2
    are timed."""
    out = tmp_path / "sweep"
    threads_before = os.environ.get("OMP_NUM_THREADS")
    rc = main(
        [
            "sweep",
            "resnet_cpu",
            "--world",
            "1,2",
            "--nproc-per-node",
            "1",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--per-rank-batch",
            "4",
            "--threads-per-rank",
            "1",
            "--simulate",
            "netns-1g",
            "--out-dir",
            str(out),
            *TINY,
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    assert (
        os.environ.get("OMP_NUM_THREADS") == threads_before
    )  # the ranks got it, this process did not
    rows = _check_sweep_outputs(out, [1, 2], per_rank=4, steps=3, warmup=1)
    assert [(int(r["nodes"]), int(r["ranks_per_node"])) for r in rows] == [(1, 1), (2, 1)]
    # Progress per point, the table and the honesty note are printed.
    assert "[1/2] world 1" in text and "[2/2] world 2" in text and "| GPUs |" in text
    assert "CPU cores" in text and "OMP_NUM_THREADS=1" in text
    data = json.loads((out / "sweep.json").read_text())
    assert data["mode"] == "weak" and [p["world"] for p in data["points"]] == [1, 2]
    assert any("CPU cores" in n for n in data["notes"])
    sim = [p["simulated_efficiency"] for p in data["points"]]
    assert (
        sim[0] == pytest.approx(1.0) and 0 < sim[1] <= 1.0
    )  # the cost model: communication only costs
    md = (out / "sweep.md").read_text()
    assert md.startswith("## scaleout sweep: resnet_cpu, weak scaling") and "| 2    | 2x1" in md
    png = (out / "sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


@pytest.mark.unit
def test_weak_and_strong_batch_arithmetic():
    weak = plan_points([4, 1, 2], "weak", 8, ranks_per_node=2)
    assert [
        (p.world, p.nodes, p.ranks_per_node, p.global_batch, p.per_rank_batch) for p in weak
    ] == [(1, 1, 1, 8, 8), (2, 1, 2, 16, 8), (4, 2, 2, 32, 8)]
    strong = plan_points([1, 2, 4], "strong", 32, ranks_per_node=2)
    assert [(p.global_batch, p.per_rank_batch) for p in strong] == [(32, 32), (32, 16), (32, 8)]
    # grad_accum: the per-rank batch is split into micro-batches, so it must divide (weak) ...
    assert [p.global_batch for p in plan_points([1, 2], "weak", 6, grad_accum=2)] == [6, 12]
    with pytest.raises(UserError, match="per-rank batch 6 is not divisible by train.grad_accum=4"):
        plan_points([1, 2], "weak", 6, grad_accum=4)
    # ... and strong needs N x grad_accum to divide the global batch.
    with pytest.raises(
        UserError, match=r"global batch 20 is not divisible by world size 4 x train.grad_accum=2"
    ):
        plan_points([1, 2, 4], "strong", 20, grad_accum=2)
    assert plan_points([2], "weak", 8)[0].name == "w002-2x1"  # no shape given: one rank per node


@pytest.mark.unit
def test_node_shapes_from_nproc_per_node_or_nodes():
    # --nproc-per-node G: N <= G on one (partly filled) node, larger N on N / G full nodes.
    assert node_shapes([1, 2, 4, 8], None, 2) == [(1, 1), (1, 2), (2, 2), (4, 2)]
    assert node_shapes([1, 2, 4, 8], None, 8) == [(1, 1), (1, 2), (1, 4), (1, 8)]
    assert node_shapes([1, 2, 4], [1, 2, 2], None) == [(1, 1), (2, 1), (2, 2)]
    assert [(p.world, p.nodes) for p in plan_points([4, 2], "weak", 1, nodes=[4, 1])] == [
        (2, 1),
        (4, 4),
    ]
    with pytest.raises(UserError, match="--world 6 is not divisible by --nproc-per-node 4"):
        node_shapes([1, 6], None, 4)
    with pytest.raises(UserError, match="--nnodes has 2 entries but --world has 3"):
        node_shapes([1, 2, 4], [1, 2], None)
    with pytest.raises(UserError, match="--world 3 on --nnodes 2"):
        node_shapes([3], [2], None)
    with pytest.raises(UserError, match="each world size once"):
        node_shapes([2, 2], None, 1)
    assert parse_csv(" 1, 2,4 ", "--world", int, at_least=1) == [1, 2, 4]
    for bad in ("1,x", "0,2", ""):
        with pytest.raises(UserError, match="--world"):
            parse_csv(bad, "--world", int, at_least=1)


def _result(world: int, global_batch: int, step_s: float, steps: int = 4) -> PointResult:
    p = SweepPoint(world, 1, world, global_batch)
    return PointResult(p, "ok", 1.0, steps, global_batch * steps, 0, step_s * steps)


@pytest.mark.unit
def test_efficiency_formulas_and_median_of_rounds():
    # Weak: per-rank throughput relative to the base; base 8 samples in 1 s, world 4: 32 in 1.25 s
    # -> 80 %.
    weak = [_result(1, 8, 1.0), _result(4, 32, 1.25)]
    add_efficiency(weak, "weak")
    assert weak[0].efficiency == pytest.approx(1.0) and weak[1].efficiency == pytest.approx(0.8)
    assert weak[1].ideal_samples_per_s == pytest.approx(32.0)
    # Strong: T1 / (N TN); same global batch 32, 8 s on 1 rank, 2.5 s on 4 -> 80 %.
    strong = [_result(1, 32, 8.0), _result(4, 32, 2.5)]
    add_efficiency(strong, "strong")
    assert strong[1].efficiency == pytest.approx(0.8)
    # A base larger than 1: b T_b / (N T_N) with b = 2.
    strong2 = [_result(2, 32, 4.0), _result(8, 32, 1.25)]
    add_efficiency(strong2, "strong")
    assert strong2[1].efficiency == pytest.approx(0.8)
    # A failed point gets no efficiency and does not become the base.
    failed = PointResult(SweepPoint(1, 1, 1, 8), "failed: boom")
    mixed = [failed, _result(2, 16, 1.0), _result(4, 32, 2.0)]
    assert add_efficiency(mixed, "weak").point.world == 2
    assert failed.efficiency is None and mixed[2].efficiency == pytest.approx(0.5)
    # Rounds: the median step time is kept, the spread recorded, failures ignored.
    rounds = [
        _result(2, 16, 3.0),
        PointResult(SweepPoint(2, 1, 2, 16), "failed: x"),
        _result(2, 16, 1.0),
        _result(2, 16, 2.0),
    ]
    pick = median_run(rounds)
    assert (
        pick.step_s == pytest.approx(2.0)
        and pick.runs == 3
        and pick.step_s_range == pytest.approx((1.0, 3.0))
    )


@pytest.mark.unit
def test_read_point_rejects_reports_without_timed_steps(tmp_path):
    p = SweepPoint(2, 1, 2, 8)
    assert read_point(p, tmp_path / "missing.json", 1.0).status.startswith("failed: no report")
    bad = tmp_path / "report.json"
    bad.write_text(json.dumps({"devices": 2, "breakdown_s": {}}))
    assert "no timed steps" in read_point(p, bad, 1.0).status
    bad.write_text(json.dumps({"devices": 4, "timed": {"steps": 2, "samples": 16, "seconds": 1.0}}))
    assert "ran on 4 ranks, expected 2" in read_point(p, bad, 1.0).status
    good = {
        "devices": 2,
        "timed": {"steps": 2, "samples": 16, "tokens": 0, "seconds": 1.0},
        "breakdown_s": {
            "data": 0.01,
            "forward": 0.1,
            "backward": 0.2,
            "exposed_comm": 0.05,
            "optimizer": 0.04,
        },
    }
    bad.write_text(json.dumps(good))
    r = read_point(p, bad, 1.0)
    assert r.ok and r.step_s == 0.5 and r.samples_per_s == 16.0
    assert r.breakdown_s["compute"] == pytest.approx(0.3) and r.breakdown_s[
        "other"
    ] == pytest.approx(0.1)


BAD = [
    (
        ["--world", "1,3", "--nproc-per-node", "2"],
        "--world 3 is not divisible by --nproc-per-node 2",
    ),
    (
        ["--world", "1,2,3", "--mode", "strong", "--global-batch", "8", "--nproc-per-node", "1"],
        "global batch 8 is not divisible by world size 3",
    ),
    (
        ["--world", "1,2", "--launcher", "pbs"],
        "--launcher='pbs': expected one of local, netns, slurm, submit",
    ),
    (["--world", "1,2", "--mode", "linear"], "--mode='linear': expected weak or strong"),
    (
        ["--world", "1,2", "--mode", "strong", "--per-rank-batch", "4"],
        "strong scaling fixes the global batch",
    ),
    (["--world", "1,2", "--steps", "2", "--warmup", "2"], "at least one timed step"),
    (["--world", "1,2", "--repeats", "0"], "--repeats=0: expected an integer >= 1"),
    (["--world", "1,2", "--nnodes", "1"], "--nnodes has 1 entries but --world has 2"),
    (
        ["--world", "1,4", "--nproc-per-node", "1", "model.resnet.bn_group=2"],
        "sweep point world 1 (1 nodes x 1): model.resnet.bn_group=2 must divide the world size 1",
    ),
    (["--world", "1,2", "train.nonsense=1"], "unknown key train.nonsense"),
    (["--world", "1,2", "--simulate", "nosuch"], "unknown cluster preset 'nosuch'"),
]


@pytest.mark.full_system
@pytest.mark.parametrize("argv,message", BAD, ids=[m[:30] for _, m in BAD])
def test_bad_input_is_one_line_before_anything_starts(tmp_path, capsys, argv, message):
    out = tmp_path / "sweep"
    rc = main(
        ["sweep", "resnet_cpu", "--out-dir", str(out), *TINY, *argv]
    )  # argv's overrides come last: win
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("scaleout sweep: error: ") and "\n" not in err, err
    assert message in err, err
    assert not out.exists()  # no point was started: nothing written


@pytest.mark.netns
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("tc") is None or shutil.which("ip") is None,
    reason="needs root and iproute2 (ip, tc)",
)
def test_sweep_on_the_emulated_netns_cluster(tmp_path, capsys):
    """--netns: the 2 nodes run in their own namespaces behind 1 Gbit/s links. Success is the
    proof: the rendezvous address (node 0's namespace address) is unreachable from outside the
    namespaces."""
    out = tmp_path / "sweep"
    rc = main(
        [
            "sweep",
            "resnet_cpu",
            "--world",
            "2",
            "--nproc-per-node",
            "1",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--per-rank-batch",
            "4",
            "--threads-per-rank",
            "1",
            "--netns",
            "--rate",
            "1gbit",
            "--no-png",
            "--out-dir",
            str(out),
            *TINY,
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    _check_sweep_outputs(out, [2], per_rank=4, steps=2, warmup=1)
    assert json.loads((out / "sweep.json").read_text())["netns_rate"] == "1gbit"
    assert "(netns 1gbit)" in text and not (out / "sweep.png").exists()
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"sw{os.getpid() % 100000}-n" not in left  # the sweep's private cluster is torn down


@pytest.mark.slurm
def test_sweep_on_the_local_slurm_cluster(slurm_cluster, tmp_path):
    """--launcher slurm: one sbatch job per point (world 1 on 1 node, world 2 on 2 nodes x 1
    task), with the production default of one (emulated) GPU per task; each job's report.json is
    collected."""
    out = tmp_path / "sweep"
    p = slurm_cluster.run(
        [
            "scaleout",
            "sweep",
            "resnet_cpu",
            "--world",
            "1,2",
            "--nnodes",
            "1,2",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--per-rank-batch",
            "4",
            "--launcher",
            "slurm",
            "--time",
            "5",
            "--out-dir",
            str(out),
            *TINY,
        ],
        timeout_s=300,
        check=False,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    _check_sweep_outputs(out, [1, 2], per_rank=4, steps=3, warmup=1)
    data = json.loads((out / "sweep.json").read_text())
    assert data["launcher"] == "slurm" and any("CPU cores" in n for n in data["notes"])
    log = (out / "points" / "w002-2x1" / "launch.log").read_text()
    assert "samples/s" in log  # rank 0's report, written by the Slurm job into the point's log
