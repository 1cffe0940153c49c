"""The runs of ``scaleout bench ttt``: a recipe on a cluster with a seed -> one launch -> its MLPerf
log.

A :class:`Recipe` is one way to train the same model to the same target: the torch baseline
(``scaleout.bench._ttt_baseline``) or ``scaleout train`` with some of scaleout's ingredients
switched on. Every run gets the same *sequence* budget (its step budget is that over the sequences
one step consumes; the learning-rate schedule decays to 0 at its end) and evaluates at the same
sequence interval (MLPerf BERT fixes evaluation in samples too), so packing and the batch change the
step counts, never the rules.

Time-to-train and the accuracy curve come from each run's ``mlperf.log`` (``run_start`` ->
``run_stop``, ``eval_accuracy`` with ``time_ms`` and ``samples_count``), the same parser for both
sides.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from scaleout.launchers import Launcher, LaunchOptions, make_launcher
from scaleout.units import DEFAULT_BUCKET_MB

# torch DDP's bucket_cap_mb default: the baseline then leaves it unset, so DDP also makes its
# 1 MiB first bucket (an explicit 25 makes the first bucket 25 MiB too)
DDP_DEFAULT_BUCKET_MB = DEFAULT_BUCKET_MB
BASELINE_MODULE = {
    "bert": "scaleout.bench._ttt_baseline",
    "resnet": "scaleout.bench._ttt_baseline_resnet",
    "llama": "scaleout.bench._ttt_baseline_llama",
}


@dataclass(frozen=True)
class LaunchShape:
    """Where a run goes: a launcher of :data:`scaleout.launchers.LAUNCHERS` and nodes x ranks per
    node."""

    launcher: Literal["local", "netns"]
    nnodes: int
    nproc_per_node: int
    rate: str | None = None  # netns link rate (tc units)

    @property
    def name(self) -> str:  # the rows' "cluster" column and the runs' folder
        return self.launcher

    @property
    def world(self) -> int:
        return self.nnodes * self.nproc_per_node

    def launch_argv(self) -> list[str]:
        """The same launch as a command line (recorded in each row, to rerun one by hand)."""
        cmd = [
            sys.executable,
            "-m",
            "scaleout",
            "launch",
            "--nnodes",
            str(self.nnodes),
            "--nproc-per-node",
            str(self.nproc_per_node),
        ]
        return cmd + (["--netns", "--rate", self.rate] if self.rate else [])

    def make_launcher(self) -> Launcher:
        return make_launcher(self.launcher, LaunchOptions(rate=self.rate))


@dataclass(frozen=True)
class Recipe:
    name: str
    kind: Literal["torch", "scaleout"]  # the baseline script, or scaleout train
    optimizer: Literal["adamw", "lamb", "sgd", "lars"]
    # global batch: sequences (padded) or packed rows; images (--task resnet); rows (llama)
    batch: int
    lr: float
    warmup: float  # warm-up as a fraction of the step budget
    packing: bool = False  # --task llama: model.llama.document_mask (rows are packed anyway)
    comm: Literal["ddp", "flat", "hierarchical"] = "ddp"  # ddp: torch's own
    overlap: bool = True
    # torch: DDP's default (bucket_cap_mb unset: a 1 MiB first bucket)
    bucket_mb: float = DEFAULT_BUCKET_MB
    sharded: bool = False
    shard: str = "world"  # optim.shard of a sharded row: world or node
    precision: str = (
        "fp32"  # scaleout's train.precision (the torch baseline is the plain fp32 script)
    )
    compression: str = "none"  # scaleout's comm.compression: the gradients' dtype on the wire
    bn_group: int = 1  # --task resnet: model.resnet.bn_group (group BN over this many ranks)
    # --task resnet: model.resnet.label_smoothing (None: the config's)
    label_smoothing: float | None = None
    # --task resnet: model.resnet.eval_bn, the BN statistics evaluation uses (running: the pooled
    # moving averages, as the baseline's eval; batch: each eval batch's own, HPC-AI500's variant)
    eval_bn: str = "running"
    # scaleout's data.order: torch = the DistributedSampler batches of the plain loop (the
    # ablation's framework step, so its factor is the framework's cost, not another order)
    order: str = "scaleout"
    label: str = ""  # what this row switches on, for the tables

    @classmethod
    def framework(cls, best: Recipe, optimizer: str, **kw: Any) -> Recipe:
        """The ablation's first step: scaleout's trainer with the best baseline ``best``'s recipe
        (its batch, lr and warm-up; a flat all-reduce with DDP's bucket size); ``kw``: what else the
        task's baseline does differently."""
        return cls(
            "abl-framework",
            "scaleout",
            optimizer,  # type: ignore[arg-type]
            best.batch,
            best.lr,
            best.warmup,
            comm="flat",
            bucket_mb=DEFAULT_BUCKET_MB,
            label="scaleout's trainer, the baseline's recipe",
            **kw,
        )

    @classmethod
    def from_config(cls, name: str, cfg: Any, warmup: float, **kw: Any) -> Recipe:
        """``scaleout train``'s recipe as a resolved config states it (the keys :func:`command`
        writes back): optimizer, global batch, lr, packing, all-reduce, overlap, buckets,
        precision, wire dtype."""
        low, resnet = cfg.train.precision != "fp32", cfg.model.arch == "resnet"
        llama = cfg.model.arch == "llama"
        return cls(
            name,
            "scaleout",
            cfg.optim.name,
            cfg.train.global_batch,
            cfg.optim.lr,
            warmup,
            packing=cfg.model.llama.document_mask if llama else cfg.data.packing != "none",
            comm=cfg.comm.algorithm,
            overlap=cfg.comm.overlap,
            bucket_mb=cfg.comm.bucket_mb,
            precision=cfg.train.precision,
            compression=cfg.comm.compression if low else "none",
            bn_group=cfg.model.resnet.bn_group if resnet else 1,
            eval_bn=cfg.model.resnet.eval_bn if resnet else "running",
            **kw,
        )

    def seqs_per_step(self, seqs_per_row: float) -> float:
        return self.batch * (seqs_per_row if self.packing else 1.0)


@dataclass
class Plan:
    """What every run shares: the config (model + data), target, sequence budget, evaluation
    interval."""

    config: str
    target: float
    budget: int  # training sequences
    eval_seqs: int  # evaluate about every this many training sequences
    seqs_per_row: float  # of the packing, measured on the corpus
    packing: str = "lpfhp"  # the algorithm of the packed recipes
    overrides: list[str] = field(default_factory=list)  # model/data overrides for both sides
    # resnet: images, SGD baseline, poly-2 schedule; llama: rows, cosine (the config's schedule)
    task: Literal["bert", "resnet", "llama"] = "bert"
    power: float = 1.0  # scaleout's optim.power (linear decay for BERT, 2 for ResNet LARS)
    end_lr_ratio: float = 0.0  # optim.end_lr / optim.lr of every scaleout run (llama: 0.1)
    goal: Literal["max", "min"] = "max"  # the metric's direction (Family.metric_goal)

    def steps(self, r: Recipe) -> int:
        return max(2, math.ceil(self.budget / r.seqs_per_step(self.seqs_per_row)))

    def eval_every(self, r: Recipe) -> int:
        return max(1, round(self.eval_seqs / r.seqs_per_step(self.seqs_per_row)))

    def warmup_steps(self, r: Recipe) -> int:
        return min(max(1, round(r.warmup * self.steps(r))), self.steps(r) - 1)


def command(
    plan: Plan, r: Recipe, seed: int, out: Path, time_budget: float | None = None
) -> list[str]:
    """The command every rank runs (under ``scaleout launch``)."""
    steps, every, warm = plan.steps(r), plan.eval_every(r), plan.warmup_steps(r)
    if r.kind == "torch":
        cmd = [
            sys.executable,
            "-m",
            BASELINE_MODULE[plan.task],
            "--config",
            plan.config,
            "--lr",
            repr(r.lr),
            "--global-batch",
            str(r.batch),
            "--max-steps",
            str(steps),
            "--warmup-steps",
            str(warm),
            "--eval-every",
            str(every),
            "--target",
            repr(plan.target),
            "--seed",
            str(seed),
            "--out",
            str(out),
        ]
        if r.bucket_mb != DDP_DEFAULT_BUCKET_MB:  # else DDP's default, its 1 MiB first bucket too
            cmd += ["--bucket-mb", repr(r.bucket_mb)]
        if time_budget is not None:
            cmd += ["--time-budget", f"{time_budget:.1f}"]
        if plan.task == "llama":  # bf16 autocast (the 2026 script) unless the recipe says fp32
            cmd += ["--precision", r.precision]
        return [*cmd, *plan.overrides]
    sets = {
        "optim.name": r.optimizer,
        "optim.lr": repr(r.lr),
        "optim.warmup_steps": warm,
        "optim.total_steps": steps,
        "optim.decay_from": "warmup",
        "optim.power": plan.power,
        "optim.end_lr": repr(r.lr * plan.end_lr_ratio) if plan.end_lr_ratio else 0.0,
        "optim.sharded": r.sharded,
        "optim.overlap_comm": r.sharded and r.overlap,
        "data.packing": plan.packing if r.packing else "none",
        "data.order": r.order,
        "train.global_batch": r.batch,
        "train.max_steps": steps,
        "train.eval_every": every,
        "train.eval_start_step": 0,
        "train.target": repr(plan.target),
        "train.seed": seed,
        "train.output_dir": str(out),
        "train.progress": False,
        "train.grad_accum": 1,
        "train.precision": r.precision,
        "checkpoint.dir": "null",
        "checkpoint.every_steps": 0,
        "comm.algorithm": "flat" if r.comm == "ddp" else r.comm,
        "comm.overlap": r.overlap,
        "comm.bucket_mb": repr(r.bucket_mb),
        "comm.compression": r.compression,
    }
    if r.sharded:
        sets["optim.shard"] = r.shard
    if plan.task == "resnet":
        del sets["data.packing"]
        sets["model.resnet.bn_group"] = r.bn_group
        sets["model.resnet.eval_bn"] = r.eval_bn
        if r.label_smoothing is not None:
            sets["model.resnet.label_smoothing"] = repr(r.label_smoothing)
    if plan.task == "llama":  # packed rows always; "packing" is whether documents are kept apart
        del sets["data.packing"]
        sets["model.llama.document_mask"] = r.packing
    return [
        "scaleout",
        "train",
        plan.config,
        *plan.overrides,
        *(f"{k}={_yaml(v)}" for k, v in sets.items()),
    ]


def _yaml(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def read_mlperf(path: Path) -> dict[str, Any]:
    """run_start -> run_stop (s), run_stop status and the eval curve [(s since run_start,
    sequences, accuracy)]."""
    start = stop = None
    status, curve = None, []
    for line in path.read_text().splitlines():
        if ":::MLLOG" not in line:
            continue
        rec = json.loads(line.split(":::MLLOG", 1)[1])
        key, t = rec["key"], rec["time_ms"] / 1000.0
        if key == "run_start":
            start, curve = t, []  # the last attempt of an appended log
        elif key == "eval_accuracy" and start is not None:
            curve.append(
                [round(t - start, 3), int(rec["metadata"]["samples_count"]), float(rec["value"])]
            )
        elif key == "run_stop":
            stop, status = t, rec["metadata"].get("status")
    if start is None or stop is None:
        raise ValueError(f"{path}: no run_start/run_stop pair (the run did not finish)")
    return {"ttt_s": round(stop - start, 3), "mlperf_status": status, "curve": curve}


def execute(
    plan: Plan,
    cluster: LaunchShape,
    r: Recipe,
    seed: int,
    root: Path,
    *,
    time_budget: float | None = None,
    tag: str = "",
) -> dict[str, Any]:
    """Launch one run, wait, and return its row. A run that does not reach the target has
    ``ttt_s`` None. A run that fails names its rank (the launcher's LaunchResult)."""
    out = root / cluster.name / f"{r.name}{tag}-s{seed}"
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("mlperf.log", "report.json"):
        (out / stale).unlink(missing_ok=True)
    cmd = command(plan, r, seed, out, time_budget)
    argv = [*cluster.launch_argv(), "--", *cmd]
    t0 = time.perf_counter()
    # In this process: SIGINT/SIGTERM stop the ranks (and a netns cluster goes down) before we go.
    with cluster.make_launcher() as launcher:
        job = launcher.start(cmd, cluster.nnodes, cluster.nproc_per_node, log=out / "launch.log")
        result = job.wait()
    with open(out / "launch.log", "a") as log:
        print(f"scaleout launch: {result.message}", file=log)
    rc = result.returncode
    row: dict[str, Any] = {
        "cluster": cluster.name,
        "recipe": r.name,
        "seed": seed,
        "rc": rc,
        "wall_s": round(time.perf_counter() - t0, 1),
        "dir": str(out),
        "argv": argv,
        "steps_budget": plan.steps(r),
        "eval_every": plan.eval_every(r),
        "warmup_steps": plan.warmup_steps(r),
        "time_budget_s": time_budget,
        **asdict(r),
    }
    if rc != 0:
        raise SystemExit(
            f"{cluster.name} {r.name} seed {seed} exited {rc} ({result.message}); "
            f"see {out / 'launch.log'}"
        )
    log_ = read_mlperf(out / "mlperf.log")
    rep = json.loads((out / "report.json").read_text())
    reached = log_["mlperf_status"] == "success"
    row.update(
        log_,
        reached=reached,
        steps=int(rep["steps"]),
        samples=int(rep["samples"]),
        achieved=rep.get("achieved"),
        status=rep.get("status"),
    )
    row["ttt_s"] = log_["ttt_s"] if reached else None
    row["run_s"] = log_["ttt_s"]  # run_start -> run_stop whether or not the target was reached
    return row
