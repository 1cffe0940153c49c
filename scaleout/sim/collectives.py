"""Alpha-beta-gamma cost of ring, tree, hierarchical and 2D-torus all-reduce on a cluster.

Every algorithm is written as a :class:`Plan`: a sum of terms ``mult * max(option . theta)`` where theta
is the constants vector (``scaleout.sim.cluster.PARAMS``) and each option is a coefficient vector. The
max expresses lock-step phases (a ring step lasts as long as its slowest hop; pipelined stages run at the
pace of the slowest stage). Fixing which option wins makes the cost linear in theta, which is what lets
:mod:`scaleout.sim.calibrate` fit the constants with non-negative least squares.

Algorithms (p = g x k ranks, g per node, k nodes, n bytes per rank):

- ``ring`` (alias ``flat``): one ring over all p ranks, 2(p-1) steps of n/p bytes (Patarasuk & Yuan
  2009). Each step is paced by its slowest hop: a node-crossing hop when k > 1. Bytes crossing each node
  boundary: 2(p-1)/p * n, spread over the NICs a ring can drive (NCCL channels; gloo: one socket).
- ``tree``: NCCL's double binary tree between nodes (Sanders, Speck & Traeff 2009; NCCL 2.4): a chain
  inside the node, 2 ceil(log2 k) network steps of latency instead of 2(p-1); each node still sends and
  receives 2n bytes, pipelined, so the bandwidth term is ~2n / node bandwidth.
- ``hierarchical``: leader based (Horovod #329 "NCCL reduce, MPI allreduce, NCCL broadcast"; our
  scaleout collective): binomial reduce to the node leader, ring all-reduce of the full n among the k
  leaders (one process -> the NIC streams one process can drive), binomial broadcast. With ``chunks`` > 1
  the three stages are pipelined: sum of one chunk's stages + (chunks - 1) x the slowest stage.
- ``torus2d``: Sony's 2D torus (Mikami et al. 2018, arXiv 1811.05233) on an X x Y grid, X = ranks per
  node by default: reduce-scatter in rows, all-reduce of n/X in columns, all-gather in rows; 2(X-1) +
  2(Y-1) latency steps. With X = g every GPU drives its own NIC, which is NCCL-style hierarchical.

``cluster.backend == "gloo"`` swaps in what torch's CPU gloo primitives really cost (measured here):
reduce and reduce_scatter cost a full all-reduce, list all_gather adds a copy of the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from scaleout.errors import ConfigError, TopologyError
from scaleout.sim.cluster import PARAMS, Cluster

ALGORITHMS = ("ring", "tree", "hierarchical", "torus2d")
ALIASES = {"flat": "ring", "hier": "hierarchical", "torus": "torus2d", "2d-torus": "torus2d"}
_IDX = {k: i for i, k in enumerate(PARAMS)}
LATENCY = [_IDX["base"], _IDX["alpha_intra"], _IDX["alpha_inter"]]
BANDWIDTH = [_IDX["beta_intra"], _IDX["beta_inter"]]
REDUCTION = [_IDX["gamma"]]


def canonical(algorithm: str) -> str:
    name = ALIASES.get(algorithm.lower(), algorithm.lower())
    if name not in ALGORITHMS:
        raise ConfigError(
            f"unknown all-reduce algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)} (or flat)"
        )
    return name


def vec(**coeffs: float) -> np.ndarray:
    v = np.zeros(len(PARAMS))
    for k, c in coeffs.items():
        v[_IDX[k]] = c
    return v


@dataclass
class Plan:
    """sum(mult * max(option . theta)) over terms."""

    terms: list[tuple[float, list[np.ndarray]]] = field(default_factory=list)

    def add(self, mult: float, *options: np.ndarray) -> Plan:
        if mult > 0 and options:
            self.terms.append((float(mult), list(options)))
        return self

    def extend(self, other: Plan, scale: float = 1.0) -> Plan:
        for mult, opts in other.terms:
            self.terms.append((mult * scale, opts))
        return self

    def linearize(self, theta: np.ndarray) -> np.ndarray:
        """Coefficients of the cost with each max resolved at ``theta`` (cost = result . theta)."""
        total = np.zeros(len(PARAMS))
        for mult, opts in self.terms:
            best = max(opts, key=lambda o: float(o @ theta))
            total += mult * best
        return total

    def cost(self, theta: np.ndarray) -> float:
        return float(self.linearize(theta) @ theta)


@dataclass(frozen=True)
class CollectiveCost:
    algorithm: str
    nbytes: float
    ranks: int
    time: float
    latency: float  # base + alpha terms
    bandwidth: float  # beta terms
    reduction: float  # gamma terms

    @property
    def algbw(self) -> float:
        return self.nbytes / self.time if self.time > 0 else math.inf

    @property
    def busbw(self) -> float:
        """nccl-tests convention: algbw * 2(p-1)/p (PERFORMANCE.md)."""
        p = self.ranks
        return self.algbw * 2 * (p - 1) / p if p > 1 else math.inf


# -- building blocks ------------------------------------------------------------------------------
def _ring_step(cluster: Cluster, chunk: float, crosses_nodes: bool, rings_crossing: int = 1,
               reduce: bool = False, intra_hop: bool = True, nics: int | None = None) -> list[np.ndarray]:
    """Options for one lock-step ring step moving ``chunk`` bytes per rank (``nics`` overrides the NIC count)."""
    red = chunk if reduce else 0.0
    opts = []
    if intra_hop:
        opts.append(vec(alpha_intra=1, beta_intra=chunk, gamma=red))
    if crosses_nodes:
        streams = nics if nics is not None else cluster.inter_streams(rings_crossing)
        per_nic = chunk * rings_crossing / streams
        opts.append(vec(alpha_inter=1, beta_inter=per_nic, gamma=red))
    return opts


def ring_phase(plan: Plan, cluster: Cluster, members: int, nbytes: float, kind: str, crosses_nodes: bool,
               rings_crossing: int = 1, intra_hop: bool = True, nics: int | None = None) -> Plan:
    """A ring reduce-scatter ("rs"), all-gather ("ag") or all-reduce ("ar") of ``nbytes`` per member."""
    if members <= 1:
        return plan
    chunk = nbytes / members
    if kind in ("rs", "ar"):
        plan.add(members - 1, *_ring_step(cluster, chunk, crosses_nodes, rings_crossing, True, intra_hop, nics))
    if kind in ("ag", "ar"):
        plan.add(members - 1, *_ring_step(cluster, chunk, crosses_nodes, rings_crossing, False, intra_hop, nics))
    return plan


def _log2(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


# -- the algorithms -------------------------------------------------------------------------------
def ring_plan(cluster: Cluster, nodes: int, nbytes: float) -> Plan:
    p = cluster.gpus_per_node * nodes
    plan = Plan().add(1, vec(base=1))
    return ring_phase(plan, cluster, p, nbytes, "ar", crosses_nodes=nodes > 1,
                      intra_hop=cluster.gpus_per_node > 1 or nodes == 1)


def tree_plan(cluster: Cluster, nodes: int, nbytes: float) -> Plan:
    g = cluster.gpus_per_node
    if nodes == 1:  # NCCL runs rings inside a node; the tree only matters between nodes
        return ring_plan(cluster, nodes, nbytes)
    plan = Plan().add(1, vec(base=1))
    plan.add(1, vec(alpha_intra=2 * (g - 1), alpha_inter=2 * _log2(nodes), gamma=nbytes))
    # Pipelined reduce + broadcast: each node sends and receives 2n through its NICs (double binary
    # tree: interior in one tree, leaf in the other); the intra chain sends n up and n down per GPU.
    inter = vec(beta_inter=2 * nbytes / cluster.inter_streams(1))
    intra = vec(beta_intra=2 * nbytes) if g > 1 else inter
    return plan.add(1, inter, intra)


def hierarchical_plan(cluster: Cluster, nodes: int, nbytes: float, chunks: int = 1) -> Plan:
    g = cluster.gpus_per_node
    if chunks < 1:
        raise ConfigError(f"hierarchical chunks must be >= 1, got {chunks}")
    c = nbytes / chunks
    lg = _log2(g)
    stages: list[Plan] = []
    if g > 1:  # reduce to the leader: binomial tree of log2(g) rounds (gloo: costs an all-reduce)
        if cluster.backend == "gloo":
            stages.append(ring_phase(Plan().add(1, vec(base=1)), cluster, g, c, "ar", crosses_nodes=False))
        else:
            stages.append(Plan().add(lg, vec(base=1 / lg, alpha_intra=1, beta_intra=c, gamma=c)))
    if nodes > 1:
        # The leader is one process: it drives one NIC (Horovod's MPI stage, our gloo leader ring).
        leaders = Plan().add(1, vec(base=1))
        stages.append(ring_phase(leaders, cluster, nodes, c, "ar", crosses_nodes=True, intra_hop=False, nics=1))
    if g > 1:  # binomial broadcast from the leader
        stages.append(Plan().add(lg, vec(base=1 / lg, alpha_intra=1, beta_intra=c)))
    plan = Plan()
    for s in stages:
        plan.extend(s)
    if chunks > 1 and stages:  # pipeline: the slowest stage (resolved at evaluation) repeats per chunk
        plan.add(chunks - 1, *[_stage_vector(s) for s in stages])
    return plan


def _stage_vector(stage: Plan) -> np.ndarray:
    # A stage's own maxima are over hops of one kind here (no mixed intra/inter rings), so summing the
    # options' first entries is exact.
    total = np.zeros(len(PARAMS))
    for mult, opts in stage.terms:
        total += mult * opts[0]
    return total


def torus2d_plan(cluster: Cluster, nodes: int, nbytes: float, x: int | None = None) -> Plan:
    g = cluster.gpus_per_node
    p = g * nodes
    x = x or g
    if x < 1 or p % x:
        raise TopologyError(f"torus x={x} does not divide the world size {p} (g={g} per node x {nodes} nodes)")
    if not (x % g == 0 or g % x == 0):
        raise TopologyError(f"torus x={x} must be a multiple or a divisor of the {g} ranks per node")
    y = p // x
    row_crosses = x > g
    col_crosses = nodes > 1 and (y > 1)
    plan = Plan().add(3, vec(base=1))
    gloo = cluster.backend == "gloo"
    # gloo's reduce_scatter all-reduces the whole input; its list all_gather copies the output once more.
    ring_phase(plan, cluster, x, nbytes, "ar" if gloo else "rs", crosses_nodes=row_crosses, rings_crossing=1)
    ring_phase(plan, cluster, y, nbytes / x, "ar", crosses_nodes=col_crosses, rings_crossing=min(x, g),
               intra_hop=x < g)
    ring_phase(plan, cluster, x, nbytes, "ag", crosses_nodes=row_crosses, rings_crossing=1)
    if gloo and x > 1:
        plan.add(1, vec(gamma=nbytes))
    return plan


def plan_for(algorithm: str, cluster: Cluster, nodes: int, nbytes: float, chunks: int = 1,
             torus_x: int | None = None) -> Plan:
    if nodes < 1:
        raise TopologyError(f"number of nodes must be >= 1, got {nodes}")
    if nbytes < 0:
        raise ConfigError(f"message size must be >= 0 bytes, got {nbytes}")
    alg = canonical(algorithm)
    if alg == "ring":
        return ring_plan(cluster, nodes, nbytes)
    if alg == "tree":
        return tree_plan(cluster, nodes, nbytes)
    if alg == "hierarchical":
        return hierarchical_plan(cluster, nodes, nbytes, chunks)
    return torus2d_plan(cluster, nodes, nbytes, torus_x)


def allreduce_cost(algorithm: str, cluster: Cluster, nodes: int, nbytes: float, chunks: int = 1,
                   torus_x: int | None = None) -> CollectiveCost:
    """Predicted time of one all-reduce of ``nbytes`` per rank, split into latency/bandwidth/reduction."""
    theta = np.array(cluster.constants.vector())
    coeffs = plan_for(algorithm, cluster, nodes, nbytes, chunks, torus_x).linearize(theta)
    parts = coeffs * theta
    return CollectiveCost(
        canonical(algorithm), float(nbytes), cluster.gpus_per_node * nodes, float(parts.sum()),
        float(parts[LATENCY].sum()), float(parts[BANDWIDTH].sum()), float(parts[REDUCTION].sum()),
    )
