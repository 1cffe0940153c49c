"""Calibration on real measurements: `scaleout bench allreduce` on the emulated netns cluster.

Issue 8 (3a): constants fitted from the all-reduce bench on the emulated cluster must predict other
sizes and algorithms within +-20 %. We run the real bench one-shot (2 nodes x 2 ranks in network
namespaces, 1 Gbit/s tc-shaped links; flat, hierarchical and a 4 x 1 torus2d whose row spans both
nodes), fit on flat + hierarchical at every other size, and check the held-out sizes and the
held-out algorithm (torus2d). The links, not the 2 shared cores, set these times (1-16 MiB take
15-300 ms at ~117 MB/s), which is what makes the check stable on a busy machine; rows keep every run
and we fit the fastest (least disturbed). Needs root and iproute2, like
tests/launchers/test_netns.py; skipped
otherwise, and skipped with the reason printed when the box is so overloaded (> 10 runnable
processes per core) that the CPU cannot even keep a 1 Gbit/s link busy (seen here at load 63 on 2
cores: 16 MiB took 1.5x its link time). The schema tests below need nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from scaleout.errors import ConfigError
from scaleout.sim.calibrate import (
    cross_validate,
    load_samples,
    parse_rate,
    samples_from_rows,
    split_default,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = "1MiB,2MiB,4MiB,8MiB,16MiB"
TOLERANCE = 0.20
MAX_LOAD_PER_CORE = 10.0


# Timing on 2 shared cores: the fastest of 8 repeats is fitted (with 5, a neighbouring worker's
# burst of load during every repeat of one size made the suite rerun this test about once a run, at
# ~35 s a time); a rerun still re-measures, 20 s apart so that the burst has passed (the ±20 % bar
# is unchanged).
@pytest.mark.flaky(reruns=3, reruns_delay=20)
@pytest.mark.netns
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("tc") is None or shutil.which("ip") is None,
    reason="needs root and iproute2 (ip, tc) for the emulated cluster",
)
def test_fit_on_netns_bench_predicts_held_out_sizes_and_algorithm(tmp_path):
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > MAX_LOAD_PER_CORE * cores:
        pytest.skip(
            f"machine too busy for a timing fit: load {load:.1f} on {cores} cores (> "
            f"{MAX_LOAD_PER_CORE:g}/core)"
        )
    out = tmp_path / "allreduce.json"
    cmd = [
        sys.executable,
        "-m",
        "scaleout",
        "bench",
        "allreduce",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--netns",
        "--rate",
        "1gbit",
        "--sizes",
        SIZES,
        "--torus",
        "4x1",
        "--repeats",
        "8",
        "--out",
        str(out),
        "--png",
        "",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    samples = load_samples(out, stat="min")
    assert {s.algorithm for s in samples} == {"flat", "hierarchical", "torus2d"}
    assert all(s.link_rate_bps and 0.5e9 < s.link_rate_bps < 1.05e9 for s in samples)
    fit, checks = cross_validate(samples, split_default(samples, holdout_algorithms=["torus2d"]))
    held = [c for c in checks if not c.trained_on]
    report = "\n".join(
        f"{c.sample.algorithm:13s} {c.sample.nbytes:>9d} B  measured {c.sample.time_s * 1e3:8.2f} "
        "ms  "
        f"predicted {c.predicted * 1e3:8.2f} ms  {c.error:+.1%}{'  (fit)' if c.trained_on else ''}"
        for c in checks
    )
    print(f"\nfitted: {fit.constants.describe()}\n{report}")
    assert len(held) == 9 and {c.sample.algorithm for c in held} == {
        "flat",
        "hierarchical",
        "torus2d",
    }
    worst = max(abs(c.error) for c in held)
    assert worst <= TOLERANCE, f"held-out error {worst:.1%} > {TOLERANCE:.0%}\n{report}"
    # physical sanity: the fitted per-NIC bandwidth is within 30 % of the link rate the bench
    # measured
    link = samples[0].link_rate_bps / 8
    assert 0.7 * link < 1 / fit.constants.beta_inter < 1.3 * link, (link, fit.constants.describe())


@pytest.mark.unit
def test_schema_aliases_and_rates(tmp_path):
    rows = [
        {
            "algorithm": "flat",
            "bytes": 1 << 20,
            "nnodes": 2,
            "nproc_per_node": 2,
            "median_s": 0.01,
            "rate": "1gbit",
        }
    ]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"rows": rows}))
    (s,) = load_samples(path)
    assert (s.algorithm, s.nbytes, s.time_s, s.link_rate_bps) == ("flat", 1 << 20, 0.01, 1e9)
    assert parse_rate("500mbit") == 5e8 and parse_rate(2.5e9) == 2.5e9 and parse_rate(None) is None


@pytest.mark.unit
@pytest.mark.parametrize(
    "row, needle",
    [
        ({"algorithm": "flat", "nnodes": 2, "nproc_per_node": 2, "time_s": 1.0}, "'nbytes'"),
        (
            {"algorithm": "flat", "nbytes": 8, "nnodes": 2, "nproc_per_node": 2, "time_s": -1},
            "time -1",
        ),
        (
            {"algorithm": "butterfly", "nbytes": 8, "nnodes": 1, "nproc_per_node": 2, "time_s": 1},
            "butterfly",
        ),
        (
            {
                "algorithm": "flat",
                "nbytes": 8,
                "nnodes": 1,
                "nproc_per_node": 2,
                "time_s": 1,
                "rate": "fast",
            },
            "fast",
        ),
    ],
)
def test_bad_rows_are_one_line_errors(row, needle):
    with pytest.raises(ConfigError, match=needle) as exc:
        samples_from_rows([row])
    assert "\n" not in str(exc.value)


@pytest.mark.unit
def test_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_samples(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not JSON"):
        load_samples(bad)
