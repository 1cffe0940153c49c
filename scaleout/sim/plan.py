"""Plan a run: the Pareto front of predicted time-to-train against GPU-hours (``scaleout plan``).

The grid: nodes x GPUs per node x per-GPU batch x all-reduce algorithm x optimizer placement
(replicated, sharded over the world, sharded within the node) x SHARP on/off. Each point is priced
by the simulator (scaleout.sim.step: bucketed, overlapped step; scaleout.sim.sharded for the
placements; scaleout.sim.collectives with SHARP) and the samples to converge at its global batch
come from a convergence curve (scaleout.sim.convergence: MLCommons' RCPs of the config's MLPerf
benchmark, or a fit to ``scaleout bench largebatch`` runs):

    time to train = steps x step time + evaluations x their cost
    steps         = ceil(samples(B) / B), rounded up to a multiple of the evaluation interval (a
                    run stops at the first evaluation that reaches the target)
    GPU-hours     = time to train x GPUs / 3600

Evaluations come at the schedule's interval (scaleout.sim.schedule: MLPerf's rule for the
family's benchmark, else the config's ``train.eval_every x train.global_batch`` samples),
``data.eval_samples`` each (forward only, one third of a training step's FLOPs per sample).
Each point also carries the untimed start before ``run_start`` (scaleout.sim.startup): the
front and the picks rank by the time from the launch to the target, and GPU-hours include it.

The front keeps every point no other point beats on both axes. Its **knee** is the point farthest
below the chord between the front's two ends with each axis on a log scale scaled to [0, 1], i.e.
the smallest (log time + log GPU-hours) in those units: beyond it, halving the time costs a larger
factor of GPU-hours than it did before.

For the chosen point the plan writes the ``key=value`` overrides of the config (validated by the
config loader; the schedule's among them) and the ``sbatch`` line of the family's Slurm script
(every placement has its keys: ``sharded-node`` is ``optim.shard=node``; a placement without
keys would be priced, never chosen).

Pure Python; no torch.
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from scaleout.comm import ALGORITHMS
from scaleout.config.load import load_config, resolve_config_path
from scaleout.errors import ConfigError
from scaleout.families import FAMILIES
from scaleout.sim.cluster import (
    PARAMS,
    PRESETS,
    Cluster,
    Constants,
    custom_cluster,
    get_cluster,
    with_sharp,
)
from scaleout.sim.convergence import (
    DEFAULT_RULESET,
    MODEL_BENCHMARK,
    RCP_RULESET,
    ConvergenceCurve,
    curve_for,
    load_rcps,
)
from scaleout.sim.fromconfig import from_config
from scaleout.sim.schedule import (
    Reference,
    Schedule,
    config_reference,
    nearest,
    rcp_references,
    schedule_for,
)
from scaleout.sim.sharded import OPTIMIZERS, shard_ranks
from scaleout.sim.startup import untimed_start_s
from scaleout.sim.step import (
    ModelSpec,
    TrainSpec,
    compute_time,
    eval_interval,
    get_model,
    model_state_bytes,
    time_to_train,
)

# Config keys of each optimizer placement (None: no config key in this scaleout: priced only).
PLACEMENT_OVERRIDES: dict[str, list[str] | None] = {
    # (shard=world: the key only means something sharded, and a config may set node)
    "replicated": ["optim.sharded=false", "optim.overlap_comm=false", "optim.shard=world"],
    "sharded": ["optim.sharded=true", "optim.overlap_comm=true", "optim.shard=world"],
    # the sharded LAMB with its state sharded over the node's ranks (apex DistributedFusedLAMB)
    "sharded-node": ["optim.sharded=true", "optim.overlap_comm=true", "optim.shard=node"],
}
# The family's Slurm script (slurm/<script>.sh) and the config it trains (fixed in the script).
SLURM_SCRIPTS = {
    "bert": "bert_256node.sh",
    "resnet": "resnet50_128node.sh",
    "llama": "llama31_8b_16node.sh",
}
SLURM_CONFIGS = {
    "bert": "configs/bert_large_256x8.yaml",
    "resnet": "configs/resnet50_128x8.yaml",
    "llama": "configs/llama31_8b_16x8.yaml",
}
PICKS = ("knee", "fastest", "cheapest")


@dataclass(frozen=True)
class Candidate:
    nodes: int
    gpus_per_node: int
    per_gpu_batch: int
    algorithm: str
    optimizer: str
    sharp: bool

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def global_batch(self) -> int:
        return self.gpus * self.per_gpu_batch

    def label(self) -> str:
        return (
            f"{self.nodes}x{self.gpus_per_node} b{self.per_gpu_batch} {self.algorithm} "
            f"{self.optimizer}{' sharp' if self.sharp else ''}"
        )


@dataclass
class Point:
    candidate: Candidate
    step_s: float
    throughput: float  # samples/s of the whole job
    samples: float  # to converge at this global batch
    steps: int
    evals: int
    eval_s: float
    ttt_s: float
    extrapolated: bool  # the global batch is beyond the convergence curve's largest point
    overrides: list[str] | None  # None: no config key for this point (priced only)
    front: bool = False
    knee: bool = False
    schedule: Schedule | None = None
    # the untimed start (allocation to run_start: launch, rendezvous, communicators, data and
    # checkpoint load; scaleout.sim.startup), paid before MLPerf's clock
    start_s: float = 0.0
    # why MLPerf would not accept this point's batch (beyond the largest RCP), else None
    refused: str | None = None

    @property
    def wall_s(self) -> float:
        """Launch to target: the untimed start plus MLPerf's time to train."""
        return self.start_s + self.ttt_s

    @property
    def gpu_hours(self) -> float:
        """GPU-hours of the allocation: the untimed start is paid for too."""
        return gpu_hours(self.wall_s, self.candidate.gpus)

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self.candidate),
            "gpus": self.candidate.gpus,
            "global_batch": self.candidate.global_batch,
            "step_s": self.step_s,
            "throughput": self.throughput,
            "samples": self.samples,
            "steps": self.steps,
            "evals": self.evals,
            "eval_s": self.eval_s,
            "ttt_s": self.ttt_s,
            "gpu_hours": self.gpu_hours,
            "extrapolated": self.extrapolated,
            "overrides": self.overrides,
            "front": self.front,
            "knee": self.knee,
            "start_s": self.start_s,
            "wall_s": self.wall_s,
            "refused": self.refused,
            "schedule": asdict(self.schedule) if self.schedule else None,
        }


