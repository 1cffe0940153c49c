"""Samples to converge as a function of the global batch: MLCommons' RCPs, or the user's own runs.

Two sources of the curve ``samples(B)``:

- **RCPs** (``rcp_curve``): the reference convergence points MLCommons ships inside the installed
  ``mlperf-logging`` package (``mlperf_logging/rcp_checker/training_<ruleset>/rcps_<bench>.json``),
  read at run time. Each record is one batch size B and the samples (BERT) or epochs (ResNet; x
  1,281,167 ImageNet images) of 10-20+ reference runs to the target. The statistics are the
  checker's own (``rcp_checker.RCP_Checker``, reproduced here without its scipy import): the
  olympic mean (the fastest and the slowest run dropped) per record, then the pruning that keeps
  the fastest-converging frontier (records at batches below the fastest-converging one are
  dropped, then every record slower than the line through its two neighbours, repeatedly).
  Between the kept batches the curve is **linear in B**, the interpolation MLCommons uses for a
  submission at a batch without an RCP (``_create_interp_rcp``: ``np.interp`` on the batch);
  below the smallest kept batch it is flat (small batches need no fewer samples than that
  record), above the largest it continues the last segment and says so (``extrapolated``).
- **A fit** (``fit_curve``) to (batch, samples-to-target) points, e.g. from
  ``scaleout bench largebatch --out`` JSON (``largebatch_points``): the critical-batch model of
  McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", arXiv 1812.06162, eq. 2.11)
  ``samples(B) = E_min x (1 + B / B_crit)``, linear in B, fitted by least squares; ``E_min`` is
  the samples a tiny batch needs, ``B_crit`` the batch at which samples have doubled. Steps to
  converge ``samples / B`` then fall as ``S_min x (1 + B_crit / B)``: perfect scaling far below
  B_crit, none far above it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scaleout.errors import ConfigError
from scaleout.families import FAMILIES

DEFAULT_RULESET = "2.0.0"  # the MLPerf Training round of the v2.0 A100 runs in scaleout.sim.mlperf
# Unit of "Epochs to converge" in each RCP table, in samples.
# An epoch is the family's training set (Family.train_samples: ImageNet-1k for ResNet); BERT's RCPs
# count samples.
RCP_UNITS = {
    fam.benchmark: float(fam.train_samples or 1) for _, fam in FAMILIES.items() if fam.benchmark
}
MODEL_BENCHMARK = {"bert-large": "bert", "resnet50": "resnet", "llama31-8b": "llama31_8b"}
# Benchmarks younger than DEFAULT_RULESET: the round whose RCP table they are read from
RCP_RULESET = {"llama31_8b": "6.1.0"}


@dataclass(frozen=True)
class RcpRecord:
    name: str
    batch: int
    runs: list[float]  # samples to converge of each reference run
    mean: float  # olympic mean, as rcp_checker's "RCP Mean"


@dataclass(frozen=True)
class ConvergenceCurve:
    """samples(B) through ``points`` (batch, samples), linear in B between them."""

    points: tuple[tuple[float, float], ...]
    source: str
    # set for a fit: samples(B) = e_min * (1 + B / b_crit) instead of the interpolation
    e_min: float | None = None
    b_crit: float | None = None
    notes: list[str] = field(default_factory=list)

    def samples(self, batch: float) -> float:
        if batch <= 0:
            raise ConfigError(f"global batch must be > 0, got {batch}")
        if self.e_min is not None:
            return self.e_min * (1 + batch / self.b_crit) if self.b_crit else self.e_min
        pts = self.points
        if batch <= pts[0][0] or len(pts) == 1:
            return pts[0][1] if batch <= pts[0][0] else pts[-1][1]
        for (b0, s0), (b1, s1) in zip(pts, pts[1:], strict=False):
            if batch <= b1:
                return s0 + (s1 - s0) * (batch - b0) / (b1 - b0)
        (b0, s0), (b1, s1) = pts[-2], pts[-1]
        return s1 + (s1 - s0) * (batch - b1) / (b1 - b0)

    def extrapolated(self, batch: float) -> bool:
        """True above the largest batch the curve has a point for."""
        return batch > self.points[-1][0] * (1 + 1e-9)

    def describe(self) -> str:
        if self.e_min is not None:
            crit = f"{self.b_crit:.4g}" if self.b_crit else "inf"
            return f"{self.source}: samples(B) = {self.e_min:.4g} x (1 + B / {crit})"
        return f"{self.source}: {len(self.points)} points, linear in B between them"


def rcp_dir(ruleset: str = DEFAULT_RULESET) -> Path:
    """The installed mlperf-logging package's RCP folder for ``ruleset`` (not imported)."""
    spec = importlib.util.find_spec("mlperf_logging")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the RCP tables come from the mlperf-logging package, which is not installed "
            "(pip install mlperf-logging)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "rcp_checker" / f"training_{ruleset}"
    if not path.is_dir():
        raise ConfigError(f"mlperf-logging has no RCPs for training ruleset {ruleset!r} ({path})")
    return path


