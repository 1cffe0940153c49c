"""scaleout.horovod, the horovod.torch subset on scaleout: real gloo processes (2 emulated nodes x
2), a Horovod-style training script checked against the same training in one process, for every
algorithm."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distutil import run_dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "horovod"))
import hvd_train  # noqa: E402

pytestmark = pytest.mark.horovod


def _api_and_training(world, cases):
    import scaleout.horovod as hvd
    from scaleout.errors import UserError

    out: dict = {}
    hvd.init(world=world, algorithm="hierarchical")
    r, n = hvd.rank(), hvd.size()
    out["ids"] = (r, n, hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size())
    t = torch.full((5,), float(r + 1))
    avg = hvd.allreduce(t)
    out["avg"] = avg.tolist()
    out["input_untouched"] = t.tolist()
    out["sum"] = hvd.allreduce(t, op=hvd.Sum).tolist()
    out["sum_legacy"] = hvd.allreduce(t, average=False).tolist()
    h = hvd.allreduce_async_(t, op=hvd.Sum, prescale_factor=2.0)
    out["async_inplace"] = (hvd.synchronize(h) is t, t.tolist())
    out["fp16_dtype"] = hvd.allreduce(
        torch.full((3,), 0.5 * (r + 1)), compression=hvd.Compression.fp16
    ).dtype
    out["bcast"] = hvd.broadcast(torch.tensor([float(r)]), root_rank=2).item()
    out["bcast_obj"] = hvd.broadcast_object({"from": r}, root_rank=1)
    out["gather_obj"] = hvd.allgather_object(r * 10)
    errors = []
    for bad in (
        lambda: hvd.allreduce(t, op="max"),
        lambda: hvd.broadcast(t, root_rank=n),
        lambda: hvd.init(world=world, algorithm="ring9"),
    ):
        try:
            bad()
        except UserError as exc:
            errors.append(str(exc))
    out["errors"] = errors
    for name, alg, passes, comp in cases:
        hvd.init(world=world, algorithm=alg)  # already initialised: switches the algorithm
        out[name] = hvd_train.train(passes=passes, compression=comp)
    hvd.shutdown()
    return out


CASES = [
    ("flat", "flat", 1, "none"),
    ("hierarchical", "hierarchical", 1, "none"),
    ("torus2d", "torus2d", 1, "none"),
    ("passes2", "hierarchical", 2, "none"),
    ("fp16", "torus2d", 1, "fp16"),
]


def test_horovod_api_and_training_on_every_algorithm():
    res = run_dist(_api_and_training, 2, 2, args=(CASES,), timeout=300)
    assert [x["ids"] for x in res] == [
        (0, 4, 0, 2, 0, 2),
        (1, 4, 1, 2, 0, 2),
        (2, 4, 0, 2, 1, 2),
        (3, 4, 1, 2, 1, 2),
    ]
    for r, x in enumerate(res):
        assert x["avg"] == [2.5] * 5 and x["input_untouched"] == [float(r + 1)] * 5
        assert x["sum"] == [10.0] * 5 and x["sum_legacy"] == [10.0] * 5
        assert x["async_inplace"] == (True, [20.0] * 5)
        assert x["fp16_dtype"] == torch.float32  # travelled as fp16, returned in the input dtype
        assert (
            x["bcast"] == 2.0
            and x["bcast_obj"] == {"from": 1}
            and x["gather_obj"] == [0, 10, 20, 30]
        )
        assert len(x["errors"]) == 3
        assert "hvd.Average, hvd.Sum, hvd.Min" in x["errors"][0] and "root_rank=4" in x["errors"][1]
        assert "ring9" in x["errors"][2]
    want = {1: hvd_train.reference(4, passes=1), 2: hvd_train.reference(4, passes=2)}
    for name, _alg, passes, comp in CASES:
        for r, x in enumerate(res):
            for key, value in want[passes].items():
                tol = 2e-3 if comp == "fp16" else 1e-5
                assert torch.allclose(x[name][key], value, atol=tol, rtol=tol), (
                    f"{name} rank {r} {key}"
                )
                assert torch.equal(x[name][key], res[0][name][key]), (
                    f"{name}: ranks disagree on {key}"
                )
    # fp16 on the wire really is lossy: not bit-identical to the fp32 run
    assert any(not torch.equal(res[0]["fp16"][k], res[0]["torus2d"][k]) for k in want[1])


def test_horovod_script_under_scaleout_launch(tmp_path):
    """The script itself, with hvd.init() reading the launcher's environment (2 emulated nodes x
    2)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "OMPI_", "PMIX_", "HOROVOD_"))
    }
    env.update(SCALEOUT_ALGORITHM="torus2d", OMP_NUM_THREADS="1")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "scaleout",
            "launch",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "2",
            "--",
            "python",
            "tests/horovod/hvd_train.py",
            "--out",
            str(tmp_path / "w.pt"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "size 4 local_size 2 cross_size 2 algorithm torus2d" in p.stdout
    got = torch.load(tmp_path / "w.pt", weights_only=True)
    for key, value in hvd_train.reference(4).items():
        assert torch.allclose(got[key], value, atol=1e-5, rtol=1e-5), key


# Not find_spec("horovod"): under pytest (tests/ on sys.path) that finds this folder.
@pytest.mark.skipif(
    shutil.which("horovodrun") is None,
    reason="the real horovod is not installed (no horovodrun; see docs/launchers.md)",
)
def test_horovodrun_environment_is_detected():
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "OMPI_", "PMIX_", "SCALEOUT_"))
    }
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run(
        [
            "horovodrun",
            "-np",
            "2",
            "-H",
            "localhost:2",
            "--gloo",
            sys.executable,
            "-m",
            "scaleout",
            "smoke",
            "--numel",
            "1000",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "launcher environment : horovod" in p.stdout and "result               : OK" in p.stdout