def gpu_hours(ttt_s: float, gpus: int) -> float:
    return ttt_s * gpus / 3600.0


# ---------------------------------------------------------------------------------------- inputs


def load_cluster(spec: str, gpus_per_node: int | None = None) -> Cluster:
    """A preset name, or a ``scaleout simulate calibrate --out`` JSON: its fitted constants on the
    netns-1g preset they were fitted against (the calibration's prior)."""
    if spec.endswith(".json") or Path(spec).is_file():
        p = Path(spec)
        try:
            data = json.loads(p.read_text())
        except OSError as e:
            raise ConfigError(
                f"--preset {spec}: cannot read the calibration JSON ({e.strerror})"
            ) from None
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"--preset {spec}: not JSON ({e.msg} at line {e.lineno}); expected "
                "`scaleout simulate calibrate --out` JSON"
            ) from None
        vec = data.get("constants") if isinstance(data, dict) else None
        ok = (
            isinstance(vec, list)
            and len(vec) == len(PARAMS)
            and all(isinstance(v, int | float) and math.isfinite(v) and v >= 0 for v in vec)
        )
        if not ok:
            raise ConfigError(
                f"--preset {spec}: 'constants' is {vec!r}; expected a list of {len(PARAMS)} "
                f"numbers >= 0 ({', '.join(PARAMS)}: `scaleout simulate calibrate --out` JSON)"
            )
        prior = get_cluster(str(data.get("prior") or "netns-1g"))
        base = replace(
            prior,
            name=f"{prior.name} calibrated ({p.name})",
            constants=Constants.from_vector(vec),
        )
    else:
        try:
            base = get_cluster(spec)
        except ConfigError:
            raise ConfigError(
                f"--preset {spec!r}: unknown cluster preset; expected one of "
                f"{', '.join(PRESETS)} or a calibration .json"
            ) from None
    return custom_cluster(base, gpus_per_node)


