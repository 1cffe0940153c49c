"""Issue 41 item 2: a hung collective under NCCL ends with scaleout's verdict, not with the NCCL
watchdog's SIGABRT (scaleout/train/hangwatch.py). NCCL cannot run here: the drill runs gloo ranks
under ``SCALEOUT_TEST_NCCL_WATCHDOG=1``, a mock of NCCL only (a hung collective does not raise in
Python before the backend's timeout; at that timeout the rank prints ProcessGroupNCCL's watchdog
lines and aborts). The supervisor's side for srun's lines of such an abort:
tests/goodput/test_spares.py ``test_an_nccl_watchdog_abort_without_a_verdict_names_no_node``."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from scaleout.launchers.slurm_supervisor import bad_nodes, read_verdicts
from scaleout.train.faults import VERDICT_DIR
from scaleout.train.hangwatch import FLIGHT_DIR, HangWatch, verdict_allowance_s
from scaleout.train.liveness import Progress, period_for
from scaleout.world import World, nccl_flight_recorder


@pytest.mark.unit
def test_the_watch_fires_after_the_budget_at_one_point_of_a_waiting_phase_only() -> None:
    now = [0.0]
    progress = Progress()
    watch = HangWatch(progress, lambda: 10.0, lambda what: None, clock=lambda: now[0])
    progress.at(3, "forward")  # a long forward waits for nobody: never a hang here
    for now[0] in (0.0, 50.0):
        assert watch.check() is None
    progress.at(3, "agreement")
    for now[0] in (50.0, 55.0, 59.9):
        assert watch.check() is None
    now[0] = 60.0
    found = watch.check()
    assert found is not None and "no progress for 10 s at step 3 in agreement" in found, found
    progress.collectives += 1  # a collective issued: progress, the budget starts again
    now[0] = 65.0
    assert watch.check() is None
    now[0] = 74.0
    assert watch.check() is None


@pytest.mark.unit
def test_the_backend_timeout_leaves_the_verdict_its_time_and_the_recorder_dumps_in_the_run(
    tmp_path: Path,
) -> None:
    """NCCL's own timeout is the budget plus the liveness scan's hard deadline plus the dump, so
    the watchdog cannot abort a rank in the middle of its verdict; the flight recorder is on and
    dumps into the run directory; an explicit setting wins."""
    for t in (2.0, 120.0, 300.0, 1800.0):
        scan = 2.0 * (2.0 * period_for(t)) + 10.0  # liveness.unresponsive's own limit
        assert verdict_allowance_s(t) > scan
    world = World(SimpleNamespace(), "cpu", "nccl", (0,), 300.0)
    assert world.backend_timeout().total_seconds() == 300.0
    world.backend_slack = verdict_allowance_s
    assert world.backend_timeout().total_seconds() == 300.0 + verdict_allowance_s(300.0)
    env = {"TORCH_FR_BUFFER_SIZE": "100"}
    nccl_flight_recorder(env, str(tmp_path / "run"))
    folder = tmp_path / "run" / "flight-recorder"
    assert folder.is_dir() and env["TORCH_FR_DUMP_TEMP_FILE"] == str(folder / "rank_")
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(folder / "rank_")
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and env["TORCH_FR_BUFFER_SIZE"] == "100"
    fresh: dict[str, str] = {}
    nccl_flight_recorder(fresh, None)  # this torch (2.13) warns on the deprecated name: not set
    assert fresh["TORCH_FR_BUFFER_SIZE"] == "2000" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in fresh


def _mocked_nccl_run(tmp_path: Path, mode: str, hang: str) -> tuple[str, Path]:
    """2 nodes x 1 tiny BERT, train.step_timeout_s=2, ``SCALEOUT_TEST_NCCL_WATCHDOG=mode``, rank
    1 stuck at step 1's forward (``hang``: SCALEOUT_TEST_HANG's suffix): (its output, the verdict
    folder)."""
    from test_faults import _train_cmd  # the same tiny run as the gloo drills

    verdicts = tmp_path / "verdicts"
    verdicts.mkdir()
    cmd = _train_cmd(
        tmp_path,
        "data.source=synthetic",
        "train.step_timeout_s=2",
        "train.max_steps=4",
        "train.eval_every=100000",
        nnodes=2,
        nproc=1,
        grace=1,
    )
    env = {
        **os.environ,
        "SCALEOUT_TEST_NCCL_WATCHDOG": mode,
        "SCALEOUT_TEST_HANG": "1:1:forward" + hang,
        VERDICT_DIR: str(verdicts),
        "TORCH_FR_BUFFER_SIZE": "200",  # the flight recorder, on by default on NCCL only
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    return proc.stdout + proc.stderr, verdicts


@pytest.mark.full_system
@pytest.mark.parametrize("fault", ["stop", "hang"])
def test_a_hung_collective_under_nccl_ends_with_the_verdict_not_the_watchdog_abort(
    tmp_path: Path, fault: str
) -> None:
    """2 nodes x 1 tiny BERT, train.step_timeout_s=2, NCCL's semantics mocked on gloo (module
    docstring): rank 1 stops at step 1's forward (SIGSTOP: no heartbeat) or sleeps there (its
    heartbeat alive). The waiting rank's hang watch runs out at the budget, names rank 1 and
    exits 1 before the mocked watchdog's abort (budget + verdict allowance), leaving the flight
    recorder's dump in the run directory; no rank aborts. With SIGSTOP
    the verdict file names node 1 and the supervisor picks its host. Before: nothing ran
    before the watchdog, every rank died of SIGABRT, no verdict was written, and srun's first
    "Aborted" line named a healthy node."""
    text, verdicts = _mocked_nccl_run(tmp_path, "1", ":stop" if fault == "stop" else "")
    assert "Watchdog caught collective operation timeout" not in text, text[-3000:]
    assert "SIGABRT" not in text and "Aborted" not in text, text[-3000:]
    watched = re.findall(r"rank (\d) \([^)]*\): no progress for \d+ s at step 1 in ", text)
    assert watched == ["0"], text[-3000:]
    lines = [x for x in text.splitlines() if ": verdict: " in x]
    assert lines and all("rank 1 (node 1, local rank 0)" in x for x in lines), text[-3000:]
    # the flight recorder's dump, in NCCL's format, where fr_trace finds it: the waiting rank's
    # collectives, the one it waits in not retired
    dump = pickle.loads((tmp_path / "out" / FLIGHT_DIR / "rank_0").read_bytes())
    hung = [e["profiling_name"] for e in dump["entries"] if not e["retired"]]
    assert hung and all("gloo:" in name for name in hung), dump["entries"][-3:]
    found = read_verdicts(verdicts)
    assert found and all(v["rank"] == 0 for v in found), found
    named = bad_nodes(found, ["host-a", "host-b"], [])
    if fault == "stop":
        assert all(v["stale_nodes"] == [1] for v in found), found
        assert list(named) == ["host-b"], named
    else:  # alive and behind: named in the verdict, no node's fault by the heartbeat
        assert all(v["stale_nodes"] == [] for v in found), found
        assert "behind" in lines[0], lines[0]


@pytest.mark.extended  # minutes on 2 cores: python3 -m pytest -m extended (docs/testing.md)
@pytest.mark.full_system
def test_without_the_watch_every_waiting_rank_aborts_and_the_supervisor_names_nobody(
    tmp_path: Path,
) -> None:
    """What NCCL ranks did before the hang watch (``SCALEOUT_TEST_NCCL_WATCHDOG=abort-only``: the
    mocked watchdog alone): rank 1 stops at step 1's forward, rank 0 waits and, at the backend's
    timeout, prints the watchdog's lines and dies of SIGABRT, leaving no verdict. srun reports
    that exit as "task 0: Aborted": the supervisor used to quarantine its host (healthy: rank 0
    only waited); with no verdict it now names nobody."""
    text, verdicts = _mocked_nccl_run(tmp_path, "abort-only", ":stop")
    assert "Watchdog caught collective operation timeout" in text, text[-3000:]
    last = text.strip().splitlines()[-1]
    assert re.search(r"rank 0 \(node 0, local rank 0\) was killed by SIGABRT", last), last
    assert read_verdicts(verdicts) == [] and ": verdict: " not in text, text[-3000:]
    # srun's words for that exit, as the supervisor reads them from the job's output
    srun = ["srun: error: host-a: task 0: Aborted (core dumped)"]
    assert bad_nodes(read_verdicts(verdicts), ["host-a", "host-b"], srun) == {}
