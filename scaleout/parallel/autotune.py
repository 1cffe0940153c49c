"""``comm.algorithm: auto``: the all-reduce algorithm, bucket size, first bucket, pipeline chunk
and wire dtype chosen on this world for this model (each unless the config sets it).

1. **Probe** (before ``run_start``, on synthetic tensors: no data is touched, MLPerf-legal): all
   of a few sizes, with every algorithm of ``scaleout.comm.ALGORITHMS`` that can run on this world
   (two row x column algorithms with the same row length are one schedule: probed once), timed;
   the sizes grow 4x until the next would overrun the budget (``PROBE_BUDGET_S``). Every rank's
   times are all-reduced (MAX: the slowest rank, repeat by repeat), so every rank holds the same
   table. The simulator's alpha-beta-gamma constants are fitted to it
   (:func:`scaleout.sim.calibrate.fit`), and per algorithm the measured / fitted ratio at each
   probed size is kept as its correction (interpolated in log-size, held beyond the ends), so the
   model is exact where it was measured and extrapolates with the fitted shape. With the wire dtype
   free, one bf16 row per algorithm and the cast's cost are measured too.
2. **Profile** (training step ``PROFILE_STEP``): the reducer records when each gradient became
   ready (its post-accumulate-grad hook, ``Reducer.record_ready``); all-reduced (MAX) too.
3. **Score**: every candidate (``Space``: algorithm x bucket_mb x first bucket x chunk x wire) is
   priced by the simulator's one-stream pipeline (:func:`scaleout.sim.step.stream_pipeline`): bucket
   b's all-reduce starts when its last gradient is ready and bucket b-1's is done, and takes the
   fitted time; predicted exposed communication = pipeline end - end of backward (ties: the
   least communication). Candidates that give the same buckets are priced once.
4. **A/B**: the best (A), and the best of another algorithm (else the runner-up; B), run for
   ``AB_STEPS`` real training steps each in A B B A A B order (drift hits both alike); the
   slowest rank's step times (all-reduced MAX) decide: B replaces A only when both its median and
   its fastest step beat A's by more than ``AB_MARGIN`` (3 %): within noise the model decides.
   The winner stays for the rest of the run.

Every decision is a function of all-reduced numbers only, so every rank reaches the same plan; a
crc of the plan is then checked with one all-reduce (a divergent plan would deadlock the next
collective): on a mismatch every rank takes rank 0's plan and the report says so.
"""

from __future__ import annotations

import bisect
import json
import math
import statistics
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from scaleout.comm import ALGORITHMS, Algorithm
from scaleout.comm.collective import Collective
from scaleout.comm.rowcol import GridAlgorithm
from scaleout.errors import UserError
from scaleout.parallel.buckets import MiB, assign
from scaleout.sim.calibrate import Fit, Sample, fit
from scaleout.sim.cluster import get_cluster
from scaleout.sim.step import stream_pipeline

if TYPE_CHECKING:
    from scaleout.config.schema import CommConfig
    from scaleout.parallel.data_parallel import DataParallel
    from scaleout.world import World

PROBE_BYTES = (128 << 10, 512 << 10, 2 << 20, 8 << 20, 32 << 20)  # fp32 all-reduce sizes
PROBE_REPEATS = 3  # timed calls per (algorithm, size), after one untimed
PROBE_BUDGET_S = 6.0  # the next size is skipped when it would end the probe past this
GROWTH = 4.0  # the next probe size's time / this one's (bandwidth-bound: its bytes ratio)
PROFILE_STEP = 2  # step 1 warms up (allocator, the reducer's re-bucketing by ready order)
AB_STEPS = 3  # training steps per plan of the A/B, in A B B A A B order (drift hits both alike)
# B replaces the predicted best A only when both its median and its fastest step beat A's by more
# than this: on a shared machine one step is noise (measured: single steps 15 % apart at load 8 on
# 2 cores); within noise the model, fitted on the probe's many calls, decides
AB_MARGIN = 0.03
BUCKET_MB = (1.0, 2.0, 4.0, 8.0, 16.0, 25.0, 50.0)
FIRST_BUCKET_MB = (None, 1.0)  # None: as bucket_mb; 1 MiB: torch DDP's first bucket
CHUNK_MB = (None, 1.0, 16.0)  # row x column algorithms' gloo pipeline chunk (None: 4 MiB)
WIRES = ("none", "bf16")
# the keys of the comm section auto chooses, unless the config sets them
TUNED_KEYS = ("bucket_mb", "first_bucket_mb", "chunk_mb", "compression")