def compute_rates(text: str | None) -> dict[int, float] | None:
    """``--samples-per-s``: ``RATE`` (samples/s per GPU at any batch) or ``B:RATE,B:RATE`` (per
    per-GPU batch; the step time is linear in the batch between them)."""
    if text is None or not str(text).strip():
        return None
    out: dict[int, float] = {}
    for item in str(text).split(","):
        b, _, r = item.strip().rpartition(":")
        try:
            batch = int(b) if b else 0
            rate = float(r)
        except ValueError:
            batch, rate = -1, -1.0
        if batch < 0 or not (rate > 0 and math.isfinite(rate)):
            raise ConfigError(
                f"--samples-per-s {item.strip()!r}: expected RATE or BATCH:RATE with a rate > 0 "
                "samples/s per GPU (e.g. 40 or 8:35,16:52)"
            )
        out[batch] = rate
    return out


def rate_at(rates: dict[int, float], batch: float) -> float:
    """Samples/s per GPU at ``batch``: step time b / rate linear in b between the given batches,
    the nearest rate outside them."""
    if 0 in rates or len(rates) == 1:
        return rates.get(0) or next(iter(rates.values()))
    pts = sorted((b, b / r) for b, r in rates.items())
    if batch <= pts[0][0]:
        return rates[pts[0][0]]
    if batch >= pts[-1][0]:
        return rates[pts[-1][0]]
    for (b0, t0), (b1, t1) in zip(pts, pts[1:], strict=False):
        if batch <= b1:
            return batch / (t0 + (t1 - t0) * (batch - b0) / (b1 - b0))
    raise AssertionError("unreachable")


def positive_ints(text: str | None, flag: str) -> list[int] | None:
    """A comma list of positive integers (None: not given)."""
    if text is None:
        return None
    items = [t.strip() for t in str(text).split(",")]
    try:
        values = [int(t) for t in items]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise ConfigError(f"{flag} {text!r}: expected positive integers separated by commas")
    return sorted(set(values))


def curve_of_family(arch: str, fit: str | None, ruleset: str = DEFAULT_RULESET) -> ConvergenceCurve:
    """The convergence curve: a ``--fit`` bench largebatch JSON, else the RCPs of the family's
    MLPerf benchmark. One line when neither exists."""
    if fit:
        if not Path(fit).is_file():
            raise ConfigError(
                f"--fit {fit}: no such file; expected `scaleout bench largebatch` JSON"
            )
        return curve_for("", fit, ruleset)
    family = FAMILIES.get(arch)
    preset = family.sim_preset
    if MODEL_BENCHMARK.get(preset) is None or family.benchmark is None:
        raise ConfigError(
            f"model.arch={arch}: no convergence curve (no MLPerf RCPs for it); expected --fit "
            "with a `scaleout bench largebatch --out` JSON"
        )
    return curve_for(preset, "rcp", ruleset)


# ------------------------------------------------------------------------------------------- grid


@dataclass
class Grid:
    nodes: list[int]
    gpus_per_node: list[int]
    per_gpu_batch: list[int]
    algorithms: list[str]
    optimizers: list[str]
    sharp: list[bool]

    def candidates(self) -> list[Candidate]:
        return [
            Candidate(n, g, b, a, o, s)
            for n in self.nodes
            for g in self.gpus_per_node
            for b in self.per_gpu_batch
            for a in self.algorithms
            for o in self.optimizers
            for s in self.sharp
        ]


def default_grid(
    cluster: Cluster,
    per_gpu_batch: int,
    max_nodes: int = 512,
    nodes: list[int] | None = None,
    gpus_per_node: list[int] | None = None,
    batches: list[int] | None = None,
    algorithms: list[str] | None = None,
    optimizers: list[str] | None = None,
    sharp: list[bool] | None = None,
) -> Grid:
    """Every dimension the caller did not restrict: nodes 1, 2, 4 ... max_nodes; the cluster's
    GPUs per node; the config's per-GPU batch / 4 ... x 4; every registered algorithm; every
    placement; SHARP off, and on where the cluster has it."""
    if nodes is None:
        nodes = [2**i for i in range(int(math.log2(max(1, max_nodes))) + 1)]
    if batches is None:
        batches = sorted({max(1, int(per_gpu_batch * f)) for f in (0.25, 0.5, 1, 2, 4)})
    if algorithms is None:
        algorithms = list(ALGORITHMS.names())
    for a in algorithms:
        if a not in ALGORITHMS:
            raise ConfigError(
                f"--algorithms {a!r}: expected one of {', '.join(ALGORITHMS.names())}"
            )
    for o in optimizers or ():
        if o not in OPTIMIZERS:
            raise ConfigError(f"--optimizers {o!r}: expected one of {', '.join(OPTIMIZERS)}")
    if sharp is None:
        capable = cluster.backend == "nccl" and cluster.constants.alpha_sharp > 0
        sharp = [False, True] if capable else [False]
    return Grid(
        nodes,
        gpus_per_node or [cluster.gpus_per_node],
        batches,
        algorithms,
        optimizers or list(OPTIMIZERS),
        sharp,
    )


