"""A data-parallel training step with bucketed gradient all-reduce overlapped with backward.

Timeline of one step on every rank (weak scaling: the local batch is fixed, the global batch grows):

    forward (1/3 of compute) | backward (2/3) ............................. | optimizer
                               bucket 1 ready -> all-reduce 1 -> all-reduce 2 -> ... (one comm stream)

Assumptions, each one a choice a user can change:
- backward costs twice the forward (the standard 1:2 FLOP split, Kaplan et al. 2020 "6N" rule);
- gradients become ready at a uniform rate during backward (parameters spread evenly over layers),
  are packed into buckets of ``bucket_mb`` (25 MB is the PyTorch DDP default, Li et al. VLDB 2020) and
  all-reduced one after another on a single communication stream, each as soon as it is ready;
- the optimizer step runs after the last bucket and streams its state through HBM at 80 % of peak
  bandwidth (a memory-bound elementwise kernel; STREAM-like efficiency);
- scaling efficiency = (compute + optimizer) / step time, i.e. per-GPU throughput relative to one
  GPU that does not communicate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from scaleout.errors import ConfigError
from scaleout.sim.cluster import Cluster
from scaleout.sim.collectives import allreduce_cost, canonical

MEM_EFFICIENCY = 0.8


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: float
    flops_per_sample: float  # training FLOPs (forward + backward) per sample
    grad_bytes: int = 2  # bytes per gradient element on the wire (fp16/bf16 = 2, fp32 = 4)
    opt_bytes_per_param: float = 32.0  # optimizer HBM traffic per parameter per step
    samples_to_converge: float | None = None
    eval_samples: float = 0.0
    eval_every_samples: float | None = None
    notes: str = ""


@dataclass(frozen=True)
class TrainSpec:
    local_batch: float
    algorithm: str = "ring"
    bucket_mb: float = 25.0
    mfu: float = 0.4  # achieved fraction of the device's peak FLOP/s
    samples_per_s: float | None = None  # per device; overrides mfu when given (e.g. CPU clusters)
    overlap: bool = True
    chunks: int | None = None  # grid pipeline chunks; None: 1 on NCCL, scaleout.comm.grid's rule on gloo
    torus_x: int | str | None = None  # integer, "node" (= GPUs per node) or "square" (~sqrt(p))
    fixed_overhead_s: float = 0.0  # added once to time-to-train (e.g. untimed-but-counted setup)


@dataclass(frozen=True)
class StepResult:
    algorithm: str
    gpus: int
    nodes: int
    compute: float
    optimizer: float
    comm: float  # total all-reduce time (serialized)
    exposed: float  # communication not hidden behind backward
    step: float

    @property
    def efficiency(self) -> float:
        return (self.compute + self.optimizer) / self.step

    def throughput(self, local_batch: float) -> float:
        return self.gpus * local_batch / self.step


def bert_flops_per_sequence(tokens: float = 512 / 2.0013, layers: int = 24, hidden: int = 1024,
                            vocab: int = 30522, masked_fraction: float = 0.15) -> float:
    """Training FLOPs of one BERT sequence (3 x forward).

    Forward per token: 2 x 12 d^2 L (QKV, projection, 4d MLP) + 4 s d L (scores and weighted sum over the
    sequence's own s tokens: packed, unpadded attention). The MLM head runs only on masked tokens (15 %,
    BERT paper): 2 x (d^2 + d V). Default tokens = 512 / 2.0013, the mean real length implied by the
    Wikipedia-512 packing ceiling (Graphcore arXiv 2107.02027; DESIGN facts).
    """
    per_token = 2 * 12 * hidden**2 * layers + 4 * tokens * hidden * layers
    head = masked_fraction * tokens * 2 * (hidden**2 + hidden * vocab)
    return 3 * (tokens * per_token + head)


MODELS: dict[str, ModelSpec] = {
    # MLPerf Training BERT-large phase 2 (NVIDIA v2.0 submission: LAMB, fp16 gradients, packed data).
    "bert-large": ModelSpec(
        "bert-large", params=335e6, flops_per_sample=bert_flops_per_sequence(), grad_bytes=2,
        # LAMB with fp32 master weights: read p, m, v, g + write p, m, v, fp16 copy ~ 32 B/param.
        opt_bytes_per_param=32.0,
        samples_to_converge=470 * 16384,  # NVIDIA v2.0 512-node config: MAX_STEPS=470 at 16384 sequences
        eval_samples=10000, eval_every_samples=325000,  # MLPerf BERT eval set; EVAL_ITER_SAMPLES in config
        notes="BERT-large 24x1024, 335M params; MLPerf v2.0 NVIDIA config_DGXA100_512x8x2x1_pack.sh",
    ),
    # ResNet-50 v1.5: 25.6M params, 4.1 GFLOP forward per 224x224 image (x3 for training).
    "resnet50": ModelSpec(
        "resnet50", params=25.6e6, flops_per_sample=3 * 4.1e9, grad_bytes=4, opt_bytes_per_param=16.0,
        samples_to_converge=37 * 1281167,  # MLPerf LARS runs converge in ~35-40 epochs of ImageNet-1k
        notes="ResNet-50 v1.5, fp32 gradients (Horovod-era default)",
    ),
}


def get_model(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; expected one of {', '.join(MODELS)}") from None


def compute_time(model: ModelSpec, train: TrainSpec, cluster: Cluster) -> float:
    if train.local_batch <= 0:
        raise ConfigError(f"local batch must be > 0, got {train.local_batch}")
    if train.samples_per_s:
        return train.local_batch / train.samples_per_s
    if cluster.device is None:
        raise ConfigError(f"cluster {cluster.name!r} has no device FLOP/s; give samples per second per device")
    if not 0 < train.mfu <= 1:
        raise ConfigError(f"mfu must be in (0, 1], got {train.mfu}")
    return train.local_batch * model.flops_per_sample / (cluster.device.peak_flops * train.mfu)


def optimizer_time(model: ModelSpec, cluster: Cluster) -> float:
    if cluster.device is None:
        return 0.0
    return model.params * model.opt_bytes_per_param / (cluster.device.mem_bw * MEM_EFFICIENCY)


def bucket_sizes(total_bytes: float, bucket_mb: float) -> list[float]:
    if bucket_mb <= 0:
        raise ConfigError(f"bucket size must be > 0 MB, got {bucket_mb}")
    cap = bucket_mb * 1e6
    n = max(1, math.ceil(total_bytes / cap))
    return [cap] * (n - 1) + [total_bytes - cap * (n - 1)]


def step_time(model: ModelSpec, train: TrainSpec, cluster: Cluster, nodes: int) -> StepResult:
    """Predicted step time of one data-parallel step on ``nodes`` nodes."""
    alg = canonical(train.algorithm)
    gpus = cluster.gpus_per_node * nodes
    t_comp = compute_time(model, train, cluster)
    t_opt = optimizer_time(model, cluster)
    t_fwd, t_bwd = t_comp / 3, 2 * t_comp / 3
    comm_total = 0.0
    end = t_fwd + t_bwd
    if gpus > 1:
        grads = model.params * model.grad_bytes
        ready, clock, done = 0.0, 0.0, 0.0
        for size in bucket_sizes(grads, train.bucket_mb):
            ready += size
            t = allreduce_cost(alg, cluster, nodes, size, train.chunks, train.torus_x).time
            comm_total += t
            start = t_fwd + t_bwd * ready / grads if train.overlap else t_fwd + t_bwd
            clock = max(start, done)
            done = clock + t
        end = max(end, done)
    step = end + t_opt
    return StepResult(alg, gpus, nodes, t_comp, t_opt, comm_total, step - t_comp - t_opt, step)


@dataclass(frozen=True)
class TimeToTrain:
    steps: int
    step: float
    evals: int
    eval_time: float
    total: float


def time_to_train(model: ModelSpec, train: TrainSpec, cluster: Cluster, nodes: int,
                  samples: float | None = None) -> TimeToTrain:
    samples = samples or model.samples_to_converge
    if not samples or samples <= 0:
        raise ConfigError(f"samples to converge must be > 0, got {samples}")
    res = step_time(model, train, cluster, nodes)
    global_batch = res.gpus * train.local_batch
    steps = math.ceil(samples / global_batch - 1e-9)
    evals = int(samples // model.eval_every_samples) if model.eval_every_samples else 0
    # Evaluation: forward only (1/3 of training FLOPs) on this rank's share of the eval set.
    per_eval = compute_time(model, replace(train, local_batch=max(model.eval_samples / res.gpus, 1e-9)), cluster) / 3
    eval_time = evals * per_eval if model.eval_samples else 0.0
    return TimeToTrain(steps, res.step, evals, eval_time, steps * res.step + eval_time + train.fixed_overhead_s)


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
        raise ConfigError(f"no GPU count between {start} and {max_gpus} is a whole number of {g}-GPU nodes")
    return out


def sweep(model: ModelSpec, train: TrainSpec, cluster: Cluster, algorithms: list[str],
          gpus: list[int]) -> list[StepResult]:
    rows = []
    for n in gpus:
        for alg in algorithms:
            rows.append(step_time(model, replace(train, algorithm=alg), cluster, n // cluster.gpus_per_node))
    return rows