@dataclass(frozen=True)
class CommPlan:
    """One point of the search space: what ``DataParallel.set_plan`` takes."""

    algorithm: str
    bucket_mb: float
    first_bucket_mb: float | None = None
    chunk_mb: float | None = None
    compression: str = "none"

    def label(self) -> str:
        parts = [self.algorithm, f"bucket {self.bucket_mb:g} MiB"]
        if self.first_bucket_mb is not None:
            parts.append(f"first {self.first_bucket_mb:g} MiB")
        if self.chunk_mb is not None:
            parts.append(f"chunk {self.chunk_mb:g} MiB")
        if self.compression != "none":
            parts.append(f"wire {self.compression}")
        return ", ".join(parts)

    def collective(self, comm: CommConfig, world: World) -> Collective:
        """The algorithm resolved for ``world`` (groups prepared) with the config's options (e.g.
        ``comm.torus_x``) and the chunk this plan sets."""
        alg = ALGORITHMS.get(self.algorithm)
        opts = comm.options(self.algorithm)
        if self.chunk_mb is not None and "chunk_bytes" in alg.Options.model_fields:
            opts = opts.model_copy(update={"chunk_bytes": max(1, int(self.chunk_mb * MiB))})
        return Collective(alg, world, opts)

    def crc(self) -> int:
        """24 bits: exact in the float all-reduce that checks every rank holds the same plan."""
        return zlib.crc32(json.dumps(asdict(self), sort_keys=True).encode()) & 0xFFFFFF

    def apply(self, dp: DataParallel, comm: CommConfig) -> None:
        dp.set_plan(
            self.collective(comm, dp.world), self.bucket_mb, self.first_bucket_mb, self.compression
        )


def _fields(algorithm: str) -> set[str]:
    return set(ALGORITHMS.get(algorithm).Options.model_fields)


@dataclass(frozen=True)
class Space:
    """The candidates' values per knob; a knob the config sets has its one value."""

    algorithms: tuple[str, ...]
    bucket_mb: tuple[float, ...] = BUCKET_MB
    first_bucket_mb: tuple[float | None, ...] = FIRST_BUCKET_MB
    chunk_mb: tuple[float | None, ...] = CHUNK_MB
    wires: tuple[str, ...] = WIRES

    @classmethod
    def from_config(cls, comm: CommConfig, algorithms: Sequence[str], **given: Any) -> Space:
        """The config's value for each of ``TUNED_KEYS`` it sets (pydantic's
        ``model_fields_set``), the defaults above (or ``given``) for the others."""
        fixed = {k: (getattr(comm, k),) for k in TUNED_KEYS if k in comm.model_fields_set}
        if "compression" in fixed:
            fixed["wires"] = fixed.pop("compression")
        return cls(tuple(algorithms), **{**given, **fixed})

    def plans(self) -> list[CommPlan]:
        out = []
        for alg in self.algorithms:
            chunks = self.chunk_mb if "chunk_bytes" in _fields(alg) else (None,)
            for mb in self.bucket_mb:
                firsts = [f for f in self.first_bucket_mb if f is None or f < mb]
                for first in firsts or [None]:
                    for chunk in chunks:
                        for wire in self.wires:
                            out.append(CommPlan(alg, mb, first, chunk, wire))
        return out