# ------------------------------------------------------------------------------------ prediction


@dataclass
class Workload:
    """What the config fixes: the model per placement (its wire bytes), the train settings."""

    arch: str
    models: dict[str, ModelSpec]  # per optimizer placement
    train: TrainSpec
    config_per_gpu_batch: float
    config_nodes: int
    config_gpus_per_node: int
    grad_accum: int = 1
    notes: list[str] = field(default_factory=list)
    # one config sample is this many of the curve's (MLPerf's global_batch_size: a packed BERT row
    # counts the packing's integer rate of sequences, scaleout.train.hparams); 1 for a --fit
    rate: int = 1
    optimizer_name: str = "lamb"
    eval_model: ModelSpec | None = None  # the family's MLPerf evaluation rule, when it has one
    references: list[Reference] = field(default_factory=list)  # the schedule's, nearest is used
    ceiling: float | None = None  # MLPerf's largest accepted batch (curve units), None: none
    config: str = ""  # the config file and overrides it was read from
    overrides: list[str] = field(default_factory=list)
    # per placement: its step as the trainer runs it (captured? overlapped? wire bytes), where
    # it differs from ``train`` (the replicated placement's): the sharded LAMB's captured step
    # overlaps its reduce-scatters, DataParallel's captured step does not
    trains: dict[str, TrainSpec] = field(default_factory=dict)


def for_curve(work: Workload, curve: ConvergenceCurve) -> Workload:
    """The workload with the units, references and batch ceiling of its convergence curve: the
    family's RCPs (MLPerf batches, the RCP records' hyper-parameters, the largest RCP batch as the
    ceiling: rcp_checker refuses a batch above it, 'Missing RCP') or a --fit (config units, the
    config's own hyper-parameters, no ceiling)."""
    cfg = load_config(work.config, work.overrides)
    family = FAMILIES.get(cfg.model.arch)
    opt = cfg.optim.name
    if curve.e_min is not None:  # a fit: in the config's units
        return replace(work, rate=1, optimizer_name=opt, references=[config_reference(cfg, 1)])
    rate = max(1, round(family.sequences_per_sample(cfg)))
    # the ruleset that has the benchmark's RCPs (llama31_8b's are newer than the default round)
    ruleset = RCP_RULESET.get(family.benchmark or "", DEFAULT_RULESET)
    refs = rcp_references(family.benchmark, ruleset) if family.benchmark else []
    ceiling = (
        max(r.batch for r in load_rcps(family.benchmark, ruleset)) if family.benchmark else None
    )
    rule = get_model(family.sim_preset)
    return replace(
        work,
        rate=rate,
        optimizer_name=opt,
        eval_model=rule if rule.eval_rule else None,
        references=refs or [config_reference(cfg, rate)],
        ceiling=ceiling,
    )


def workload(config: str, overrides: list[str] | None = None) -> Workload:
    """The config (with ``overrides``) read as the simulator's inputs, once per placement."""
    overrides = list(overrides or [])
    models: dict[str, ModelSpec] = {}
    trains: dict[str, TrainSpec] = {}
    run = None
    for placement, extra in PLACEMENT_OVERRIDES.items():
        if extra is None:  # a placement without keys: priced with the sharded wire bytes
            extra = PLACEMENT_OVERRIDES["sharded"]
        try:
            cfg = load_config(config, [*overrides, *extra])
        except ConfigError:
            if placement == "replicated":
                raise
            continue  # the config's optimizer has no sharded form (LARS): replicated only
        r = from_config(cfg, config)
        # the config's evaluation schedule (train.eval_every x global batch), not MLPerf's rule
        models[placement] = replace(r.model, eval_rule=None)
        trains[placement] = replace(r.train, torus_x=None)
        if placement == "replicated":
            run = r
            arch, accum = cfg.model.arch, cfg.train.grad_accum
    assert run is not None
    return Workload(
        arch,
        models,
        replace(run.train, torus_x=None),
        run.train.local_batch * accum,
        run.nodes,
        run.gpus_per_node,
        accum,
        config=config,
        overrides=overrides,
        trains=trains,
    )


