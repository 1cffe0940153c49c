"""MLPerf timing rules on real ranks with real prefetch workers, a fresh run and a resumed one.

The rule (MLPerf Training rules, "Run Results"): "The clock must start before any part of the system
touches the dataset". Metadata is not a touch ("Other Uses of Data": vocabulary, the number of
documents, document sizes), so the shard index (row lengths, packs from the lengths) may be read or
built before the clock; sequences may not, training or eval: NVIDIA's BERT opens its training loader
and starts reading the eval set only after RUN_START (run_pretraining.py, training_results v1.0+).

What is checked, on 2 gloo ranks with one data worker each (the tiny synthetic BERT, 2 steps, then a
rerun
to 4 steps that resumes from the checkpoint and appends a second attempt to mlperf.log):
- in each rank, the first request for training batches (a DataLoader iteration, which hands steps to
  the
  workers) comes after run_start; every batch actually built (in a worker or in the rank, recorded
  by a
  wrapper around the task's data source) is built after the run_start time_ms of mlperf.log;
- every attempt of the appended log passes the real compliance checker, and its events come in the
  order
  cache_clear, init_start, ..., [init_checkpoint_step], init_stop, run_start, block_start, ...,
  run_stop.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.distutil import run_dist
from tests.train.test_prefetch import SMALL_BERT, _allow_children

pytestmark = pytest.mark.multi_process


class TouchLog:
    """The task's data source, recording (pid, wall time) of every batch it builds into ``path``.
    Picklable by reference, so the prefetch workers (forkserver children) record their own
    touches."""

    def __init__(self, source: Any, path: str):
        self.source, self.path = source, path

    def micro_batches(self, position: int, grad_accum: int) -> list[Any]:
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()} {time.time():.6f}\n")
        return self.source.micro_batches(position, grad_accum)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in (
            "source",
            "path",
        ):  # unpickling: before __dict__ is filled
            raise AttributeError(name)
        return getattr(self.source, name)


def _timed_run(world, out: str, ckpt: str, max_steps: int, touches: str) -> dict:
    """One `scaleout train`-equivalent attempt in this rank, recording the order of run_start and
    of the requests for training data (in this process) and every batch built (any process)."""
    import torch.utils.data as tud

    import scaleout.train.prefetch as prefetch
    from scaleout.config import load_config
    from scaleout.telemetry.mlperf import MLPerfLogger
    from scaleout.train.trainer import Trainer

    _allow_children()
    order: list[tuple[str, float]] = []
    saved = (MLPerfLogger.run_start, tud.DataLoader.__iter__, prefetch.build_prefetcher)

    def run_start(self: Any) -> None:
        order.append(("run_start", time.time()))
        saved[0](self)

    def data_request(self: Any) -> Any:
        order.append(("data_request", time.time()))
        return saved[1](self)

    def build_prefetcher(cfg: Any, task: Any, *args: Any, **kwargs: Any) -> Any:
        task.batches = TouchLog(task.batches, f"{touches}.{world.rank}")
        return saved[2](cfg, task, *args, **kwargs)

    MLPerfLogger.run_start, tud.DataLoader.__iter__ = run_start, data_request
    prefetch.build_prefetcher = build_prefetcher
    try:
        cfg = load_config(
            None,
            [
                *SMALL_BERT,
                f"train.max_steps={max_steps}",
                "train.eval_every=2",
                "train.progress=false",
                "comm.algorithm=flat",
                f"train.output_dir={out}",
                f"checkpoint.dir={ckpt}",
                "data.num_workers=1",
                "data.prefetch=2",
                "optim.warmup_steps=1",
                "optim.total_steps=4",
            ],
        )
        result = Trainer(cfg, world).train()
    finally:
        MLPerfLogger.run_start, tud.DataLoader.__iter__ = saved[0], saved[1]
        prefetch.build_prefetcher = saved[2]
    return {"order": order, "pid": os.getpid(), "status": result.status, "steps": result.steps}


def _events(attempt: str) -> list[dict]:
    return [json.loads(x.split(":::MLLOG", 1)[1]) for x in attempt.splitlines() if ":::MLLOG" in x]


def _check_attempt(attempt: str, ranks: list[dict], touches: str, resumed_from: int | None) -> None:
    events = _events(attempt)
    keys = [e["key"] for e in events]
    assert keys[:2] == ["cache_clear", "init_start"] and keys[-1] == "run_stop", keys
    at = {k: keys.index(k) for k in ("init_stop", "run_start", "block_start")}
    assert keys.count("run_start") == 1 and at["init_stop"] < at["run_start"] < at["block_start"], (
        keys
    )
    if resumed_from is None:
        assert "init_checkpoint_step" not in keys, keys
    else:  # part of the initialization, before the clock
        step = [e for e in events if e["key"] == "init_checkpoint_step"]
        assert [e["value"] for e in step] == [resumed_from] and keys.index(
            "init_checkpoint_step"
        ) < at["init_stop"]
    run_start_ms = events[at["run_start"]]["time_ms"]
    for rank, r in enumerate(ranks):
        seen = [name for name, _ in r["order"]]
        assert "data_request" in seen and seen.count("run_start") == 1, (rank, seen)
        # the rule itself: nothing asks for training data before the clock starts
        assert seen.index("run_start") < seen.index("data_request"), (rank, r["order"])
        built = [line.split() for line in Path(f"{touches}.{rank}").read_text().splitlines()]
        pids = {int(pid) for pid, _ in built}
        assert pids - {r["pid"]}, (rank, pids)  # the batches came from a worker process
        first_ms = min(float(t) for _, t in built) * 1e3
        assert first_ms >= run_start_ms, (rank, first_ms - run_start_ms)


def test_first_touch_of_training_data_is_after_run_start_fresh_and_resumed(tmp_path: Path) -> None:
    from scaleout.telemetry.mlperf import check_compliance, split_attempts

    out, ckpt = str(tmp_path / "out"), str(tmp_path / "ckpt")
    first = run_dist(
        _timed_run,
        nnodes=1,
        nproc_per_node=2,
        args=(out, ckpt, 2, str(tmp_path / "touch1")),
        timeout=300,
    )
    assert [r["status"] for r in first] == ["max_steps"] * 2, first
    again = run_dist(
        _timed_run,
        nnodes=1,
        nproc_per_node=2,
        args=(out, ckpt, 4, str(tmp_path / "touch2")),
        timeout=300,
    )
    assert [(r["status"], r["steps"]) for r in again] == [("max_steps", 4)] * 2, again
    log = tmp_path / "out" / "mlperf.log"
    attempts = split_attempts(log.read_text())
    assert len(attempts) == 2
    for i, (attempt, ranks, resumed) in enumerate(
        ((attempts[0], first, None), (attempts[1], again, 2))
    ):
        _check_attempt(attempt, ranks, str(tmp_path / f"touch{i + 1}"), resumed)
        reached = max(e["value"] for e in _events(attempt) if e["key"] == "eval_accuracy")
        ok, checker = check_compliance(log, "bert", quality_target=reached, attempt=i)
        assert ok, checker[-3000:]


# -- the eval set of the MLPerf shard path: read after the clock starts, not while opening the data
# --------
def _write_fixed_shard(
    path: Path, rows: int, seq: int, pred: int, rng: np.random.Generator
) -> None:
    """Rows in the reference's fixed layout (scaleout/families/bert/data/shard_format.py), random
    but well formed."""
    lens = rng.integers(pred + 2, seq + 1, rows)
    mask = (np.arange(seq)[None, :] < lens[:, None]).astype(np.int8)
    positions = np.stack(
        [np.sort(rng.choice(np.arange(1, n - 1), pred, replace=False)) for n in lens]
    ).astype(np.int32)
    np.savez(
        path,
        input_ids=(rng.integers(5, 100, (rows, seq)) * mask).astype(np.int32),
        input_mask=mask,
        segment_ids=np.zeros((rows, seq), np.int8),
        masked_lm_positions=positions,
        masked_lm_ids=rng.integers(5, 100, (rows, pred)).astype(np.int32),
        next_sentence_labels=rng.integers(0, 2, rows).astype(np.int8),
    )


def test_opening_shards_reads_no_sequence_eval_is_read_on_first_use(
    tmp_path: Path, monkeypatch
) -> None:
    """open_shards (the task's construction, before run_start) reads metadata only: the row
    lengths of the index and the shapes; the eval sequences are read when the first evaluation
    asks for them."""
    from scaleout.config import load_config
    from scaleout.families.bert.data import shard_source
    from scaleout.families.bert.data.shard_format import ShardReader

    rng = np.random.default_rng(0)
    for split, files in (("train", 2), ("eval", 1)):
        (tmp_path / split).mkdir()
        for j in range(files):
            _write_fixed_shard(tmp_path / split / f"part-{j}.npz", 40, 32, 5, rng)
    reads: list[str] = []
    real_read = ShardReader.read

    def read(self: ShardReader, rows: Any) -> Any:
        reads.append(self.path.parent.name)
        return real_read(self, rows)

    monkeypatch.setattr(ShardReader, "read", read)
    cfg = load_config(
        None,
        [
            "model.arch=bert",
            "data.source=wikipedia",
            f"data.path={tmp_path}",
            "data.max_seq_len=32",
            "data.max_predictions=5",
            "data.packing=none",
            "data.eval_samples=16",
            "train.global_batch=8",
        ],
    )
    data = shard_source.open_shards(cfg)
    assert reads == [] and len(data.eval) == 16  # the count is metadata
    first = data.eval[0]
    assert reads == ["eval"] and len(first.tokens) > 0
    data.eval[15]
    assert reads == ["eval"]  # read once, on first use
    data.stream.batches(0, 1)
    assert reads[1:] and set(reads[1:]) == {"train"}