def probe_algorithms(world: World, comm: CommConfig) -> list[str]:
    """The registered algorithms that can run on ``world`` (their ``check`` passes; row x
    column ones need a uniform world) and have a cost model, one per row x column schedule."""
    names, rows = [], set()
    per_node = world.local_size if world.uniform else None
    for name, alg in ALGORITHMS.items():
        if type(alg).cost is Algorithm.cost:  # the simulator cannot price it
            continue
        opts = comm.options(name)
        try:
            alg.check(opts, world.world_size, per_node)
        except UserError:
            continue
        if isinstance(alg, GridAlgorithm):
            if per_node is None:
                continue
            try:
                x = alg.row_length(opts, world.world_size, per_node)
            except UserError:
                continue
            if x in rows:  # the same reduce-scatter / all-reduce / all-gather groups
                continue
            rows.add(x)
        names.append(name)
    return names


def _reduce_max(world: World, values: Sequence[float]) -> list[float]:
    t = torch.tensor(list(values), dtype=torch.float64, device=world.device)
    if world.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _sync(world: World) -> None:
    if world.device.type == "cuda":
        torch.cuda.synchronize(world.device)


# -- 1. the probe -------------------------------------------------------------------------------
# A test's skew: (algorithm, bytes, wire) -> the factor this rank's own times are multiplied by
Skew = Callable[[str, int, str], float]


@dataclass
class Probe:
    rows: list[dict[str, Any]]  # all-reduced: the slowest rank of each repeat
    local: list[dict[str, Any]]  # this rank's own times
    cast_s_per_byte: float  # the bf16 wire's cast out and back, per fp32 byte (slowest rank)
    seconds: float  # the probe's wall time (slowest rank)
    nnodes: int
    nproc_per_node: int
    backend: str


def _time_all_reduce(
    world: World, buf: torch.Tensor, collective: Collective, repeats: int
) -> list[float]:
    out = []
    for i in range(repeats + 1):  # the first call untimed: buffers, warm-up
        world.barrier()
        t = time.perf_counter()
        collective.all_reduce(buf, op="sum")
        _sync(world)
        if i:
            out.append(time.perf_counter() - t)
    return out