def _olympic_mean(values: list[float]) -> float:
    v = sorted(values)
    return statistics.fmean(v[1:-1] if len(v) > 2 else v)


def load_rcps(benchmark: str, ruleset: str = DEFAULT_RULESET) -> list[RcpRecord]:
    """Every RCP record of ``benchmark`` (bert, resnet), in samples, sorted by batch."""
    if benchmark not in RCP_UNITS:
        raise ConfigError(
            f"no RCP units known for benchmark {benchmark!r}; "
            f"expected one of {', '.join(RCP_UNITS)}"
        )
    path = rcp_dir(ruleset) / f"rcps_{benchmark}.json"
    if not path.is_file():
        raise ConfigError(f"mlperf-logging ruleset {ruleset} has no RCPs for {benchmark} ({path})")
    raw: dict[str, Any] = json.loads(path.read_text())
    unit = RCP_UNITS[benchmark]
    out = []
    for name, rec in raw.items():
        runs = [float(x) * unit for x in rec["Epochs to converge"]]
        out.append(RcpRecord(name, int(rec["BS"]), runs, _olympic_mean(runs)))
    return sorted(out, key=lambda r: r.batch)


def prune(records: list[RcpRecord]) -> list[RcpRecord]:
    """rcp_checker's ``_prune_rcps``: the fastest-converging frontier the checker compares with."""
    fastest = min(records, key=lambda r: r.mean)
    kept = [r for r in records if r.batch >= fastest.batch]
    i = 1
    while i < len(kept) - 1:
        lo, mid, hi = kept[i - 1], kept[i], kept[i + 1]
        line = lo.mean + (hi.mean - lo.mean) * (mid.batch - lo.batch) / (hi.batch - lo.batch)
        if mid.mean > line:
            del kept[i]
            i -= 1
        i += 1
    return kept


def rcp_curve(benchmark: str, ruleset: str = DEFAULT_RULESET) -> ConvergenceCurve:
    """samples(B) from the pruned RCPs of ``benchmark`` in the installed mlperf-logging."""
    kept = prune(load_rcps(benchmark, ruleset))
    return ConvergenceCurve(
        tuple((float(r.batch), r.mean) for r in kept),
        f"MLCommons RCPs training_{ruleset}/rcps_{benchmark}.json (mlperf-logging, pruned)",
    )


def config_curve(cfg: Any, ruleset: str = DEFAULT_RULESET) -> ConvergenceCurve | None:
    """Samples to the target of the run ``cfg`` describes vs its global batch, in the config's
    own units: its family's pruned RCPs with MLPerf's batches turned into the config's (a packed
    BERT row holds ``sequences_per_sample`` sequences, as ``scaleout plan`` counts them). None
    where there is no such curve (no target, no MLPerf benchmark, no RCPs in this ruleset)."""
    fam = cfg.model.family
    if cfg.train.target is None or not fam.benchmark or fam.benchmark not in RCP_UNITS:
        return None
    try:
        curve = rcp_curve(fam.benchmark, RCP_RULESET.get(fam.benchmark, ruleset))
    except ConfigError:
        return None  # this ruleset has no RCPs for it
    rate = max(1, round(fam.sequences_per_sample(cfg)))
    points = tuple((b / rate, s / rate) for b, s in curve.points)
    unit = f", {rate} sequences per row" if rate > 1 else ""
    return ConvergenceCurve(points, f"{curve.source} in the config's units{unit}")


def fit_curve(points: list[tuple[float, float]], source: str = "fit") -> ConvergenceCurve:
    """Least-squares ``samples = E_min (1 + B / B_crit)`` through (batch, samples) points.

    Needs two distinct batches. If samples do not grow with the batch over the measured range
    (slope <= 0), B_crit is infinite: samples stay at their mean (perfect scaling)."""
    pts = sorted((float(b), float(s)) for b, s in points)
    for b, s in pts:
        if b <= 0 or s <= 0:
            raise ConfigError(f"batch and samples must be > 0, got ({b:g}, {s:g})")
    if len({b for b, _ in pts}) < 2:
        raise ConfigError(
            f"a fit of samples(batch) needs runs at two or more batch sizes, got {len(pts)} "
            f"point(s) at batch {', '.join(sorted({f'{b:g}' for b, _ in pts}))}"
        )
    n = len(pts)
    mb = sum(b for b, _ in pts) / n
    ms = sum(s for _, s in pts) / n
    slope = sum((b - mb) * (s - ms) for b, s in pts) / sum((b - mb) ** 2 for b, _ in pts)
    notes = []
    if slope <= 0:
        e_min, b_crit = ms, None
        notes.append("samples do not grow with the batch over the measured range: B_crit = inf")
    else:
        e_min = ms - slope * mb
        if e_min <= 0:  # samples grow faster than linearly: no positive E_min; pin it at the data
            e_min = min(s for _, s in pts) / 2
            slope = sum(b * (s - e_min) for b, s in pts) / sum(b * b for b, _ in pts)
            notes.append("intercept <= 0: E_min pinned at half the smallest measured samples")
        b_crit = e_min / slope
    curve = ConvergenceCurve(tuple(pts), source, e_min=e_min, b_crit=b_crit, notes=notes)
    return curve


