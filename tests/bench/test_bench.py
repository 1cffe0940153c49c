"""Every benchmark runs, end to end, with its tiny settings (``SMOKE_ARGS`` in its module): a
change to DataParallel, the optimizers, the trainer or the data path that breaks a benchmark
fails here, not on the next person who runs it. What a benchmark measures is checked by its own
tests (test_bench_allreduce.py, test_bench_largebatch.py, ...); here: the real command line exits
0 and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scaleout.cli.bench import benches

pytestmark = pytest.mark.full_system

BENCHES = {m.NAME: m for m in benches()}
# A benchmark whose own test file runs it end to end through the same CLI with its SMOKE_ARGS names
# that test in SMOKE_TEST (checked below to exist), so the suite does not pay for the same launches
# twice.
OWN_TEST = {name for name, m in BENCHES.items() if getattr(m, "SMOKE_TEST", None)}


def test_every_benchmark_declares_tiny_settings() -> None:
    missing = [
        name for name, m in BENCHES.items() if not isinstance(getattr(m, "SMOKE_ARGS", None), list)
    ]
    assert not missing, (
        f"benchmarks without SMOKE_ARGS (their tiny settings for this test): {missing}"
    )
    root = Path(__file__).resolve().parents[2]
    for name in OWN_TEST:
        path, _, test = BENCHES[name].SMOKE_TEST.partition("::")
        src = (root / path).read_text()
        assert f"def {test}(" in src and f"{name}.SMOKE_ARGS" in src, (
            f"{name}: SMOKE_TEST {BENCHES[name].SMOKE_TEST}"
        )


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(set(BENCHES) - OWN_TEST))
def test_benchmark_runs_with_tiny_settings(name: str, tmp_path: Path) -> None:
    mod = BENCHES[name]
    out = tmp_path / f"{name}.json"
    argv = [sys.executable, "-m", "scaleout", "bench", name, *mod.SMOKE_ARGS, "--out", str(out)]
    if "--png" in _flags(name):
        argv += ["--png", str(tmp_path / f"{name}.png")]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=840, cwd=tmp_path)
    assert r.returncode == 0, f"{' '.join(argv[2:])}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    payload = json.loads(out.read_text())
    assert payload["bench"] == name and payload["machine"]["cpus"] >= 1, sorted(payload)
    assert "|---" in r.stdout  # the Markdown table


def _flags(name: str) -> set[str]:
    import argparse

    p = argparse.ArgumentParser()
    BENCHES[name].add_arguments(p)
    return {s for a in p._actions for s in a.option_strings}
