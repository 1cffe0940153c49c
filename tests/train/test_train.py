"""`scaleout train` end to end on real processes: MLPerf log + compliance checker, bitwise resume
after a real preemption signal, every rank skipping a step when one rank's gradients are NaN, kill
-9 of a rank.

The runs use the tiny BERT config on the offline corpus with a small batch and few steps: they check
behaviour, not quality (quality is the README's main command, measured separately).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.full_system

FAST = [
    "train.global_batch=16",
    "data.eval_samples=32",
    "optim.warmup_steps=2",
    "optim.total_steps=8",
    "train.progress=false",
]


def _cmd(tmp: Path, nnodes: int, nproc: int, *overrides: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "scaleout",
        "launch",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc),
        "--",
        "scaleout",
        "train",
        "bert_tiny_cpu",
        *FAST,
        f"train.output_dir={tmp / 'out'}",
        f"checkpoint.dir={tmp / 'ckpt'}",
        *overrides,
    ]


def _run(
    cmd: list[str], timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def _final_weights(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    from scaleout.checkpoint import Checkpointer

    state, _ = Checkpointer(ckpt_dir).load_latest()
    return state["model"]


def test_train_2x2_mlperf_log_passes_checker(tmp_path: Path) -> None:
    """2 nodes x 2 ranks, packed data + hierarchical all-reduce + LAMB; the log passes the real
    checker."""
    from scaleout.telemetry.mlperf import check_compliance

    auto = ["checkpoint.every_steps=auto", "checkpoint.mtbf_h=0.0002"]
    r = _run(_cmd(tmp_path, 2, 2, "train.max_steps=4", "train.eval_every=2", *auto))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "time to train (run_start -> run_stop)" in r.stdout
    # every_steps=auto: the first save (after step 1) measures the stall, Young/Daly picks the
    # interval from it and the agreed step time, and the saves follow that interval
    every = [int(n) for n in re.findall(r"every_steps=auto: .* -> every (\d+) steps", r.stdout)]
    saved = [int(n) for n in re.findall(r"checkpoint: step (\d+) ->", r.stdout)]
    assert every and saved[0] == 1, r.stdout[-3000:]
    want = [1]
    for n in every:
        if want[-1] + n <= 4:
            want.append(want[-1] + n)
    assert saved[: len(want)] == want and set(saved) <= {*want, 4}, (every, saved)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert (
        report["weights_consistent"] is True
        and report["steps"] == 4
        and report["skipped_steps"] == 0
    )
    assert report["task"]["packing"]["efficiency"] > 0.9
    assert report["task"]["attention"] == {  # fp32: SDPA, nothing measured
        "kernel": "sdpa",
        "reason": "auto on cpu in fp32: the two kernels are within noise",
        "probe_ms": None,
    }
    # MFU against the peak measured on this CPU: a real fraction, not the nominal-peak number it
    # used to be
    assert "measured" in report["peak_source"] and 0 < report["mfu"] <= 1
    # The one rule a 4-step CPU run cannot meet is the closed-division quality threshold (masked-LM
    # The one rule a 4-step CPU run cannot meet is the closed-division quality threshold (masked-LM
    # accuracy
    # >= 0.720): it is replaced by the accuracy this run reached; every other rule of the ruleset
    # applies.
    ok, out = check_compliance(
        tmp_path / "out" / "mlperf.log", "bert", quality_target=report["achieved"]
    )
    assert ok, out[-3000:]


def test_resume_after_preemption_is_bitwise_identical(tmp_path: Path) -> None:
    """The flagship's optimizer path on 2 x 2 ranks (the sharded LAMB within the node, overlapped
    buckets, the hierarchical all-reduce): SIGUSR2 mid-run -> every rank stops at the same step,
    checkpoints its shard, exits 75; rerun resumes; the final weights equal an uninterrupted
    run's bit for bit (CPU, deterministic mode), dropout on: the checkpoint holds no RNG state,
    each step seeds its streams from (seed, step, rank), so the resumed steps draw the
    uninterrupted run's masks. A pruned checkpoint takes its shard folder with it."""
    steps = [
        "model.bert.dropout=0.1",
        "train.max_steps=8",
        "train.eval_every=1",
        "train.deterministic=true",
        "optim.sharded=true",
        "optim.overlap_comm=true",
        "comm.algorithm=hierarchical",
    ]
    ref = _run(_cmd(tmp_path / "ref", 2, 2, *steps))
    assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-2000:]

    cmd = _cmd(tmp_path / "pre", 2, 2, *steps)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "step 3: mlm_accuracy" in line:
            proc.send_signal(signal.SIGUSR2)  # the launcher forwards it to every rank, as srun does
            break
    out = "".join(lines) + proc.stdout.read()
    proc.wait(timeout=120)
    assert proc.returncode == 75, out[-3000:]
    saved = sorted(p.name for p in (tmp_path / "pre" / "ckpt").glob("ckpt-*.pt"))
    assert saved and saved[-1] != "ckpt-00000008.pt", saved
    again = _run(cmd)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "resumed from" in again.stdout
    ckpt = tmp_path / "pre" / "ckpt"
    indexes = {p.stem for p in ckpt.glob("ckpt-*.pt")}
    folders = {p.name.split(".shards-")[0] for p in ckpt.glob("ckpt-*.shards-*")}
    assert indexes == folders and 0 < len(indexes) <= 2, (indexes, folders)  # keep=2
    a, b = _final_weights(tmp_path / "ref" / "ckpt"), _final_weights(ckpt)
    assert a.keys() == b.keys()
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    assert not diff, f"{len(diff)} tensors differ after resume, e.g. {diff[:3]}"
    # the resumed run reports its own steps and samples (not the checkpoint's running total)
    r_ref = json.loads((tmp_path / "ref" / "out" / "report.json").read_text())
    r_pre = json.loads((tmp_path / "pre" / "out" / "report.json").read_text())
    assert r_pre["steps"] < r_ref["steps"] and 0 < r_pre["samples"] < r_ref["samples"], (
        r_pre,
        r_ref,
    )


