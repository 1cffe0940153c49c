"""A data-parallel training step with bucketed gradient all-reduce overlapped with backward.

Timeline of one step on every rank (weak scaling: the local batch is fixed, the global batch grows):

    forward (1/3 of compute) | backward (2/3) ............................. | optimizer
                               bucket 1 ready -> all-reduce 1 -> all-reduce 2 -> ... (one comm
                               stream)

Assumptions, each one a choice a user can change:
- backward costs twice the forward (the standard 1:2 FLOP split, Kaplan et al. 2020 "6N" rule);
- gradients become ready at a uniform rate during backward (parameters spread evenly over layers),
  are packed into buckets of ``bucket_mb`` (25 MB is the PyTorch DDP default, Li et al. VLDB 2020)
  and all-reduced one after another on a single communication stream, each as soon as it is ready;
- the optimizer step runs after the last bucket and streams its state through HBM at 80 % of peak
  bandwidth (a memory-bound elementwise kernel; STREAM-like efficiency);
- a sharded optimizer (``TrainSpec.optimizer``, scaleout.sim.sharded) reduce-scatters instead, runs
  one small all-reduce of LAMB's per-tensor norms, updates its 1/shard of the parameters bucket by
  bucket and all-gathers each updated bucket at once (gathers overlap the later buckets' updates);
- a fixed per-step cost that scales with neither FLOPs nor bytes (``TrainSpec.host_s``: host work
  between steps that the device waits for: the next batch, the replay or launches, per-step
  checks), added once per step; without CUDA graphs the device also cannot finish before the host
  has issued the step's kernels (``TrainSpec.launch_s``: step >= launch time). Calibrations with
  their sources: ``STEP_OVERHEADS`` (scaleout's own H200 rows) and scaleout.sim.mlperf (NVIDIA's);
- scaling efficiency = (compute + optimizer + host) / step time, i.e. per-GPU throughput relative
  to one GPU that does not communicate.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from itertools import accumulate
from typing import Literal

from scaleout.comm.algorithm import ALGORITHMS
from scaleout.config.schema import AUTO
from scaleout.errors import ConfigError
from scaleout.families import FAMILIES
from scaleout.sim.cluster import Cluster
from scaleout.sim.collectives import canonical
from scaleout.sim.convergence import ConvergenceCurve
from scaleout.sim.sharded import check_optimizer, gather_time, norm_time, reduce_time, shard_ranks
from scaleout.units import DEFAULT_BUCKET_MB

MEM_EFFICIENCY = 0.8


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: float
    flops_per_sample: float  # training FLOPs (forward + backward) per sample
    grad_bytes: int = 2  # bytes per gradient element on the wire (fp16/bf16 = 2, fp32 = 4)
    opt_bytes_per_param: float = 32.0  # optimizer HBM traffic per parameter per step
    # bytes per parameter element a sharded optimizer all-gathers (fp16 model weights)
    param_bytes: int = 2
    # Optimizer state per parameter: fp32 master weights + two fp32 moments (ZeRO's K = 12 for
    # mixed-precision Adam, Rajbhandari et al. 2020; LAMB keeps the same state).
    state_bytes_per_param: float = 12.0
    param_tensors: int = 400  # parameter tensors (LAMB's per-tensor norms); BERT-large has ~400
    samples_to_converge: float | None = None
    eval_samples: float = 0.0
    eval_every_samples: float | None = None
    # MLPerf's evaluation schedule, a function of the global batch (``eval_interval``); overrides
    # eval_every_samples when set: "mlperf-bert" or "mlperf-resnet"
    eval_rule: str | None = None
    notes: str = ""
    # training FLOPs of one sample at full length, every output computed (Reference's); None: as
    # flops_per_sample
    dense_flops_per_sample: float | None = None
    # samples of one epoch of the training set (Family.train_samples): "mlperf-resnet" evaluates
    # every 4
    epoch_samples: float | None = None


@dataclass(frozen=True)
class TrainSpec:
    local_batch: float
    algorithm: str = "flat"
    bucket_mb: float = DEFAULT_BUCKET_MB
    mfu: float = 0.4  # achieved fraction of the device's peak FLOP/s
    samples_per_s: float | None = None  # per device; overrides mfu when given (e.g. CPU clusters)
    overlap: bool = True
    # grid pipeline chunks; None: 1 on NCCL, scaleout.comm.grid's rule on gloo
    chunks: int | None = None
    torus_x: int | Literal["node", "square"] | None = None  # node: GPUs per node; square: ~sqrt(p)
    fixed_overhead_s: float = 0.0  # added once to time-to-train (e.g. untimed-but-counted setup)
    optimizer: Literal["replicated", "sharded", "sharded-node"] = "replicated"  # sim/sharded.py
    # Fixed per-step costs (see the module doc and STEP_OVERHEADS): host time the device waits for,
    # once per step; and, eager only, the host's launch time of one step (the step takes at least
    # that long: compute hides launches only when it is longer).
    cuda_graphs: bool = True
    host_s: float = 0.0
    launch_s: float = 0.0
    # A compressed gradient wire (comm.compression bf16/fp16): a sharded optimizer moves it by
    # all-to-all with fp32 sums (scaleout.sim.sharded.a2a_reduce_time), never a wire-dtype ring.
    wire_a2a: bool = False


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
    host: float = 0.0  # fixed per-step cost: host work, and eager launch time not hidden
    chosen: str | None = None  # algorithm "auto": the named algorithm it prices (the fastest)

    @property
    def efficiency(self) -> float:
        """Relative to one GPU that does not communicate (which pays the per-step host cost too)."""
        return (self.compute + self.optimizer + self.host) / self.step

    def throughput(self, local_batch: float) -> float:
        return self.gpus * local_batch / self.step


def _presets() -> dict[str, ModelSpec]:
    """The model presets: each registered family's reference model (``Family.reference``: its
    formulas and MLPerf facts), keyed by its name, in registration order."""
    out: dict[str, ModelSpec] = {}
    for _, fam in FAMILIES.items():
        ref = fam.reference
        if ref is not None and ref.name not in out:
            out[ref.name] = ModelSpec(**asdict(ref), epoch_samples=fam.train_samples)
    return out


MODELS: dict[str, ModelSpec] = _presets()


@dataclass(frozen=True)
class StepOverhead:
    """Fixed per-step costs of one software stack, with and without CUDA graphs."""

    name: str
    graphed_host_s: float  # per step with the step captured (replay + what stays on the host)
    eager_launch_s: float  # eager: the host's time to issue one step (the step's floor)
    source: str


# scaleout's own stack, measured: `scaleout bench gpucheck` resnet50 rows on one H200
# (docs/step-optimizations.md, "ResNet-50 on the GPU"): (images/GPU, eager img/s, graphed img/s).
H200_RESNET50_ROWS = ((35, 1044.0, 3180.0), (64, 1794.0, 3833.0), (128, 3902.0, 4299.0))


def _h200_overhead() -> StepOverhead:
    """Graphed: the intercept of the least-squares line step(b) = host + b x per-image through the
    graphed rows (what a step costs at zero batch: the replay and the eager LARS after it). Eager:
    the eager rows' mean step time, flat in the batch (1,044-3,902 img/s at 35-128 images is
    33-36 ms every step), i.e. launch-bound: the host's time to issue a step."""
    xs = [b for b, _, _ in H200_RESNET50_ROWS]
    ys = [b / g for b, _, g in H200_RESNET50_ROWS]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    eager = [b / e for b, e, _ in H200_RESNET50_ROWS]
    return StepOverhead(
        "scaleout-h200",
        my - slope * mx,
        sum(eager) / len(eager),
        "scaleout bench gpucheck, ResNet-50 bf16 on one H200 (docs/step-optimizations.md): "
        "graphed rows' intercept; eager rows' launch-bound step",
    )


