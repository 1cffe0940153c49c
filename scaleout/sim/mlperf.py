"""Published MLPerf Training BERT runs the simulator is checked against, and how each one is
simulated.

Every number below is read from the submission itself (github.com/mlcommons/training_results_vX.Y):
the result logs (``:::MLLOG`` lines of result_*.txt: run_start/run_stop, global_batch_size,
train_samples, eval_accuracy), the run's config_*.sh (BATCHSIZE, PACKING_FACTOR, SBATCH_NETWORK,
EXTRA_PARAMS) and the system JSON (GPUs, NICs). What is compared:

- ``steps`` = median over the successful runs of train_samples / global_batch_size (the step at
  which the run reached the target; not MAX_STEPS, which only sets the learning-rate schedule);
- ``per_step_ms`` = median over the runs of (run_stop - run_start) / steps: the scored time per
  training step, evaluations and the first steps' warm-up included;
- ``ttt_min`` = the published score (mean of the runs without the fastest and the slowest).

``summarize_results`` (``scaleout simulate mlperf-log DIR``) recomputes these from the result files.

The simulator is given the same per-GPU batch, node count, optimizer placement (NVIDIA's runs use
apex DistributedFusedLAMB sharded over one node: ``sharded-node``), SHARP (``SBATCH_NETWORK=sharp``)
and overlap (``--dwu-overlap-reductions`` with ``--dwu-num-blocks``; without it the reductions start
after backward), and predicts (steps x step + evaluations) / steps. The compute speed is the one
assumption that is not in the submission: peak dense fp16/bf16 FLOP/s from the data sheet x
``BERT_MFU``, the same for every run (nothing is fitted per reference).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from scaleout.errors import ConfigError
from scaleout.sim.cluster import get_cluster, with_sharp
from scaleout.sim.convergence import ConvergenceCurve
from scaleout.sim.step import (
    StepResult,
    TimeToTrain,
    TrainSpec,
    eval_interval,
    get_model,
    step_time,
    time_to_train,
)

BERT_MFU = 0.40  # assumed fraction of peak FLOP/s, every run and GPU generation
# a packed row of 512 token slots, every slot and the MLM head computed (BERT's Reference)
PACKED_ROW_FLOPS = get_model("bert-large").dense_flops_per_sample
_REPO = "github.com/mlcommons/training_results_"


@dataclass(frozen=True)
class BertRun:
    key: str
    what: str
    cluster: str  # scaleout.sim preset
    nodes: int
    batch_per_gpu: int  # BATCHSIZE: packed rows of 512 token slots, or sequences when not packed
    # PACKING_FACTOR=2 + --pad_fmha, no --dense_seq_output: every slot computed, MLM head dense
    packed: bool
    global_batch: int  # logged global_batch_size, in sequences
    steps: float
    evals: int
    per_step_ms: float
    ttt_min: float
    sharp: bool
    overlap_blocks: int  # 0: reduce after backward (one block)
    results: str
    config: str
    system: str


REFERENCES: tuple[BertRun, ...] = (
    BertRun(
        "c",
        "MLPerf v2.0 NVIDIA, 512 x DGX A100 (4096 GPUs)",
        "dgx-a100",
        512,
        2,
        True,
        16384,
        337.7,
        17,
        37.03,
        0.2057,
        True,
        0,
        _REPO + "v2.0 NVIDIA/results/dgxa100_n512_ngc22.04_pytorch/bert/result_{0..9}.txt",
        "NVIDIA/benchmarks/bert/implementations/pytorch/config_DGXA100_512x8x2x1_pack.sh",
        "NVIDIA/systems/dgxa100_n512_ngc22.04_pytorch.json (8x HDR 200 Gb/s compute NICs)",
    ),
    BertRun(
        "e",
        "MLPerf v2.0 NVIDIA, 128 x DGX A100 (1024 GPUs)",
        "dgx-a100",
        128,
        2,
        True,
        4096,
        684.6,
        16,
        37.25,
        0.4209,
        True,
        0,
        _REPO + "v2.0 NVIDIA/results/dgxa100_n128_ngc22.04_pytorch/bert/result_{0..9}.txt",
        "NVIDIA/benchmarks/bert/implementations/pytorch/config_DGXA100_128x8x2x1_pack.sh",
        "NVIDIA/systems/dgxa100_n128_ngc22.04_pytorch.json",
    ),
    BertRun(
        "f",
        "MLPerf v2.0 NVIDIA, 8 x DGX A100 (64 GPUs)",
        "dgx-a100",
        8,
        48,
        False,
        3072,
        1033.5,
        18,
        168.97,
        2.9423,
        True,
        0,
        _REPO + "v2.0 NVIDIA/results/dgxa100_n8_ngc22.04_pytorch/bert/result_{0..9}.txt",
        "NVIDIA/benchmarks/bert/implementations/pytorch/config_DGXA100_8x8x48x1.sh",
        "NVIDIA/systems/dgxa100_n8_ngc22.04_pytorch.json",
    ),
    BertRun(
        "g",
        "MLPerf v3.0 NVIDIA, 64 x DGX H100 (512 GPUs)",
        "dgx-h100",
        64,
        3,
        True,
        3072,
        911.7,
        16,
        22.15,
        0.3420,
        True,
        5,
        _REPO
        + "v3.0 NVIDIA/results/dgxh100_n64_ngc23.04_pytorch/bert/result_{0..9}.txt (9 successful)",
        "NVIDIA/benchmarks/bert/implementations/pytorch/config_DGXH100_64x8x3x1_pack_clipafter.sh",
        "NVIDIA/systems/dgxh100_n64_ngc23.04_pytorch.json (8x NDR 400 Gb/s compute NICs)",
    ),
    BertRun(
        "h",
        "MLPerf v3.1 NVIDIA Eos, 434 x DGX H100 (3472 GPUs)",
        "dgx-h100",
        434,
        2,
        True,
        13888,
        388.8,
        18,
        18.31,
        0.1193,
        True,
        5,
        _REPO + "v3.1 NVIDIA/results/eos_n434_ngc23.09_pytorch/bert/result_{0..9}.txt",
        "NVIDIA/benchmarks/bert/implementations/pytorch/config_DGXH100_434x8x2x1_pack_clipafter.sh",
        "NVIDIA/systems/eos_n434_ngc23.09_pytorch.json",
    ),
)


def get_run(key: str) -> BertRun:
    return next(r for r in REFERENCES if r.key == key)


@dataclass(frozen=True)
class Prediction:
    run: BertRun
    step: StepResult
    ttt: TimeToTrain

    @property
    def per_step(self) -> float:
        """Seconds per step with the evaluations spread over the steps, as the reference is
        measured."""
        return self.ttt.total / self.ttt.steps


# The per-step host cost of NVIDIA's BERT stack is calibrated on this run; the others are predicted.
CALIBRATION_RUN = "e"


def simulate(
    run: BertRun,
    mfu: float = BERT_MFU,
    optimizer: str = "sharded-node",
    sharp: bool | None = None,
    algorithm: str = "tree",
    host_s: float | None = None,
    convergence: ConvergenceCurve | None = None,
) -> Prediction:
    """The run as submitted (``optimizer``/``sharp`` switch the two modelled features for
    ablations).

    ``algorithm`` is NCCL's between nodes: with sharded-node it carries only the all-reduce among
    same-local-rank GPUs (one per node), where NCCL runs its tree, or CollNet (SHARP) when enabled.
    ``host_s``: the fixed per-step cost (default: ``nvidia_host_s()``; every run uses
    ``--use_cuda_graph``). Without ``convergence`` the run gets its logged steps and evaluations;
    with it, samples to converge come from the curve at the run's global batch (sequences) and the
    evaluations from MLPerf's schedule (``eval_interval``): a prediction from the batch alone.
    """
    cluster = with_sharp(get_cluster(run.cluster), run.sharp if sharp is None else sharp)
    base = get_model("bert-large")
    flops = PACKED_ROW_FLOPS if run.packed else base.flops_per_sample
    model = replace(
        base,
        flops_per_sample=flops,
        samples_to_converge=None,
        eval_every_samples=None,
        eval_rule=None,
    )
    grads = model.params * model.grad_bytes
    train = TrainSpec(
        local_batch=run.batch_per_gpu,
        algorithm=algorithm,
        mfu=mfu,
        optimizer=optimizer,
        overlap=run.overlap_blocks > 0,
        bucket_mb=grads / max(run.overlap_blocks, 1) / 1e6,
        cuda_graphs=True,
        host_s=nvidia_host_s() if host_s is None else host_s,
    )
    st = step_time(model, train, cluster, run.nodes)
    # time_to_train counts in the run's rows (packed rows or sequences); the RCPs and MLPerf's
    # evaluation schedule count sequences (the logged global_batch_size).
    rows_per_step = st.gpus * run.batch_per_gpu
    if convergence is None:
        steps, evals = run.steps, run.evals
    else:
        sequences = convergence.samples(run.global_batch)
        steps = sequences / run.global_batch
        evals = int(sequences // eval_interval(base, run.global_batch))
    every = steps * rows_per_step / evals * (1 - 1e-9) if evals else None
    ttt = time_to_train(
        replace(model, eval_every_samples=every), train, cluster, run.nodes, steps * rows_per_step
    )
    return Prediction(run, st, ttt)


@lru_cache(maxsize=1)
def nvidia_host_s() -> float:
    """NVIDIA's per-step host cost, calibrated on run ``CALIBRATION_RUN`` (e): the host time per
    step that makes the model's time per step equal the logged one at 40 % MFU (time per step is
    linear in it). Held out: every other run, A100 and H100; docs/simulate.md says why one
    constant can carry across GPU generations."""
    run = get_run(CALIBRATION_RUN)
    p0 = simulate(run, host_s=0.0).per_step
    p1 = simulate(run, host_s=1e-3).per_step
    return (run.per_step_ms / 1e3 - p0) / (p1 - p0) * 1e-3


def speedup(
    small: str = "e", large: str = "c", convergence: ConvergenceCurve | None = None
) -> tuple[float, Prediction, Prediction]:
    """Predicted time-to-train ratio of run ``small`` over run ``large``, each from its batch alone
    (samples from ``convergence``; None: the bert-large preset's fixed samples at every batch, the
    old model)."""
    if convergence is None:
        fixed = get_model("bert-large").samples_to_converge
        convergence = ConvergenceCurve(((1.0, fixed),), "fixed samples (bert-large preset)")
    a = simulate(get_run(small), convergence=convergence)
    b = simulate(get_run(large), convergence=convergence)
    return a.ttt.total / b.ttt.total, a, b


@dataclass(frozen=True)
class LogSummary:
    """What a submission's result_*.txt files say, reduced the way ``REFERENCES`` records it."""

    runs: int  # successful runs (run_stop status "success")
    global_batch: int
    steps: float  # median train_samples / global_batch_size
    evals: float  # median number of eval_accuracy events
    per_step_ms: float  # median (run_stop - run_start) / steps
    ttt_min: float  # mean without the fastest and slowest run (MLPerf's score for 5+ runs)