def predict(
    work: Workload,
    cluster: Cluster,
    curve: ConvergenceCurve,
    cand: Candidate,
    rates: dict[int, float] | None = None,
    cores: int | None = None,
    host_s: float = 0.0,
) -> Point:
    """Time to train and GPU-hours of one candidate."""
    c = with_sharp(replace(cluster, gpus_per_node=cand.gpus_per_node), cand.sharp)
    spr = None
    if rates:
        spr = rate_at(rates, cand.per_gpu_batch)
        if cores:  # ranks of an emulated cluster share the machine's cores
            spr *= min(1.0, cores / cand.gpus)
    train = replace(
        work.trains.get(cand.optimizer, work.train),
        local_batch=float(cand.per_gpu_batch),
        algorithm=cand.algorithm,
        optimizer=cand.optimizer,  # type: ignore[arg-type]
        samples_per_s=spr,
        host_s=host_s or work.train.host_s,
    )
    model = work.models[cand.optimizer]
    sched = schedule_of(work, curve, cand)
    b = cand.global_batch * work.rate  # in the curve's units
    samples = curve.samples(b) / work.rate  # in the config's (packed rows for packed BERT)
    ttt = time_to_train(model, train, c, cand.nodes, samples=samples)
    # A run stops at the first evaluation that reaches the target: the schedule's predicted
    # steps (rounded up to its evaluation interval), one evaluation per interval.
    steps = sched.predicted_steps
    evals = steps // sched.eval_every
    share = max(model.eval_samples / cand.gpus, 1e-9)
    per_eval = compute_time(model, replace(train, local_batch=share), c) / 3 + train.host_s
    eval_s = evals * per_eval if model.eval_samples else 0.0
    total = steps * ttt.step + eval_s + train.fixed_overhead_s
    refused = None
    if work.ceiling is not None and b > work.ceiling * (1 + 1e-9):
        refused = (
            f"batch {b:g} is above the largest RCP batch {work.ceiling:g}: MLPerf's RCP checker "
            "refuses it ('Missing RCP')"
        )
    return Point(
        cand,
        ttt.step,
        cand.global_batch / ttt.step,
        samples,
        steps,
        evals,
        eval_s,
        total,
        curve.extrapolated(b),
        overrides_for(work, cand, sched),
        schedule=sched,
        start_s=untimed_start_s(cluster, cand.nodes, cand.gpus),
        refused=refused,
    )


def schedule_of(work: Workload, curve: ConvergenceCurve, cand: Candidate) -> Schedule:
    """The learning rate, warm-up, horizon and evaluation cadence at the candidate's batch
    (scaleout.sim.schedule), from the reference nearest its batch."""
    b = cand.global_batch * work.rate
    model = work.models[cand.optimizer]
    if work.eval_model is not None:
        every = eval_interval(work.eval_model, b)
    else:
        every = (model.eval_every_samples or 0.0) * work.rate or None
    ref = nearest(work.references, b) if work.references else None
    if ref is None:
        raise ConfigError("no reference hyper-parameters to scale the schedule from")
    return schedule_for(ref, curve, cand.global_batch, work.rate, work.optimizer_name, every)


def overrides_for(
    work: Workload, cand: Candidate, sched: Schedule | None = None
) -> list[str] | None:
    placement = PLACEMENT_OVERRIDES[cand.optimizer]
    if placement is None:
        return None
    return [
        f"launch.nnodes={cand.nodes}",
        f"launch.nproc_per_node={cand.gpus_per_node}",
        f"train.global_batch={cand.global_batch * work.grad_accum}",
        f"comm.algorithm={cand.algorithm}",
        *placement,
        *(sched.overrides() if sched is not None else []),
    ]


# ------------------------------------------------------------------------------------ the front