def test_nan_on_one_rank_makes_every_rank_skip_and_the_replica_vote_names_a_corrupted_rank(
    tmp_path: Path,
) -> None:
    """2 x 2: rank 1's NaN gradient at step 1 is skipped by every rank (so its replica stays
    equal); rank 3's finite silent corruption at step 2 (SCALEOUT_INJECT_CORRUPT) is what the
    end-of-run replica vote names, with its node, in report.json and in the verdict it leaves for
    ``scaleout slurm run`` (which quarantines that node)."""
    verdicts = tmp_path / "verdicts"
    r = _run(
        _cmd(tmp_path, 2, 2, "train.max_steps=4", "train.eval_every=4"),
        env={
            "SCALEOUT_INJECT_NAN": "1:1",
            "SCALEOUT_INJECT_CORRUPT": "2:3",
            "SCALEOUT_VERDICT_DIR": str(verdicts),
        },
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "step 2: non-finite gradients on some rank; every rank skips this step" in r.stdout
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["skipped_steps"] == 1
    assert report["weights_consistent"] is False and report["odd_ranks"] == [3], report
    assert "replica vote: ranks [3] (node 1) hold weights that differ from the other 3" in r.stdout
    left = json.loads((verdicts / "rank0-replicas.json").read_text())
    assert (left["odd_ranks"], left["odd_nodes"]) == ([3], [1])


def test_kill_9_one_rank_then_rerun_resumes(tmp_path: Path) -> None:
    cmd = _cmd(
        tmp_path, 2, 2, "train.max_steps=40", "train.eval_every=100", "checkpoint.every_steps=2"
    )
    cmd.insert(
        cmd.index("--"), "--grace=3"
    )  # the survivors block on the dead peer: SIGTERM cannot end them sooner
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "checkpoint: step 2 ->" in line:
            break
    victim = _rank_pids(proc.pid)[1]
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    rest = proc.stdout.read()
    proc.wait(timeout=60)
    assert time.monotonic() - t0 < 60
    assert proc.returncode != 0
    assert "rank 1 (node 0, local rank 1) was killed by SIGKILL" in rest
    assert not _rank_pids(proc.pid)
    again = _run(
        _cmd(
            tmp_path, 2, 2, "train.max_steps=6", "train.eval_every=100", "checkpoint.every_steps=2"
        )
    )
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "resumed from" in again.stdout and "at step " in again.stdout


def _rank_pids(launcher_pid: int) -> list[int]:
    """The launcher's rank processes in rank order (started in rank order), not its watchdog
    (also a child)."""
    try:
        with open(f"/proc/{launcher_pid}/task/{launcher_pid}/children") as f:
            children = sorted(int(x) for x in f.read().split())
    except FileNotFoundError:
        return []
    return [pid for pid in children if not _is_watchdog(pid)]


def _is_watchdog(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"watchdog.py" in f.read()
    except FileNotFoundError:  # already gone: not a rank we can signal either
        return True


@pytest.mark.parametrize(
    "bad", [["train.global_batch=30"], ["comm.algorithm=torus2d", "comm.torus_x=3"]]
)
def test_bad_config_fails_before_spawn(tmp_path: Path, bad: list[str]) -> None:
    r = _run(_cmd(tmp_path, 2, 2, *bad), timeout=60)
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("scaleout launch: error:"), r.stderr
    assert not (tmp_path / "out").exists()  # nothing was spawned
