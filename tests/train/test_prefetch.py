"""The background input pipeline (scaleout/train/prefetch.py) on real gloo ranks with real worker
processes: the same batches as the synchronous path, in order, for BERT (packed) and ResNet tasks;
resume from a data position; misuse raises one-line errors; and the trainer with workers ends with
the same weights as without them, reporting the fraction of step time it waited for data.

The ranks are multi-threaded when their workers start (gloo groups beyond the world group, a busy
CommThread), as a training rank is: the workers must come from the forkserver, not a fork of the
rank, and receive the task's data only (no process groups to pickle, the model left alone).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.distutil import run_dist

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
    "train.max_steps=6",
    "train.grad_accum=2",
]
SMALL_RESNET = [
    "model.arch=resnet",
    "data.source=synthetic",
    "model.resnet.depth=18",
    "model.resnet.width=4",
    "model.resnet.num_classes=4",
    "model.resnet.image_size=16",
    "data.eval_samples=8",
    "train.global_batch=8",
    "train.max_steps=6",
    "optim.name=lars",
]


def _flat(mbs: list) -> list[torch.Tensor]:
    out = []
    for mb in mbs:
        ins = mb.inputs if isinstance(mb.inputs, dict) else {"x": mb.inputs}
        out += [ins[k] for k in sorted(ins)] + ([mb.target] if mb.target is not None else [])
        out.append(torch.tensor([mb.samples, mb.tokens]))
    return out


def _same(a: list, b: list) -> bool:
    fa, fb = _flat(a), _flat(b)
    return len(fa) == len(fb) and all(
        x.shape == y.shape and torch.equal(x, y) for x, y in zip(fa, fb, strict=True)
    )


def _allow_children() -> None:
    """run_dist's pooled ranks are daemonic processes, which multiprocessing forbids to start
    children; ranks started by `scaleout launch` / srun are not. Clear the flag so DataLoader
    workers can start (they are daemonic themselves and die with the rank)."""
    import multiprocessing as mp

    mp.current_process()._config["daemon"] = False  # type: ignore[attr-defined]


def _parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _prefetch_checks(world) -> dict:
    import os

    from scaleout.comm import all_reduce
    from scaleout.config import load_config
    from scaleout.errors import UserError
    from scaleout.train.prefetch import Prefetcher
    from scaleout.train.task import build_task

    _allow_children()
    res: dict = {"workers_forked_from_rank": 0}
    busy = None
    for name, overrides in (("bert", SMALL_BERT), ("resnet", SMALL_RESNET)):
        cfg = load_config(None, overrides)
        task = build_task(cfg, world)
        if (
            busy is None
        ):  # a training rank's state when its prefetcher starts: groups, comm thread, collectives
            assert (
                world.intra is not None
            )  # a non-world group now lives in world (unpicklable, as under hierarchical)
            busy = all_reduce(torch.ones(1 << 20), world, algorithm="flat", async_op=True)
        gb, ga = cfg.train.global_batch, cfg.train.grad_accum
        sync = [task.micro_batches(s * gb, ga) for s in range(6)]
        res[f"{name}_distinct_steps"] = not _same(
            sync[0], sync[1]
        )  # so that the checks below can fail
        with Prefetcher(task, gb, ga, 0, 6, num_workers=2, prefetch=3, device=world.device) as pf:
            first = pf.get(0)
            res["workers_forked_from_rank"] += sum(
                _parent_pid(w.pid) == os.getpid() for w in pf._it._workers
            )
            res[f"{name}_in_order"] = _same(first, sync[0]) and all(
                _same(pf.get(s), sync[s]) for s in range(1, 6)
            )
            try:
                pf.get(6)
                res[f"{name}_past_stop"] = "no error"
            except UserError as e:
                res[f"{name}_past_stop"] = str(e)
    with Prefetcher(
        task, gb, ga, 3, 6, num_workers=1, prefetch=1, device=world.device
    ) as pf:  # resume at step 3
        res["resumed"] = _same(pf.get(3), sync[3]) and _same(pf.get(4), sync[4])
        try:
            pf.get(4)
            res["repeat"] = "no error"
        except UserError as e:
            res["repeat"] = str(e)
    busy.wait()
    # workers got the data source, not the task: the model's storages were not moved to shared
    # memory
    res["model_shared"] = any(p.is_shared() for p in task.model.parameters())
    return res


@pytest.mark.multi_process
def test_prefetcher_same_batches_in_order_and_resumes() -> None:
    """2 ranks, 2 and 1 worker processes: every rank's background batches equal its synchronous
    ones, in order, also when started at a later step (resume); asking out of order or past the
    end raises. The workers start while the rank has extra gloo groups and a collective in flight
    on its comm thread; none is a fork of the rank, and the rank's model stays out of shared
    memory."""
    results = run_dist(_prefetch_checks, nnodes=1, nproc_per_node=2, timeout=240)
    for rank, r in enumerate(results):
        for name in ("bert", "resnet"):
            assert r[f"{name}_distinct_steps"], (rank, name)
            assert r[f"{name}_in_order"], (rank, name)
            assert "past its stop_step=6" in r[f"{name}_past_stop"], r
        assert r["resumed"], rank
        assert "asked for step 4 but the next prepared step is 5" in r["repeat"], r
        assert r["workers_forked_from_rank"] == 0, r
        assert not r["model_shared"], r


@pytest.mark.unit
def test_bad_prefetch_settings_are_one_line_errors() -> None:
    from scaleout.errors import UserError
    from scaleout.train.prefetch import Prefetcher

    with pytest.raises(UserError, match=r"data.num_workers=-1"):
        Prefetcher(None, 8, 1, 0, 4, num_workers=-1)
    with pytest.raises(UserError, match=r"data.prefetch=0"):
        Prefetcher(None, 8, 1, 0, 4, num_workers=1, prefetch=0)
    with pytest.raises(
        UserError, match=r"data.worker_start='vfork': expected one of forkserver, spawn, fork"
    ):
        Prefetcher(None, 8, 1, 0, 4, num_workers=1, start_method="vfork")


@pytest.mark.unit
def test_sequence_table_builds_the_same_batches() -> None:
    """The array table prefetch workers receive lays out exactly the batches of the sequence list
    (packed rows with several sequences, padded rows)."""
    import numpy as np

    from scaleout.families.bert.data.batches import SequenceTable
    from scaleout.families.bert.data.bert_batch import (
        build_batch,
        padded_packs,
        synthetic_sequences,
    )

    seqs = synthetic_sequences(np.random.default_rng(0).integers(1, 48, size=60), 500, seed=0)
    table = SequenceTable(seqs)
    assert len(table) == len(seqs)
    packs = [[i, i + 1] for i in range(0, 58, 2)]
    for layout, (max_len, preds, depth) in (
        (packs, (96, 30, 2)),
        (padded_packs(len(seqs)), (48, 10, 1)),
    ):
        want, got = (
            build_batch(seqs, layout, max_len, preds, depth),
            build_batch(table, layout, max_len, preds, depth),
        )
        assert want.keys() == got.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype == torch.int64 and torch.equal(got[k], want[k]), k


def _train(world, out: str, workers: int) -> dict:
    from scaleout.config import load_config
    from scaleout.train.trainer import Trainer

    _allow_children()
    cfg = load_config(
        None,
        [
            *SMALL_BERT,
            "train.max_steps=4",
            "train.eval_every=4",
            "train.progress=false",
            "train.deterministic=true",
            "comm.algorithm=flat",
            f"train.output_dir={out}",
            f"data.num_workers={workers}",
            "data.prefetch=2",
            "optim.warmup_steps=1",
            "optim.total_steps=4",
        ],
    )
    trainer = Trainer(cfg, world)
    trainer.train()
    return {
        "weights": [p.detach().clone() for p in trainer.task.model.parameters()],
        "prefetcher": type(trainer.prefetcher).__name__,
    }


@pytest.mark.full_system
def test_trainer_with_workers_matches_synchronous_and_reports_data_wait(tmp_path: Path) -> None:
    """Same 4 deterministic steps on 2 ranks with 0 and 2 data workers: bitwise equal weights; the
    report gives the fraction of step time spent waiting for data."""
    sync = run_dist(
        _train, nnodes=1, nproc_per_node=2, args=(str(tmp_path / "sync"), 0), timeout=240
    )
    bg = run_dist(_train, nnodes=1, nproc_per_node=2, args=(str(tmp_path / "bg"), 2), timeout=240)
    assert sync[0]["prefetcher"] == "NoneType" and bg[0]["prefetcher"] == "Prefetcher"
    for a, b in zip(sync, bg, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"], strict=True))
    reports = {
        run: json.loads((tmp_path / run / "report.json").read_text()) for run in ("sync", "bg")
    }
    for report in reports.values():
        assert 0.0 < report["data_wait_fraction"] < 1.0, report["data_wait_fraction"]
        assert report["breakdown_s"]["data"] > 0.0
    # the FLOPs counted where a batch is built come back from the workers (MFU was 0 with workers)
    assert reports["bg"]["flops_per_sample"] == reports["sync"]["flops_per_sample"] > 0


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.multi_process
def test_forkserver_and_workers_end_when_the_rank_is_killed() -> None:
    """A rank killed by SIGKILL takes its input workers' forkserver and workers with it (they block
    the preemption signals, so before PR_SET_PDEATHSIG both lived on, reparented to init: 54 of
    them after a morning of Slurm drills)."""
    script = Path(__file__).parents[1] / "scripts" / "orphan_rank.py"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
    rank = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env
    )
    pids = [int(p) for p in rank.stdout.readline().split()]
    try:
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        rank.kill()
        rank.wait()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], "forkserver/worker outlived the rank"
    finally:
        for p in pids:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