def front_of(points: list[Point]) -> list[Point]:
    """The non-dominated points (lower time from launch to target and lower GPU-hours are
    better), fastest first; among points equal on both axes the first is kept."""
    order = sorted(points, key=lambda p: (p.wall_s, p.gpu_hours))
    front: list[Point] = []
    best = math.inf
    for p in order:
        if p.gpu_hours < best * (1 - 1e-12):
            front.append(p)
            best = p.gpu_hours
    return front


def knee_of(front: list[Point]) -> Point:
    """The front's point farthest below the chord of its ends, each axis on a log scale (a front
    spans orders of magnitude) and scaled to [0, 1]; with the ends at (0, 1) and (1, 0) that is
    the smallest scaled log time + scaled log GPU-hours. Ties go to the faster point."""
    if not front:
        raise ConfigError("no point to plan: the grid is empty")
    t = [math.log(p.wall_s) for p in front]
    h = [math.log(p.gpu_hours) for p in front]
    span_t, span_h = (max(t) - min(t)) or 1.0, (max(h) - min(h)) or 1.0
    scores = [
        ((ti - min(t)) / span_t + (hi - min(h)) / span_h, p.wall_s)
        for ti, hi, p in zip(t, h, front, strict=True)
    ]
    return front[min(range(len(front)), key=lambda i: scores[i])]


def choose(points: list[Point], pick: str) -> Point:
    """The point the plan recommends among those with config keys: the knee of their front, the
    fastest or the cheapest."""
    if pick not in PICKS:
        raise ConfigError(f"--pick {pick!r}: expected one of {', '.join(PICKS)}")
    usable = [p for p in points if p.overrides is not None and p.refused is None]
    if not usable:
        why = next((p.refused for p in points if p.refused), None)
        raise ConfigError(
            "no point of the grid can run: "
            + (why or "no placement has config keys (priced only)")
            + "; expected a smaller --nnodes or --per-gpu-batch"
        )
    if pick == "fastest":
        return min(usable, key=lambda p: (p.wall_s, p.gpu_hours))
    if pick == "cheapest":
        return min(usable, key=lambda p: (p.gpu_hours, p.wall_s))
    return knee_of(front_of(usable))


@dataclass
class Plan:
    points: list[Point]
    front: list[Point]
    knee: Point
    chosen: Point
    notes: list[str] = field(default_factory=list)


def plan(
    work: Workload,
    cluster: Cluster,
    curve: ConvergenceCurve,
    grid: Grid,
    pick: str = "knee",
    rates: dict[int, float] | None = None,
    cores: int | None = None,
    host_s: float = 0.0,
) -> Plan:
    if cluster.device is None and not rates:
        raise ConfigError(
            f"cluster {cluster.name!r} has no device FLOP/s; expected --samples-per-s "
            "(samples/s per GPU, measured)"
        )
    if not work.references:
        work = for_curve(work, curve)
    cands, notes = within_ceiling(work.arch, grid.candidates())
    cands, mem_notes = within_memory(work, cluster, cands)
    notes += mem_notes
    points = [
        predict(work, cluster, curve, c, rates, cores, host_s)
        for c in cands
        if c.optimizer in work.models  # a placement the config's optimizer has
    ]
    if not points:
        raise ConfigError("no point to plan: the grid is empty" + "".join(f"; {n}" for n in notes))
    front = front_of(points)
    k = knee_of(front)
    on_front = {id(p) for p in front}
    for p in points:
        p.front, p.knee = id(p) in on_front, p is k
    return Plan(points, front, k, choose(points, pick), notes)


def within_ceiling(arch: str, cands: list[Candidate]) -> tuple[list[Candidate], list[str]]:
    """The candidates a closed MLPerf result may run: none above the family's largest RCP batch
    (``Family.max_global_batch``), with a note naming what the dropped widths would need."""
    fam = FAMILIES.get(arch)
    cap = fam.max_global_batch
    if cap is None:
        return cands, []
    kept = [c for c in cands if c.global_batch <= cap]
    if len(kept) == len(cands):
        return kept, []
    return kept, [
        f"{len(cands) - len(kept)} points above global batch {cap} dropped: {fam.benchmark}'s "
        f"RCPs end at {cap} samples, so at most {cap} data-parallel replicas; more GPUs need "
        f"{fam.inner_parallelism or 'model parallelism inside a replica'}"
    ]