def _time_cast(world: World, buf: torch.Tensor, repeats: int) -> float:
    """The reducer's bf16 wire round trip on ``buf``: divide + cast out, copy back."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        wire = buf.div(world.world_size).to(torch.bfloat16)
        buf.copy_(wire)
        _sync(world)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def probe(
    world: World,
    comm: CommConfig,
    algorithms: Sequence[str],
    wires: Sequence[str] = ("none",),
    *,
    sizes: Sequence[int] = PROBE_BYTES,
    repeats: int = PROBE_REPEATS,
    budget_s: float = PROBE_BUDGET_S,
    skew: Skew | None = None,
) -> Probe:
    """Time all-reduces of ``sizes`` (growing while the budget allows; at least two) with each
    algorithm on synthetic zeros, then the bf16 wire at the largest size if ``wires`` has it; one
    all-reduce (MAX) of every time makes the table every rank decides from."""
    start = time.perf_counter()
    local: list[dict[str, Any]] = []
    spent, done = 0.0, []
    for i, nbytes in enumerate(sizes):
        buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=world.device)
        for alg in algorithms:
            coll = CommPlan(alg, 1.0).collective(comm, world)  # as the reducer calls it
            local.append(_row(alg, nbytes, "none", _time_all_reduce(world, buf, coll, repeats)))
        done.append(nbytes)
        before, spent = spent, _reduce_max(world, [time.perf_counter() - start])[0]
        if i >= 1 and spent + GROWTH * (spent - before) > budget_s:
            break
    cast = 0.0
    if "bf16" in wires:
        n = done[-1] // 4
        buf = torch.zeros(n, dtype=torch.bfloat16, device=world.device)
        for alg in algorithms:
            coll = CommPlan(alg, 1.0).collective(comm, world)
            local.append(_row(alg, 2 * n, "bf16", _time_all_reduce(world, buf, coll, repeats)))
        cast = _time_cast(world, torch.zeros(n, device=world.device), repeats) / (4 * n)
    for row in local:
        factor = skew(row["algorithm"], row["nbytes"], row["wire"]) if skew else 1.0
        row["times"] = [t * factor for t in row["times"]]
        row["time_s"] = statistics.median(row["times"])
    flat = [t for row in local for t in row["times"]]
    reduced = _reduce_max(world, [*flat, cast, time.perf_counter() - start])
    rows, k = [], 0
    for row in local:
        times = reduced[k : k + len(row["times"])]
        k += len(row["times"])
        rows.append({**row, "times": times, "time_s": statistics.median(times)})
    nodes = world.num_nodes
    return Probe(
        rows,
        local,
        reduced[k],
        reduced[k + 1],
        nodes,
        world.world_size // max(nodes, 1),
        world.backend,
    )


def _row(algorithm: str, nbytes: int, wire: str, times: list[float]) -> dict[str, Any]:
    return {
        "algorithm": algorithm,
        "nbytes": nbytes,
        "wire": wire,
        "times": times,
        "time_s": statistics.median(times),
    }


# -- the cost model -------------------------------------------------------------------------------
@dataclass(frozen=True)
class CostModel:
    """Bucket all-reduce times: the fitted constants x the per-algorithm correction."""

    fit: Fit
    nnodes: int
    nproc_per_node: int
    # per algorithm: (log bytes, measured / fitted) at each probed fp32 size
    corrections: dict[str, tuple[tuple[float, float], ...]]
    bf16_ratio: dict[str, float]  # bf16 all-reduce time / fp32 time of as many elements
    cast_s_per_byte: float
    # (algorithm, bytes, chunk) -> seconds: the candidates share their buckets' sizes
    cache: dict[tuple[str, int, float | None], float] = field(
        default_factory=dict, compare=False, repr=False
    )

    def fitted_s(self, algorithm: str, nbytes: float, chunk_mb: float | None = None) -> float:
        chunk = max(1, int(chunk_mb * MiB)) if chunk_mb else None
        s = Sample(algorithm, int(nbytes), self.nnodes, self.nproc_per_node, 1.0, chunk_bytes=chunk)
        return max(self.fit.predict(s), 1e-9)

    def correction(self, algorithm: str, nbytes: float) -> float:
        points = self.corrections.get(algorithm)
        if not points:
            return 1.0
        x = math.log(max(nbytes, 1.0))
        xs = [p[0] for p in points]
        i = bisect.bisect_left(xs, x)
        if i == 0:
            return points[0][1]
        if i == len(points):
            return points[-1][1]
        (x0, r0), (x1, r1) = points[i - 1], points[i]
        return r0 + (r1 - r0) * (x - x0) / (x1 - x0)

    def all_reduce_s(self, algorithm: str, nbytes: float, chunk_mb: float | None = None) -> float:
        """One fp32 all-reduce of ``nbytes`` per rank."""
        key = (algorithm, int(nbytes), chunk_mb)
        t = self.cache.get(key)
        if t is None:
            t = self.fitted_s(algorithm, nbytes, chunk_mb) * self.correction(algorithm, nbytes)
            self.cache[key] = t
        return t

    def bucket_s(self, plan: CommPlan, nbytes: float) -> float:
        """One bucket of ``nbytes`` (fp32 gradients) as ``plan`` sends it."""
        t = self.all_reduce_s(plan.algorithm, nbytes, plan.chunk_mb)
        if plan.compression != "none":
            t = t * self.bf16_ratio.get(plan.algorithm, 0.5) + nbytes * self.cast_s_per_byte
        return t

    def describe(self) -> dict[str, Any]:
        return {
            "constants": self.fit.constants.describe(),
            "fit_rms": self.fit.train_rms,
            "corrections": {
                a: [[round(math.exp(x)), round(r, 4)] for x, r in pts]
                for a, pts in self.corrections.items()
            },
            "bf16_ratio": self.bf16_ratio,
        }


def cost_model(p: Probe) -> CostModel:
    """Fit the simulator's constants to the probe's fp32 rows (the emulated-cluster shape:
    one NIC per node, one stream per ring), then the corrections."""
    fp32 = [r for r in p.rows if r["wire"] == "none"]
    samples = [
        Sample(r["algorithm"], int(r["nbytes"]), p.nnodes, p.nproc_per_node, r["time_s"])
        for r in fp32
    ]
    prior = get_cluster("netns-1g" if p.backend == "gloo" else "dgx-h100")
    f = fit(samples, prior)
    partial = CostModel(f, p.nnodes, p.nproc_per_node, {}, {}, p.cast_s_per_byte)
    corrections: dict[str, list[tuple[float, float]]] = {}
    for r in fp32:
        ratio = r["time_s"] / partial.fitted_s(r["algorithm"], r["nbytes"])
        corrections.setdefault(r["algorithm"], []).append((math.log(r["nbytes"]), ratio))
    model = CostModel(
        f,
        p.nnodes,
        p.nproc_per_node,
        {a: tuple(sorted(pts)) for a, pts in corrections.items()},
        {},
        p.cast_s_per_byte,
    )
    bf16 = {
        r["algorithm"]: r["time_s"] / model.all_reduce_s(r["algorithm"], 2 * r["nbytes"])
        for r in p.rows
        if r["wire"] == "bf16"
    }
    return CostModel(f, p.nnodes, p.nproc_per_node, model.corrections, bf16, p.cast_s_per_byte)


# -- 2. the profile -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Profile:
    """One step's gradients in bucket-filling order, and when each became ready (slowest rank)."""

    nbytes: list[int]
    keys: list[str]  # dtype and device: buckets never mix them
    ready_s: list[float]  # after the start of backward
    backward_s: float
    step_s: float
    exposed_s: float
    extra_bytes: int  # the usage flags riding in the last bucket
    overlap: bool = True


