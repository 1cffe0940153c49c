"""A data-parallel training step with bucketed gradient all-reduce overlapped with backward.

Timeline of one step on every rank (weak scaling: the local batch is fixed, the global batch grows):

    forward (1/3 of compute) | backward (2/3) ............................. | optimizer
                               bucket 1 ready -> all-reduce 1 -> all-reduce 2 -> ... (one comm
                               stream)

Assumptions, each one a choice a user can change:
- backward costs twice the forward (the standard 1:2 FLOP split, Kaplan et al. 2020 "6N" rule);
- gradients become ready at a uniform rate during backward (parameters spread evenly over layers),
  are packed into buckets of ``bucket_mb`` (25 MB is the PyTorch DDP default, Li et al. VLDB 2020)
  and
  all-reduced one after another on a single communication stream, each as soon as it is ready;
- the optimizer step runs after the last bucket and streams its state through HBM at 80 % of peak
  bandwidth (a memory-bound elementwise kernel; STREAM-like efficiency);
- a sharded optimizer (``TrainSpec.optimizer``, scaleout.sim.sharded) reduce-scatters instead, runs
  one small all-reduce of LAMB's per-tensor norms, updates its 1/shard of the parameters bucket by
  bucket and all-gathers each updated bucket at once (gathers overlap the later buckets' updates);
- scaling efficiency = (compute + optimizer) / step time, i.e. per-GPU throughput relative to one
  GPU that does not communicate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Literal

from scaleout.errors import ConfigError
from scaleout.families.bert.config import BertConfig
from scaleout.families.bert.flops import sequence_training_flops
from scaleout.families.resnet.config import ResNetConfig
from scaleout.families.resnet.flops import training_flops_per_image
from scaleout.sim.cluster import Cluster
from scaleout.sim.collectives import canonical
from scaleout.sim.sharded import check_optimizer, gather_time, norm_time, reduce_time, shard_ranks

MEM_EFFICIENCY = 0.8


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: float
    flops_per_sample: float  # training FLOPs (forward + backward) per sample
    grad_bytes: int = 2  # bytes per gradient element on the wire (fp16/bf16 = 2, fp32 = 4)
    opt_bytes_per_param: float = 32.0  # optimizer HBM traffic per parameter per step
    param_bytes: int = (
        2  # bytes per parameter element a sharded optimizer all-gathers (fp16 model weights)
    )
    # Optimizer state per parameter: fp32 master weights + two fp32 moments (ZeRO's K = 12 for
    # mixed-precision Adam, Rajbhandari et al. 2020; LAMB keeps the same state).
    state_bytes_per_param: float = 12.0
    param_tensors: int = 400  # parameter tensors (LAMB's per-tensor norms); BERT-large has ~400
    samples_to_converge: float | None = None
    eval_samples: float = 0.0
    eval_every_samples: float | None = None
    notes: str = ""


@dataclass(frozen=True)
class TrainSpec:
    local_batch: float
    algorithm: str = "flat"
    bucket_mb: float = 25.0
    mfu: float = 0.4  # achieved fraction of the device's peak FLOP/s
    samples_per_s: float | None = None  # per device; overrides mfu when given (e.g. CPU clusters)
    overlap: bool = True
    chunks: int | None = (
        None  # grid pipeline chunks; None: 1 on NCCL, scaleout.comm.grid's rule on gloo
    )
    torus_x: int | Literal["node", "square"] | None = None  # node: GPUs per node; square: ~sqrt(p)
    fixed_overhead_s: float = 0.0  # added once to time-to-train (e.g. untimed-but-counted setup)
    optimizer: Literal["replicated", "sharded", "sharded-node"] = "replicated"  # sim/sharded.py


@dataclass(frozen=True)
class StepResult:
    algorithm: str
    gpus: int
    nodes: int
    compute: float
    optimizer: float
    # total communication time (serialized): all-reduces, or reduce-scatters + norms + all-gathers
    comm: float
    exposed: float  # communication not hidden behind backward
    step: float
    optimizer_placement: str = "replicated"
    shard: int = 1  # ranks sharing one copy of the optimizer state
    state_bytes: float = 0.0  # optimizer state per rank

    @property
    def efficiency(self) -> float:
        return (self.compute + self.optimizer) / self.step

    def throughput(self, local_batch: float) -> float:
        return self.gpus * local_batch / self.step


MODELS: dict[str, ModelSpec] = {
    # MLPerf Training BERT-large phase 2 (NVIDIA v2.0 submission: LAMB, fp16 gradients, packed
    # data).
    "bert-large": ModelSpec(
        "bert-large",
        params=335e6,
        # a Wikipedia-512 sequence of mean length (scaleout/families/bert/flops.py)
        flops_per_sample=sequence_training_flops(BertConfig()),
        grad_bytes=2,
        # LAMB with fp32 master weights: read p, m, v, g + write p, m, v, fp16 copy ~ 32 B/param.
        opt_bytes_per_param=32.0,
        # NVIDIA v2.0, 512 nodes: median train_samples of the 10 runs at the target (337.7 steps of
        # 16384; MAX_STEPS=470 only sets the LR schedule), result_*.txt of scaleout.sim.mlperf's
        # reference (c).
        samples_to_converge=5533303,
        eval_samples=10000,
        eval_every_samples=325000,  # MLPerf BERT eval set; EVAL_ITER_SAMPLES in config
        notes=(
            "BERT-large 24x1024, 335M params; MLPerf v2.0 NVIDIA config_DGXA100_512x8x2x1_pack.sh"
        ),
    ),
    # ResNet-50 v1.5: 25.6M params, 4.09 G multiply-adds forward per 224x224 image (x2 FLOPs, x3 for
    # training; scaleout/families/resnet/flops.py).
    "resnet50": ModelSpec(
        "resnet50",
        params=25.6e6,
        flops_per_sample=training_flops_per_image(ResNetConfig()),
        grad_bytes=4,
        opt_bytes_per_param=16.0,
        samples_to_converge=37
        * 1281167,  # MLPerf LARS runs converge in ~35-40 epochs of ImageNet-1k
        notes="ResNet-50 v1.5, fp32 gradients (Horovod-era default)",
    ),
}


def get_model(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ConfigError(
            f"unknown model preset {name!r}; expected one of {', '.join(MODELS)}"
        ) from None


def compute_time(model: ModelSpec, train: TrainSpec, cluster: Cluster) -> float:
    if train.local_batch <= 0:
        raise ConfigError(f"local batch must be > 0, got {train.local_batch}")
    if train.samples_per_s:
        return train.local_batch / train.samples_per_s
    if cluster.device is None:
        raise ConfigError(
            f"cluster {cluster.name!r} has no device FLOP/s; give samples per second per device"
        )
    if not 0 < train.mfu <= 1:
        raise ConfigError(f"mfu must be in (0, 1], got {train.mfu}")
    return train.local_batch * model.flops_per_sample / (cluster.device.peak_flops * train.mfu)


def optimizer_time(model: ModelSpec, cluster: Cluster, shard: int = 1) -> float:
    """HBM-bound update of 1/shard of the parameters."""
    if cluster.device is None:
        return 0.0
    return (
        model.params / shard * model.opt_bytes_per_param / (cluster.device.mem_bw * MEM_EFFICIENCY)
    )


def bucket_sizes(total_bytes: float, bucket_mb: float) -> list[float]:
    if bucket_mb <= 0:
        raise ConfigError(f"bucket size must be > 0 MB, got {bucket_mb}")
    cap = bucket_mb * 1e6
    n = max(1, math.ceil(total_bytes / cap))
    return [cap] * (n - 1) + [total_bytes - cap * (n - 1)]


def _pipeline(start: float, ready: list[float], costs: list[float]) -> float:
    """One stream: job i starts when ready (``start`` + ready[i]) and the previous job is done."""
    done = start
    for r, c in zip(ready, costs, strict=True):
        done = max(start + r, done) + c
    return done


def step_time(model: ModelSpec, train: TrainSpec, cluster: Cluster, nodes: int) -> StepResult:
    """Predicted step time of one data-parallel step on ``nodes`` nodes."""
    alg = canonical(train.algorithm)
    opt = check_optimizer(train.optimizer)
    gpus = cluster.gpus_per_node * nodes
    shard = shard_ranks(opt, cluster, nodes)
    t_comp = compute_time(model, train, cluster)
    t_opt = optimizer_time(model, cluster, shard)
    t_fwd, t_bwd = t_comp / 3, 2 * t_comp / 3
    comm_total, step = 0.0, t_comp + t_opt
    if gpus > 1:
        grads = model.params * model.grad_bytes
        sizes = bucket_sizes(grads, train.bucket_mb)
        cost = [
            reduce_time(opt, alg, cluster, nodes, b, train.chunks, train.torus_x) for b in sizes
        ]
        done_frac = [
            c / grads for c in accumulate(sizes)
        ]  # share of the gradients ready with bucket i
        ready = [t_bwd * f if train.overlap else t_bwd for f in done_frac]
        end = max(t_comp, _pipeline(t_fwd, ready, cost))
        comm_total = sum(cost)
        if opt == "replicated":
            step = end + t_opt
        else:
            t_norm = norm_time(opt, alg, cluster, nodes, model.param_tensors)
            gather = [
                gather_time(
                    opt,
                    alg,
                    cluster,
                    nodes,
                    b * model.param_bytes / model.grad_bytes,
                    train.torus_x,
                )
                for b in sizes
            ]
            updated = [t_opt * f for f in done_frac]
            step = max(end + t_norm + t_opt, _pipeline(end + t_norm, updated, gather))
            comm_total += t_norm + sum(gather)
    state = model.params * model.state_bytes_per_param / shard
    return StepResult(
        alg, gpus, nodes, t_comp, t_opt, comm_total, step - t_comp - t_opt, step, opt, shard, state
    )


@dataclass(frozen=True)
class TimeToTrain:
    steps: int
    step: float
    evals: int
    eval_time: float
    total: float


def time_to_train(
    model: ModelSpec, train: TrainSpec, cluster: Cluster, nodes: int, samples: float | None = None
) -> TimeToTrain:
    samples = samples or model.samples_to_converge
    if not samples or samples <= 0:
        raise ConfigError(f"samples to converge must be > 0, got {samples}")
    res = step_time(model, train, cluster, nodes)
    global_batch = res.gpus * train.local_batch
    steps = math.ceil(samples / global_batch - 1e-9)
    evals = int(samples // model.eval_every_samples) if model.eval_every_samples else 0
    # Evaluation: forward only (1/3 of training FLOPs) on this rank's share of the eval set.
    per_eval = (
        compute_time(
            model, replace(train, local_batch=max(model.eval_samples / res.gpus, 1e-9)), cluster
        )
        / 3
    )
    eval_time = evals * per_eval if model.eval_samples else 0.0
    return TimeToTrain(
        steps, res.step, evals, eval_time, steps * res.step + eval_time + train.fixed_overhead_s
    )


def gpu_counts(cluster: Cluster, max_gpus: int = 4096, min_gpus: int | None = None) -> list[int]:
    """Powers of two from one node (or ``min_gpus``) to ``max_gpus``, all whole numbers of nodes."""
    g = cluster.gpus_per_node
    start = max(min_gpus or g, g)
    out, n = [], start
    while n <= max_gpus:
        if n % g == 0:
            out.append(n)
        n *= 2
    if not out:
        raise ConfigError(
            f"no GPU count between {start} and {max_gpus} is a whole number of {g}-GPU nodes"
        )
    return out


def sweep(
    model: ModelSpec, train: TrainSpec, cluster: Cluster, algorithms: list[str], gpus: list[int]
) -> list[StepResult]:
    rows = []
    for n in gpus:
        for alg in algorithms:
            rows.append(
                step_time(model, replace(train, algorithm=alg), cluster, n // cluster.gpus_per_node)
            )
    return rows