def within_memory(
    work: Workload, cluster: Cluster, cands: list[Candidate]
) -> tuple[list[Candidate], list[str]]:
    """The candidates whose model state fits one GPU's memory (``model_state_bytes``: weights,
    gradients and the optimizer state over the ranks that share it), with a note per placement
    dropped. A device of unknown capacity checks nothing."""
    dev = cluster.device
    if dev is None or not dev.mem_bytes:
        return cands, []
    kept, dropped = [], {}
    for c in cands:
        model = work.models.get(c.optimizer)
        if model is None:
            kept.append(c)
            continue
        shard = shard_ranks(c.optimizer, replace(cluster, gpus_per_node=c.gpus_per_node), c.nodes)
        need = model_state_bytes(model, shard)
        if need <= dev.mem_bytes:
            kept.append(c)
        else:
            dropped[c.optimizer] = max(need, dropped.get(c.optimizer, 0.0))
    return kept, [
        f"{placement} points dropped: {need / 1e9:.0f} GB of model state per GPU (weights, "
        f"gradients, optimizer state / its shard) does not fit the {dev.name}'s "
        f"{dev.mem_bytes / 1e9:.0f} GB"
        for placement, need in dropped.items()
    ]


# ------------------------------------------------------------------------------------ commands


def sbatch_line(arch: str, cand: Candidate, overrides: list[str]) -> str:
    """``sbatch -N <nodes> ...`` for the family's script; SHARP through the network option and
    NCCL's CollNet switch."""
    script = SLURM_SCRIPTS.get(arch, f"<{arch} script>.sh")
    env = "NCCL_COLLNET_ENABLE=1 " if cand.sharp else ""
    net = " --network=sharp" if cand.sharp else ""
    g = cand.gpus_per_node
    # a new run needs a new name (the run directory and resume key are the job's name)
    name = f"plan-{cand.nodes}x{g}-b{cand.per_gpu_batch}"
    return (
        f"{env}sbatch -J {name} -N {cand.nodes} --ntasks-per-node {g} --gpus-per-node {g}{net} "
        f"slurm/{script} {' '.join(shlex.quote(o) for o in overrides)}"
    )


def sbatch_note(arch: str, config: str) -> str | None:
    """A line when the family's script trains another config than the one planned."""
    trains = SLURM_CONFIGS.get(arch)
    if trains and same_config(config, Path(trains).name):
        return None
    what = f"trains {trains}" if trains else "does not exist for this family"
    return f"(slurm/{SLURM_SCRIPTS.get(arch, '<script>.sh')} {what}: point it at {config})"


def same_config(a: str, b: str) -> bool:
    """Do two config names (paths or packaged names, as ``scaleout train`` takes) name one file?"""
    try:
        return resolve_config_path(a).resolve() == resolve_config_path(b).resolve()
    except ConfigError:
        return False


def launch_line(config: str, cand: Candidate, overrides: list[str], netns: bool) -> str | None:
    """The same run on this machine's launchers (``scaleout launch [--netns]``): one node of a
    real cluster, or any shape of the netns emulation; None for more than one real node (the
    local launcher would start every rank on this host: the sbatch line is the command)."""
    if cand.nodes > 1 and not netns:
        return None
    return (
        f"scaleout launch --nnodes {cand.nodes} --nproc-per-node {cand.gpus_per_node}"
        f"{' --netns' if netns else ''} -- scaleout train {shlex.quote(config)} "
        + " ".join(shlex.quote(o) for o in overrides)
    )


def commands(
    arch: str, config: str, cand: Candidate, overrides: list[str], netns: bool
) -> dict[str, str]:
    """The commands that run a point as planned: ``sbatch`` (a real cluster; with a note when
    the family's script trains another config) and ``launch`` (one real node, or the netns
    emulation)."""
    out = {}
    if not netns:
        out["sbatch"] = sbatch_line(arch, cand, overrides)
        note = sbatch_note(arch, config)
        if note:
            out["note"] = note
    launch = launch_line(config, cand, overrides, netns)
    if launch:
        out["launch"] = launch
    return out


def validate_overrides(config: str, overrides: list[str]) -> None:
    """The chosen point's overrides through the config loader (a ConfigError if one is bad)."""
    load_config(config, overrides)