STEP_OVERHEADS: dict[str, StepOverhead] = {
    "none": StepOverhead("none", 0.0, 0.0, "no fixed per-step cost"),
    "scaleout-h200": _h200_overhead(),
}


def with_overhead(train: TrainSpec, overhead: StepOverhead) -> TrainSpec:
    """``train`` with ``overhead``'s per-step costs for its ``cuda_graphs`` setting."""
    if train.cuda_graphs:
        return replace(train, host_s=overhead.graphed_host_s, launch_s=0.0)
    return replace(train, host_s=0.0, launch_s=overhead.eager_launch_s)


def eval_interval(model: ModelSpec, global_batch: float) -> float | None:
    """Training samples between evaluations.

    mlperf-bert: EVAL_ITER_SAMPLES = 25000 x floor(0.05 x (230.23 x B + 3,000,000) / 25000), the
    formula in NVIDIA's MLPerf v2.0 BERT configs (config_DGXA100_512x8x2x1_pack.sh: 325,000 at
    B = 16384; 175,000 at 4096 and 3072; 300,000 at 13888, as their logs show). mlperf-resnet:
    every 4 epochs (the MLPerf ResNet rule; the first evaluation's offset is ignored)."""
    if model.eval_rule == "mlperf-bert":
        return 25000.0 * math.floor(0.05 * (230.23 * global_batch + 3_000_000) / 25000)
    if model.eval_rule == "mlperf-resnet":
        if model.epoch_samples is None:
            raise ConfigError(
                f"model {model.name}: eval_rule mlperf-resnet needs epoch_samples (the training "
                "set's size)"
            )
        return 4.0 * model.epoch_samples
    if model.eval_rule is not None:
        raise ConfigError(
            f"unknown eval_rule {model.eval_rule!r}; expected mlperf-bert or mlperf-resnet"
        )
    return model.eval_every_samples


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