def profile_from(dp: DataParallel, step_s: float) -> Profile:
    """The last step's ready times (``Reducer.record_ready`` was on), all-reduced (MAX)."""
    r, stats = dp.reducer, dp.last_stats
    ready = stats.get("ready_s")
    if ready is None:
        raise UserError("the gradient-ready profile needs a step with reducer.record_ready=True")
    slots = [s for b in r.buckets for s in b.slots]
    position = {s.index: k for k, s in enumerate(r.slots)}
    local = [ready[position[s.index]] for s in slots]
    local += [stats["backward_s"], step_s, stats["exposed_s"]]
    vec = _reduce_max(dp.world, local)
    n = len(slots)
    last = r.buckets[-1]
    return Profile(
        [s.numel * s.param.element_size() for s in slots],
        [f"{s.param.dtype}/{s.param.device}" for s in slots],
        vec[:n],
        vec[n],
        vec[n + 1],
        vec[n + 2],
        last.extra * last.buffer.element_size(),
        r.overlap,
    )


# -- 3. scoring -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scored:
    plan: CommPlan
    exposed_s: float  # predicted communication not hidden behind backward
    comm_s: float  # predicted communication in all
    buckets: int

    def step_s(self, profile: Profile) -> float:
        """The profiled step's compute with this plan's exposed communication."""
        return profile.step_s - profile.exposed_s + self.exposed_s


def layout(plan: CommPlan, profile: Profile) -> list[list[int]]:
    first = max(1, int(plan.first_bucket_mb * MiB)) if plan.first_bucket_mb else None
    return assign(profile.nbytes, profile.keys, max(1, int(plan.bucket_mb * MiB)), first)


def predict(plan: CommPlan, profile: Profile, model: CostModel) -> Scored:
    groups = layout(plan, profile)
    ready, cost = [], []
    for b, members in enumerate(groups):
        nbytes = sum(profile.nbytes[m] for m in members)
        nbytes += profile.extra_bytes if b == len(groups) - 1 else 0
        at = max(profile.ready_s[m] for m in members) if profile.overlap else profile.backward_s
        ready.append(at)
        cost.append(model.bucket_s(plan, nbytes))
    ready = list(accumulate(ready, max))  # launched strictly in bucket order
    end = stream_pipeline(0.0, ready, cost)
    return Scored(plan, max(0.0, end - profile.backward_s), sum(cost), len(groups))