def largebatch_points(
    path: str | Path, optimizer: str = "lamb"
) -> tuple[list[tuple[float, float]], list[str]]:
    """(global batch, samples to the target) of ``scaleout bench largebatch --out`` JSON.

    One point per batch: the median over seeds of steps x batch of the ``optimizer`` runs that
    reached the target (runs that did not are left out and listed in the notes)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read bench largebatch JSON {p}: {e}") from None
    if data.get("bench") != "largebatch" or not isinstance(data.get("runs"), list):
        raise ConfigError(
            f"{p} is not `scaleout bench largebatch --out` JSON (expected bench=largebatch, runs)"
        )
    by_batch: dict[float, list[float]] = {}
    notes = []
    for r in data["runs"]:
        if r.get("optimizer") != optimizer:
            continue
        if r.get("steps") is None:
            notes.append(
                f"{optimizer} batch {r['batch']} seed {r.get('seed')}: target not reached within "
                f"{r.get('max_steps')} steps, left out"
            )
            continue
        by_batch.setdefault(float(r["batch"]), []).append(float(r["steps"]) * float(r["batch"]))
        near = plateau(r.get("curve") or [], data.get("target"), r["steps"])
        if near is not None:
            notes.append(
                f"{optimizer} batch {r['batch']} seed {r.get('seed')}: the target "
                f"{data['target']} sits on a plateau (within {PLATEAU_MARGIN:.0%} of it at step "
                f"{near}, crossed at step {r['steps']}): the step that crosses it is noise, not "
                "a function of the batch; fit to a target on the steep part of the curve"
            )
    points = [(b, statistics.median(s)) for b, s in sorted(by_batch.items())]
    return points, notes


# A run that came within this share of its target and then needed this factor more steps to
# cross it was on a plateau (the tiny BERT at 0.15: 0.148 at step 600, crossed at 1,600).
PLATEAU_MARGIN = 0.02
PLATEAU_FACTOR = 1.5


def plateau(curve: list[Any], target: Any, steps: Any) -> int | None:
    """The first evaluated step at which a run (``curve``: [step, samples, metric], a metric that
    rises to ``target``) came within :data:`PLATEAU_MARGIN` of the target, when it then took
    :data:`PLATEAU_FACTOR` x as many steps to cross it; else None."""
    if not isinstance(target, (int, float)) or not steps or target <= 0:
        return None
    for step, _, metric in curve:
        if metric is not None and metric >= target * (1 - PLATEAU_MARGIN):
            return int(step) if steps >= PLATEAU_FACTOR * step else None
    return None


def curve_for(
    model_name: str, source: str | None, ruleset: str = DEFAULT_RULESET
) -> ConvergenceCurve | None:
    """The curve ``sim.convergence`` names: ``rcp`` (the model's MLPerf benchmark), a bench
    largebatch JSON file, or ``fixed``/None (no curve: the preset's samples at every batch)."""
    if source in (None, "", "fixed"):
        return None
    if source == "rcp":
        bench = MODEL_BENCHMARK.get(model_name)
        if bench is None:
            raise ConfigError(
                f"sim.convergence=rcp: no MLPerf RCPs for model {model_name!r}; expected one of "
                f"{', '.join(MODEL_BENCHMARK)} (or give a bench largebatch JSON)"
            )
        return rcp_curve(bench, RCP_RULESET.get(bench, ruleset))
    points, notes = largebatch_points(source)
    curve = fit_curve(points, f"fit to {source}")
    return ConvergenceCurve(
        curve.points, curve.source, curve.e_min, curve.b_crit, notes + curve.notes
    )


def fit_table(curve: ConvergenceCurve) -> list[list[Any]]:
    """Rows (batch, measured samples, fitted samples, error) that show a fit against its data."""
    rows = []
    for b, s in curve.points:
        f = curve.samples(b)
        rows.append([f"{b:g}", f"{s:.4g}", f"{f:.4g}", f"{f / s - 1:+.1%}"])
    return rows


def steps_to_converge(curve: ConvergenceCurve, batch: float) -> int:
    return math.ceil(curve.samples(batch) / batch - 1e-9)