def _events(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        _, sep, payload = line.partition(":::MLLOG")
        if sep:
            try:
                out.append(json.loads(payload))
            except json.JSONDecodeError:
                continue  # a line cut by interleaved output from another rank
    return out


def _run(path: Path) -> dict[str, float] | None:
    start = stop = batch = samples = None
    evals = 0
    for e in _events(path):
        key, value = e.get("key"), e.get("value")
        if key == "run_start" and start is None:
            start = e["time_ms"]
        elif key == "run_stop" and (e.get("metadata") or {}).get("status") == "success":
            stop = e["time_ms"]
        elif key == "global_batch_size":
            batch = value
        elif key == "train_samples":
            samples = value
        elif key == "eval_accuracy":
            evals += 1
    if None in (start, stop, batch, samples):
        return None
    steps = samples / batch
    return {"seconds": (stop - start) / 1e3, "steps": steps, "batch": batch, "evals": evals}


def summarize_results(paths: list[str | Path]) -> LogSummary:
    """Summarise MLPerf result logs (files, or directories holding result_*.txt)."""
    files: list[Path] = []
    for p in map(Path, paths):
        files.extend(sorted(p.glob("result_*.txt")) if p.is_dir() else [p])
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        raise ConfigError(f"no MLPerf result files at {', '.join(missing or map(str, paths))}")
    runs = [r for r in map(_run, files) if r]
    if not runs:
        raise ConfigError(
            f"none of the {len(files)} result files has a successful run with run_start/run_stop, "
            "global_batch_size and train_samples"
        )
    times = sorted(r["seconds"] for r in runs)
    scored = times[1:-1] if len(times) >= 5 else times
    return LogSummary(
        len(runs),
        int(runs[0]["batch"]),
        statistics.median(r["steps"] for r in runs),
        statistics.median(r["evals"] for r in runs),
        statistics.median(1e3 * r["seconds"] / r["steps"] for r in runs),
        statistics.mean(scored) / 60,
    )