def rank_plans(plans: Sequence[CommPlan], profile: Profile, model: CostModel) -> list[Scored]:
    """Best first: least predicted exposed communication, then least communication (CPU work
    competing with backward on gloo), then the candidates' order. Plans giving the same buckets
    with the same algorithm, chunk and wire are one candidate (the first)."""
    seen, out = set(), []
    for i, plan in enumerate(plans):
        groups = layout(plan, profile)
        key = (plan.algorithm, plan.chunk_mb, plan.compression, tuple(map(tuple, groups)))
        if key in seen:
            continue
        seen.add(key)
        out.append((i, predict(plan, profile, model)))
    out.sort(key=lambda t: (round(t[1].exposed_s, 6), round(t[1].comm_s, 6), t[0]))
    return [s for _, s in out]


def pick_pair(ranked: Sequence[Scored]) -> list[Scored]:
    """The best, and the best of another algorithm (the model's largest errors are between
    algorithms: different code paths), else the runner-up; one if there is one."""
    if len(ranked) < 2:
        return list(ranked)
    other = next((s for s in ranked[1:] if s.plan.algorithm != ranked[0].plan.algorithm), None)
    return [ranked[0], other or ranked[1]]


# -- 4. agreement ---------------------------------------------------------------------------------
def agree(world: World, plan: CommPlan) -> tuple[CommPlan, bool]:
    """``plan`` if every rank holds it; else rank 0's on every rank (and True: they diverged)."""
    if world.world_size == 1:
        return plan, False
    crc = float(plan.crc())
    hi, neg_lo = _reduce_max(world, [crc, -crc])
    if hi == -neg_lo:
        return plan, False
    box = [asdict(plan)]
    dist.broadcast_object_list(box, src=0)
    return CommPlan(**box[0]), True