def model_state_bytes(model: ModelSpec, shard: int = 1) -> float:
    """Bytes of model state one rank holds (ZeRO's accounting, Rajbhandari et al. 2020): the
    weights and gradients in their wire dtypes, and the optimizer state (fp32 master weights and
    moments) over the ``shard`` ranks that share it. Activations are not counted."""
    return model.params * (
        model.param_bytes + model.grad_bytes + model.state_bytes_per_param / shard
    )


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


def stream_pipeline(start: float, ready: list[float], costs: list[float]) -> float:
    """One stream: job i starts when ready (``start`` + ready[i]) and the previous job is done."""
    done = start
    for r, c in zip(ready, costs, strict=True):
        done = max(start + r, done) + c
    return done


def step_time(model: ModelSpec, train: TrainSpec, cluster: Cluster, nodes: int) -> StepResult:
    """Predicted step time of one data-parallel step on ``nodes`` nodes. ``train.algorithm``
    "auto" (comm.algorithm=auto): the fastest of the named algorithms at ``train``'s bucket size
    (``chosen``); the run's autotuner (scaleout/parallel/autotune.py) also tunes the buckets, the
    chunk and the wire dtype, so it can only do as well or better."""
    if train.algorithm == AUTO:
        priced, errors = [], []
        for name in ALGORITHMS.names():
            try:
                priced.append(step_time(model, replace(train, algorithm=name), cluster, nodes))
            except ConfigError as exc:  # e.g. a torus grid this GPU count cannot have
                errors.append(exc)
        if not priced:  # what stops every algorithm (the first one's words)
            raise errors[0]
        best = min(priced, key=lambda r: r.step)
        return replace(best, algorithm=AUTO, chosen=best.algorithm)
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
            reduce_time(opt, alg, cluster, nodes, b, train.chunks, train.torus_x, train.wire_a2a)
            for b in sizes
        ]
        done_frac = [
            c / grads for c in accumulate(sizes)
        ]  # share of the gradients ready with bucket i
        ready = [t_bwd * f if train.overlap else t_bwd for f in done_frac]
        end = max(t_comp, stream_pipeline(t_fwd, ready, cost))
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
            step = max(end + t_norm + t_opt, stream_pipeline(end + t_norm, updated, gather))
            comm_total += t_norm + sum(gather)
    exposed = step - t_comp - t_opt
    # Fixed per-step costs: eager, the device waits for the host's launches (exposed launch time);
    # always, the host work between steps.
    host = train.host_s + (0.0 if train.cuda_graphs else max(0.0, train.launch_s - step))
    step += host
    state = model.params * model.state_bytes_per_param / shard
    return StepResult(
        alg, gpus, nodes, t_comp, t_opt, comm_total, exposed, step, opt, shard, state, host
    )


@dataclass(frozen=True)
class TimeToTrain:
    steps: int
    step: float
    evals: int
    eval_time: float
    total: float
    samples: float = 0.0  # samples to converge used


def time_to_train(
    model: ModelSpec,
    train: TrainSpec,
    cluster: Cluster,
    nodes: int,
    samples: float | None = None,
    convergence: ConvergenceCurve | None = None,
) -> TimeToTrain:
    """Steps x step time + evaluations. Samples to converge: ``samples`` if given, else the
    ``convergence`` curve at this global batch (scaleout.sim.convergence), else the preset's."""
    res = step_time(model, train, cluster, nodes)
    global_batch = res.gpus * train.local_batch
    if not samples and convergence is not None:
        samples = convergence.samples(global_batch)
    samples = samples or model.samples_to_converge
    if not samples or samples <= 0:
        raise ConfigError(f"samples to converge must be > 0, got {samples}")
    steps = math.ceil(samples / global_batch - 1e-9)
    every = eval_interval(model, global_batch)
    evals = int(samples // every) if every else 0
    # Evaluation: forward only (1/3 of training FLOPs) on this rank's share of the eval set, plus
    # the per-step host cost once (one result read per evaluation).
    share = max(model.eval_samples / res.gpus, 1e-9)
    per_eval = compute_time(model, replace(train, local_batch=share), cluster) / 3 + train.host_s
    eval_time = evals * per_eval if model.eval_samples else 0.0
    return TimeToTrain(
        steps,
        res.step,
        evals,
        eval_time,
        steps * res.step + eval_time + train.fixed_overhead_s,
        samples,
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
