"""Fit the cost model's constants to measured all-reduce times and check predictions on held-out
data.

Input: a list of measurements, one per (algorithm, size, shape). The schema (JSON: a list, or an
object with a ``rows``/``results`` list; this is what ``scaleout bench allreduce --out`` writes):

    {"algorithm": a name in scaleout.comm.ALGORITHMS, or a simulator-only model ("tree", "leader"),
                                 # ("base_algorithm" wins when present: bench labels carry options)
     "nbytes": int,              # bytes per rank (also accepted: "bytes", "size_bytes")
     "nnodes": int, "nproc_per_node": int,
     "time_s": float,            # median seconds (also: "median_s", "median_time_s", "time")
     "times": [float, ...],      # optional: every timed run; stat="min" fits the least-disturbed
     one
     "link_rate_bps": float,     # optional: inter-node rate limit in bit/s (also: "rate_bps",
     "rate",
                                 #   a tc string like "1gbit": scaleout.units); rows at other rates
                                 #   scale beta_inter
     "options": {"x": int, "chunk_bytes": int,    # optional: torus grid x, grid pipeline chunk,
                 "composition": "sharded" | "leader"}}   # leader rows are fitted as the "leader"
                 model

Fit: theta >= 0 minimising sum((predicted / measured - 1)^2) (relative error, so 4 KB and 64 MB rows
count alike), by non-negative least squares on the plan coefficients; the lock-step maxima are
re-resolved with the new theta and the fit repeated until they stop changing. Constants that no
training row exercises (e.g. beta_inter when every row is single-node) keep their prior value.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import nnls

from scaleout.errors import ConfigError
from scaleout.sim.cluster import PARAMS, Cluster, Constants, get_cluster
from scaleout.sim.collectives import canonical, plan_for
from scaleout.units import parse_rate

_BETA_INTER = PARAMS.index("beta_inter")


@dataclass(frozen=True)
class Sample:
    algorithm: str
    nbytes: int
    nnodes: int
    nproc_per_node: int
    time_s: float
    link_rate_bps: float | None = None
    torus_x: int | None = None
    chunk_bytes: int | None = None

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


_ALIASES = {
    "nbytes": ("nbytes", "bytes", "size_bytes", "size"),
    "time_s": ("time_s", "median_s", "median_time_s", "time", "seconds", "median"),
    "link_rate_bps": ("link_rate_bps", "rate_bps", "rate", "rate_limit", "link_rate"),
    "nnodes": ("nnodes", "nodes", "num_nodes"),
    "nproc_per_node": ("nproc_per_node", "ranks_per_node", "local_size", "gpus_per_node"),
}


def _get(row: dict[str, Any], key: str, index: int, required: bool = True) -> Any:
    for k in _ALIASES.get(key, (key,)):
        if k in row and row[k] is not None:
            return row[k]
    if required:
        raise ConfigError(
            f"measurement row {index} has no {key!r} (or {', '.join(_ALIASES.get(key, ()))}): {row}"
        )
    return None


STATS = ("median", "min")


def samples_from_rows(rows: Iterable[dict[str, Any]], stat: str = "median") -> list[Sample]:
    """Rows of the schema above. ``stat="min"``: the fastest of ``times`` where a row has them (on a
    shared machine the minimum is the run least disturbed by other jobs)."""
    if stat not in STATS:
        raise ConfigError(f"statistic {stat!r}: expected one of {', '.join(STATS)}")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ConfigError(f"measurement row {i} is {type(row).__name__}, expected an object")
        times = row.get("times")
        if stat == "min" and isinstance(times, list) and times:
            t = float(min(times))
        else:
            t = float(_get(row, "time_s", i))
        if t <= 0:
            raise ConfigError(f"measurement row {i} has time {t}, expected > 0 seconds")
        opts = row.get("options") or {}
        if not isinstance(opts, dict):
            raise ConfigError(f"measurement row {i} has options {opts!r}, expected an object")
        alg = row.get("base_algorithm") or _get(row, "algorithm", i)
        if opts.get("composition") == "leader":  # scaleout.comm.grid's leader composition on gloo
            alg = "leader"  # modelled unpipelined: an upper bound for the chunked schedule
        out.append(
            Sample(
                canonical(str(alg)),
                int(_get(row, "nbytes", i)),
                int(_get(row, "nnodes", i)),
                int(_get(row, "nproc_per_node", i)),
                t,
                parse_rate(_get(row, "link_rate_bps", i, False), f"measurement row {i} rate"),
                int(opts["x"]) if opts.get("x") else None,
                int(opts["chunk_bytes"]) if opts.get("chunk_bytes") else None,
            )
        )
    if not out:
        raise ConfigError("no measurements to fit (empty rows)")
    return out


def load_samples(path: str | Path, stat: str = "median", min_bytes: int = 0) -> list[Sample]:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"benchmark file {str(p)!r} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"benchmark file {str(p)!r} is not JSON ({exc.msg} at line {exc.lineno})"
        ) from None
    if isinstance(data, dict):
        data = data.get("rows") or data.get("results") or data.get("measurements")
    if not isinstance(data, list):
        raise ConfigError(
            f"benchmark file {str(p)!r}: expected a list of rows or an object with 'rows'"
        )
    samples = [s for s in samples_from_rows(data, stat) if s.nbytes >= min_bytes]
    if not samples:
        raise ConfigError(f"benchmark file {str(p)!r}: no rows of at least {min_bytes} bytes")
    return samples


def _cluster_for(s: Sample, prior: Cluster) -> Cluster:
    # The emulated cluster: one NIC per node, one stream per gloo ring.
    return replace(prior, gpus_per_node=s.nproc_per_node, nics_per_node=1, streams_per_ring=1)


def _row(s: Sample, prior: Cluster, theta: np.ndarray, ref_rate: float | None) -> np.ndarray:
    coeffs = plan_for(
        s.algorithm,
        _cluster_for(s, prior),
        s.nnodes,
        s.nbytes,
        torus_x=s.torus_x,
        chunk_bytes=s.chunk_bytes,
    ).linearize(theta)
    if ref_rate and s.link_rate_bps:
        # beta_inter is fitted at the reference rate
        coeffs[_BETA_INTER] *= ref_rate / s.link_rate_bps
    return coeffs


def reference_rate(samples: list[Sample]) -> float | None:
    rates = [s.link_rate_bps for s in samples if s.link_rate_bps]
    return statistics.mode(rates) if rates else None


@dataclass(frozen=True)
class Fit:
    constants: Constants
    ref_rate: float | None
    prior: Cluster
    iterations: int
    train_rms: float

    def predict(self, s: Sample) -> float:
        theta = np.array(self.constants.vector())
        return float(_row(s, self.prior, theta, self.ref_rate) @ theta)


def fit(samples: list[Sample], prior: Cluster | None = None, max_iter: int = 20) -> Fit:
    """Non-negative least squares on relative error, re-resolving the lock-step maxima until
    stable."""
    prior = prior or get_cluster("netns-1g")
    ref = reference_rate(samples)
    theta = np.array(prior.constants.vector())
    t = np.array([s.time_s for s in samples])
    it = 0
    while it < max_iter:
        it += 1
        a = np.array([_row(s, prior, theta, ref) for s in samples]) / t[:, None]
        used = np.abs(a).sum(axis=0) > 0
        fixed = np.where(used, 0.0, theta)  # unexercised constants keep the prior
        b = 1.0 - a @ fixed
        # column scaling: s/B and s differ by 1e9
        scale = np.where(used, np.abs(a).max(axis=0), 1.0)
        sol, _ = nnls(a[:, used] / scale[used], b)
        new = fixed.copy()
        new[used] = sol / scale[used]
        converged = np.allclose(new, theta, rtol=1e-6, atol=0)
        theta = new
        if converged:
            break
    pred = np.array([_row(s, prior, theta, ref) @ theta for s in samples])
    rms = float(np.sqrt(np.mean((pred / t - 1) ** 2)))
    return Fit(Constants.from_vector(theta), ref, prior, it, rms)


@dataclass(frozen=True)
class Check:
    sample: Sample
    predicted: float
    trained_on: bool

    @property
    def error(self) -> float:
        return self.predicted / self.sample.time_s - 1


def split_default(
    samples: list[Sample], holdout_algorithms: Iterable[str] = (), every: int = 2
) -> Callable[[Sample], bool]:
    """Train on every ``every``-th size (sorted) of the algorithms not held out; test on the
    rest."""
    held = {canonical(a) for a in holdout_algorithms}
    sizes = sorted({s.nbytes for s in samples})
    train_sizes = set(sizes[::every])
    return lambda s: s.algorithm not in held and s.nbytes in train_sizes


def cross_validate(
    samples: list[Sample], is_train: Callable[[Sample], bool], prior: Cluster | None = None
) -> tuple[Fit, list[Check]]:
    train = [s for s in samples if is_train(s)]
    if not train:
        raise ConfigError("the training split is empty: hold out fewer algorithms or sizes")
    f = fit(train, prior)
    return f, [Check(s, f.predict(s), is_train(s)) for s in samples]