# -- the runtime ----------------------------------------------------------------------------------
@dataclass
class AutoComm:
    """Drives one DataParallel through probe -> profile -> A/B -> the chosen plan. Call
    :meth:`start` before ``run_start`` and :meth:`after_step` after every training step, on
    every rank alike."""

    dp: DataParallel
    comm: CommConfig
    world: World
    space: Space | None = None
    # defaults read when built (a test sets the module's constants first)
    profile_step: int = field(default_factory=lambda: PROFILE_STEP)
    ab_steps: int = field(default_factory=lambda: AB_STEPS)
    budget_s: float = field(default_factory=lambda: PROBE_BUDGET_S)
    sizes: tuple[int, ...] = field(default_factory=lambda: PROBE_BYTES)
    repeats: int = field(default_factory=lambda: PROBE_REPEATS)
    skew: Skew | None = None
    probe_result: Probe | None = None
    model: CostModel | None = None
    profile: Profile | None = None
    ranked: list[Scored] = field(default_factory=list)
    pair: list[Scored] = field(default_factory=list)
    schedule: list[int] = field(default_factory=list)  # index into pair, per A/B step
    measured: dict[int, list[float]] = field(default_factory=dict)
    chosen: CommPlan | None = None
    diverged: bool = False
    steps: int = 0
    decided_at: int | None = None

    @property
    def done(self) -> bool:
        return self.chosen is not None

    def start(self) -> Probe:
        """The probe and the fit (before run_start: synthetic tensors only)."""
        algorithms = probe_algorithms(self.world, self.comm)
        if self.space is None:
            self.space = Space.from_config(self.comm, algorithms)
        wires = self.space.wires if self._fp32() else ("none",)
        self.space = Space(
            self.space.algorithms,
            self.space.bucket_mb,
            self.space.first_bucket_mb,
            self.space.chunk_mb,
            tuple(wires),
        )
        self.probe_result = probe(
            self.world,
            self.comm,
            self.space.algorithms,
            wires,
            sizes=self.sizes,
            repeats=self.repeats,
            budget_s=self.budget_s,
            skew=self.skew,
        )
        self.model = cost_model(self.probe_result)
        if self.profile_step <= 1:
            self.dp.reducer.record_ready = True
        return self.probe_result

    def _fp32(self) -> bool:
        return all(b.buffer.dtype == torch.float32 for b in self.dp.reducer.buckets)

    def after_step(self, step_s: float) -> CommPlan | None:
        """Returns the chosen plan at the step it is decided, else None."""
        if self.done or self.model is None:
            return None
        self.steps += 1
        if self.steps == self.profile_step - 1:
            self.dp.reducer.record_ready = True
            return None
        if self.steps == self.profile_step:
            self.dp.reducer.record_ready = False
            self.profile = profile_from(self.dp, step_s)
            assert self.space is not None
            self.ranked = rank_plans(self.space.plans(), self.profile, self.model)
            self.pair = pick_pair(self.ranked)
            if len(self.pair) < 2 or self.ab_steps < 1:
                return self._decide(0)
            self.schedule = [(0, 1, 1, 0)[i % 4] for i in range(2 * self.ab_steps)]
            self.pair[0].plan.apply(self.dp, self.comm)
            return None
        if self.steps > self.profile_step:
            k = self.steps - self.profile_step - 1  # the A/B step just taken
            measured = _reduce_max(self.world, [step_s])[0]
            self.measured.setdefault(self.schedule[k], []).append(measured)
            if k + 1 < len(self.schedule):
                if self.schedule[k + 1] != self.schedule[k]:
                    self.pair[self.schedule[k + 1]].plan.apply(self.dp, self.comm)
                return None
            ts = [self.measured.get(i, [math.inf]) for i in (0, 1)]
            better = all(f(ts[1]) < f(ts[0]) * (1 - AB_MARGIN) for f in (min, statistics.median))
            return self._decide(1 if better else 0)
        return None

    def _decide(self, index: int) -> CommPlan:
        plan, self.diverged = agree(self.world, self.pair[index].plan)
        self.chosen = plan
        self.decided_at = self.steps
        plan.apply(self.dp, self.comm)
        return plan

    def summary(self) -> dict[str, Any]:
        """The decision for report.json (``comm_auto``) and the MLPerf log."""
        p, prof = self.probe_result, self.profile
        out: dict[str, Any] = {"chosen": None, "decided_after_step": self.decided_at}
        if p is not None:
            out["probe"] = {
                "seconds": p.seconds,
                "algorithms": list(self.space.algorithms) if self.space else [],
                "rows": [
                    {k: r[k] for k in ("algorithm", "nbytes", "wire", "time_s")} for r in p.rows
                ],
                "cast_s_per_byte": p.cast_s_per_byte,
            }
        if self.model is not None:
            out["model"] = self.model.describe()
        if prof is not None:
            out["profile"] = {
                "step": self.profile_step,
                "gradients": len(prof.nbytes),
                "bytes": sum(prof.nbytes),
                "backward_s": prof.backward_s,
                "step_s": prof.step_s,
                "exposed_s": prof.exposed_s,
            }
            out["candidates"] = len(self.ranked)
            out["ranked"] = [self._scored(s, prof) for s in self.ranked[:5]]
            out["ab"] = [
                {
                    **self._scored(s, prof),
                    "measured_step_s": self.measured.get(i, []),
                    "measured_median_s": statistics.median(self.measured[i])
                    if self.measured.get(i)
                    else None,
                    "measured_fastest_s": min(self.measured[i]) if self.measured.get(i) else None,
                }
                for i, s in enumerate(self.pair)
            ]
        if self.chosen is not None:
            out["chosen"] = {**asdict(self.chosen), "label": self.chosen.label()}
            out["diverged"] = self.diverged
            mine = next((a for a in out.get("ab", []) if a["label"] == self.chosen.label()), None)
            if mine is not None:
                out["predicted_step_s"] = mine["predicted_step_s"]
                out["measured_step_s"] = mine["measured_median_s"]
        return out

    @staticmethod
    def _scored(s: Scored, prof: Profile) -> dict[str, Any]:
        return {
            "label": s.plan.label(),
            "plan": asdict(s.plan),
            "buckets": s.buckets,
            "predicted_exposed_s": s.exposed_s,
            "predicted_comm_s": s.comm_s,
            "predicted_step_s": s.step_s(prof),
        }
