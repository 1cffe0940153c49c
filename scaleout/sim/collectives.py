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
- ``hierarchical``: intra-node reduce-scatter -> all-reduce of each 1/g shard among same-local-rank
  peers (g column rings at once, sharing the node's NICs) -> intra-node all-gather. This is
  scaleout.comm.hierarchical, Horovod's NCCLHierarchicalAllreduce and NVIDIA's DistributedFusedLAMB
  pattern: 2(g-1) + 2(k-1) latency steps, 2(k-1)/k * n bytes through each node's NICs.
- ``torus2d``: Sony's 2D torus (Mikami et al. 2018, arXiv 1811.05233): the same three phases on an
  X x Y grid (X = g is exactly ``hierarchical``); 2(X-1) + 2(Y-1) latency steps, so X ~ sqrt(p)
  ("square", the sweep default) minimises latency at thousands of ranks.
- ``leader`` (extra, for the Horovod 2018 comparison): binomial reduce to a node leader, ring all-reduce
  of the full n among the k leaders (one process, one NIC), binomial broadcast (Horovod PR #329).

In-network reduction (``cluster.sharp``, SHARP through NCCL CollNet): the inter-node all-reduce of
``tree`` (NCCL's CollNet replaces the tree between nodes) and of ``hierarchical``/``torus2d`` (the column
all-reduce, when each column has one rank per node) is done by the switches: one ``alpha_sharp`` latency
and ~1 x the column's bytes through each NIC each way, instead of 2(k-1) ring steps of 2(k-1)/k x the
bytes. ``ring`` is unchanged (a ring is point to point), and reduce-scatter/all-gather never use it.

Grid algorithms can be chunk-pipelined (scaleout.comm.grid on gloo: 4 MiB chunks, at most 64): the time
is one chunk's three stages plus (chunks - 1) x the slowest stage.

``cluster.backend == "gloo"`` models torch's CPU path as scaleout.comm.grid drives it: the row phases
are direct point-to-point exchanges (one latency, (g-1)/g of a chunk each way) instead of rings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Union

import numpy as np

from scaleout.errors import ConfigError, TopologyError
from scaleout.sim.cluster import PARAMS, Cluster

ALGORITHMS = ("ring", "tree", "hierarchical", "torus2d")
EXTRA_ALGORITHMS = ("leader",)
ALIASES = {"flat": "ring", "hier": "hierarchical", "torus": "torus2d", "2d-torus": "torus2d"}
_IDX = {k: i for i, k in enumerate(PARAMS)}
LATENCY = [_IDX["base"], _IDX["alpha_intra"], _IDX["alpha_inter"], _IDX["alpha_sharp"]]
BANDWIDTH = [_IDX["beta_intra"], _IDX["beta_inter"]]
REDUCTION = [_IDX["gamma"]]
# scaleout.comm.grid's gloo pipeline (DEFAULT_CHUNK_BYTES, MAX_CHUNKS); repeated here so the simulator
# needs no torch import.
GLOO_CHUNK_BYTES = 4 << 20
GLOO_MAX_CHUNKS = 64


def canonical(algorithm: str) -> str:
    name = ALIASES.get(algorithm.lower(), algorithm.lower())
    if name not in ALGORITHMS + EXTRA_ALGORITHMS:
        raise ConfigError(
            f"unknown all-reduce algorithm {algorithm!r}; expected one of "
            f"{', '.join(ALGORITHMS + EXTRA_ALGORITHMS)} (or flat)"
        )
    return name


def vec(**coeffs: float) -> np.ndarray:
    v = np.zeros(len(PARAMS))
    for k, c in coeffs.items():
        v[_IDX[k]] = c
    return v


Option = Union[np.ndarray, "Plan"]


@dataclass
class Plan:
    """sum(mult * max(option . theta)) over terms; an option is a coefficient vector or a sub-plan."""

    terms: list[tuple[float, list[Option]]] = field(default_factory=list)

    def add(self, mult: float, *options: Option) -> Plan:
        if mult > 0 and options:
            self.terms.append((float(mult), list(options)))
        return self

    def extend(self, other: Plan) -> Plan:
        self.terms.extend(other.terms)
        return self

    def linearize(self, theta: np.ndarray) -> np.ndarray:
        """Coefficients of the cost with each max resolved at ``theta`` (cost = result . theta)."""
        total = np.zeros(len(PARAMS))
        for mult, opts in self.terms:
            vecs = [o.linearize(theta) if isinstance(o, Plan) else o for o in opts]
            total += mult * max(vecs, key=lambda v: float(v @ theta))
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
def _hop(
    cluster: Cluster,
    chunk: float,
    crosses_nodes: bool,
    rings_crossing: int,
    reduce: bool,
    intra_hop: bool,
    nics: float | None,
) -> list[np.ndarray]:
    """Options for one lock-step step moving ``chunk`` bytes per rank (``nics`` overrides the NIC count)."""
    red = chunk if reduce else 0.0
    opts = []
    if intra_hop or not crosses_nodes:
        opts.append(vec(alpha_intra=1, beta_intra=chunk, gamma=red))
    if crosses_nodes:
        streams = nics if nics is not None else cluster.inter_streams(rings_crossing)
        opts.append(vec(alpha_inter=1, beta_inter=chunk * rings_crossing / streams, gamma=red))
    return opts


def ring_phase(
    plan: Plan,
    cluster: Cluster,
    members: int,
    nbytes: float,
    kind: str,
    crosses_nodes: bool,
    rings_crossing: int = 1,
    intra_hop: bool = True,
    nics: float | None = None,
) -> Plan:
    """A ring reduce-scatter ("rs"), all-gather ("ag") or all-reduce ("ar") of ``nbytes`` per member."""
    if members <= 1:
        return plan
    chunk = nbytes / members
    if kind in ("rs", "ar"):
        plan.add(
            members - 1, *_hop(cluster, chunk, crosses_nodes, rings_crossing, True, intra_hop, nics)
        )
    if kind in ("ag", "ar"):
        plan.add(
            members - 1,
            *_hop(cluster, chunk, crosses_nodes, rings_crossing, False, intra_hop, nics),
        )
    return plan


def sharp_phase(plan: Plan, cluster: Cluster, nbytes: float, rings_crossing: int = 1) -> Plan:
    """In-network all-reduce of ``nbytes`` per member among ``rings_crossing`` concurrent groups per node:
    each member sends its bytes to the switch once and receives the result once (full duplex)."""
    streams = cluster.inter_streams(rings_crossing) * cluster.sharp_efficiency
    return plan.add(1, vec(alpha_sharp=1, beta_inter=nbytes * rings_crossing / streams))


def direct_phase(
    plan: Plan, cluster: Cluster, members: int, nbytes: float, reduce: bool, crosses_nodes: bool
) -> Plan:
    """Every member sends 1/members of ``nbytes`` to each row peer at once (gloo isend/irecv).

    A row of x members has min(g, x) of them on each node; each sends (x - g)/x of its bytes off the
    node, so a node's NICs carry min(g, x) * (x - g)/x * n per phase (x = 4 over 2 nodes x 2: n).
    """
    if members <= 1:
        return plan
    g = cluster.gpus_per_node
    local = min(g, members)
    red = nbytes * (members - 1) / members if reduce else 0.0
    opts = [vec(alpha_intra=1, beta_intra=nbytes * (local - 1) / members, gamma=red)]
    if crosses_nodes:
        off_node = local * nbytes * (members - local) / members
        opts.append(
            vec(alpha_inter=1, beta_inter=off_node / cluster.inter_streams(local), gamma=red)
        )
    return plan.add(1, *opts)


def _log2(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def square_torus_x(g: int, nodes: int) -> int:
    """The multiple (or divisor) of g nearest sqrt(p) that divides p: fewest 2(X-1) + 2(Y-1) steps."""
    p = g * nodes
    cands = [x for x in range(1, p + 1) if p % x == 0 and (x % g == 0 or g % x == 0)]
    return min(cands, key=lambda x: (2 * (x - 1) + 2 * (p // x - 1), -x))


def gloo_chunks(nbytes: float, chunk_bytes: int | None = None) -> int:
    return int(min(GLOO_MAX_CHUNKS, max(1, math.ceil(nbytes / (chunk_bytes or GLOO_CHUNK_BYTES)))))


# -- the algorithms -------------------------------------------------------------------------------
def ring_plan(cluster: Cluster, nodes: int, nbytes: float) -> Plan:
    p = cluster.gpus_per_node * nodes
    plan = Plan().add(1, vec(base=1))
    return ring_phase(
        plan, cluster, p, nbytes, "ar", crosses_nodes=nodes > 1, intra_hop=cluster.gpus_per_node > 1
    )


def tree_plan(cluster: Cluster, nodes: int, nbytes: float) -> Plan:
    g = cluster.gpus_per_node
    if nodes == 1:  # NCCL runs rings inside a node; the tree only matters between nodes
        return ring_plan(cluster, nodes, nbytes)
    plan = Plan().add(1, vec(base=1))
    if (
        cluster.sharp
    ):  # CollNet: a chain in the node, the switches reduce between nodes (n each way)
        plan.add(1, vec(alpha_intra=2 * (g - 1), alpha_sharp=1, gamma=nbytes))
        inter = vec(beta_inter=nbytes / (cluster.inter_streams(1) * cluster.sharp_efficiency))
        return plan.add(1, inter, vec(beta_intra=2 * nbytes) if g > 1 else inter)
    plan.add(1, vec(alpha_intra=2 * (g - 1), alpha_inter=2 * _log2(nodes), gamma=nbytes))
    # Pipelined reduce + broadcast: each node sends and receives 2n through its NICs (double binary
    # tree: interior in one tree, leaf in the other); the intra chain sends n up and n down per GPU.
    inter = vec(beta_inter=2 * nbytes / cluster.inter_streams(1))
    intra = vec(beta_intra=2 * nbytes) if g > 1 else inter
    return plan.add(1, inter, intra)


def grid_plan(cluster: Cluster, nodes: int, nbytes: float, x: int, chunks: int) -> Plan:
    """Row reduce-scatter -> column all-reduce of a 1/x shard -> row all-gather, chunk-pipelined."""
    g = cluster.gpus_per_node
    p = g * nodes
    if x < 1 or p % x:
        raise TopologyError(f"grid x={x} does not divide the world size {p} ({nodes} nodes x {g})")
    if not (x % g == 0 or g % x == 0):
        raise TopologyError(f"grid x={x} must be a multiple or a divisor of the {g} ranks per node")
    if chunks < 1:
        raise ConfigError(f"pipeline chunks must be >= 1, got {chunks}")
    y = p // x
    c = nbytes / chunks
    row_crosses = x > g
    col_crosses = nodes > 1 and y > 1
    gloo = cluster.backend == "gloo"
    sharp = cluster.sharp and col_crosses and x % g == 0  # one column member per node
    stages = []
    for kind in ("rs", "ar", "ag"):
        st = Plan().add(1, vec(base=1))
        if kind == "ar" and sharp:
            sharp_phase(st, cluster, c / x, rings_crossing=min(x, g))
        elif kind == "ar":
            ring_phase(
                st,
                cluster,
                y,
                c / x,
                "ar",
                crosses_nodes=col_crosses,
                rings_crossing=min(x, g),
                intra_hop=x < g,
            )
        elif gloo:
            direct_phase(st, cluster, x, c, reduce=kind == "rs", crosses_nodes=row_crosses)
        else:
            ring_phase(st, cluster, x, c, kind, crosses_nodes=row_crosses)
        stages.append(st)
    fill = Plan()
    for st in stages:
        fill.add(1, st)
    pipelined = Plan().extend(fill).add(chunks - 1, *stages)
    if chunks == 1 or not (row_crosses or col_crosses):
        return pipelined
    # Stages of different chunks overlap in time but share the node's NICs (the row phases of a row
    # that spans nodes send the same way as the column phase), so the pipeline can go no faster than
    # the bytes all chunks push through the NICs: fill + (chunks - 1) x one chunk's link time.
    per_chunk = _grid_link_bytes(cluster, x, y, c, row_crosses, col_crosses, gloo, sharp)
    link_bound = Plan().extend(fill).add(chunks - 1, vec(beta_inter=per_chunk))
    return Plan().add(1, pipelined, link_bound)


def _grid_link_bytes(
    cluster: Cluster,
    x: int,
    y: int,
    c: float,
    row_crosses: bool,
    col_crosses: bool,
    gloo: bool,
    sharp: bool = False,
) -> float:
    """Bytes per NIC-equivalent that one chunk of a grid all-reduce sends out of a node."""
    g = cluster.gpus_per_node
    total = 0.0
    if row_crosses:  # rs + ag
        if gloo:
            local = min(g, x)
            total += 2 * local * c * (x - local) / x / cluster.inter_streams(local)
        else:
            total += 2 * (x - 1) * (c / x) / cluster.inter_streams(1)
    if col_crosses:
        r = min(x, g)
        share = c / x / (cluster.sharp_efficiency if sharp else 1.0)
        total += (1 if sharp else 2 * (y - 1) / y) * share * r / cluster.inter_streams(r)
    return total


def leader_plan(cluster: Cluster, nodes: int, nbytes: float) -> Plan:
    g = cluster.gpus_per_node
    lg = _log2(g)
    plan = Plan()
    if g > 1:  # binomial reduce to the node leader
        plan.add(1, vec(base=1)).add(lg, vec(alpha_intra=1, beta_intra=nbytes, gamma=nbytes))
    if nodes > 1:  # the leader is one process driving one ring's streams (Horovod's MPI stage)
        ring_phase(
            plan.add(1, vec(base=1)),
            cluster,
            nodes,
            nbytes,
            "ar",
            crosses_nodes=True,
            intra_hop=False,
            nics=cluster.inter_streams(1) / cluster.streams_per_ring,
        )
    if g > 1:  # binomial broadcast
        plan.add(1, vec(base=1)).add(lg, vec(alpha_intra=1, beta_intra=nbytes))
    return plan


def resolve_torus_x(cluster: Cluster, nodes: int, torus_x: int | str | None) -> int:
    if torus_x in (None, "", "node"):
        return cluster.gpus_per_node
    if torus_x == "square":
        return square_torus_x(cluster.gpus_per_node, nodes)
    try:
        return int(torus_x)
    except (TypeError, ValueError):
        raise ConfigError(f"torus x {torus_x!r}: expected an integer, 'node' or 'square'") from None


def plan_for(
    algorithm: str,
    cluster: Cluster,
    nodes: int,
    nbytes: float,
    chunks: int | None = None,
    torus_x: int | str | None = None,
    chunk_bytes: int | None = None,
) -> Plan:
    """The cost plan of one all-reduce. ``chunks`` None: 1 on NCCL, scaleout.comm.grid's rule on gloo."""
    if nodes < 1:
        raise TopologyError(f"number of nodes must be >= 1, got {nodes}")
    if nbytes < 0:
        raise ConfigError(f"message size must be >= 0 bytes, got {nbytes}")
    alg = canonical(algorithm)
    if alg == "ring":
        return ring_plan(cluster, nodes, nbytes)
    if alg == "tree":
        return tree_plan(cluster, nodes, nbytes)
    if alg == "leader":
        return leader_plan(cluster, nodes, nbytes)
    if chunks is None:
        chunks = gloo_chunks(nbytes, chunk_bytes) if cluster.backend == "gloo" else 1
    x = cluster.gpus_per_node if alg == "hierarchical" else resolve_torus_x(cluster, nodes, torus_x)
    return grid_plan(cluster, nodes, nbytes, x, chunks)


def allreduce_cost(
    algorithm: str,
    cluster: Cluster,
    nodes: int,
    nbytes: float,
    chunks: int | None = None,
    torus_x: int | str | None = None,
) -> CollectiveCost:
    """Predicted time of one all-reduce of ``nbytes`` per rank, split into latency/bandwidth/reduction."""
    theta = np.array(cluster.constants.vector())
    coeffs = plan_for(algorithm, cluster, nodes, nbytes, chunks, torus_x).linearize(theta)
    parts = coeffs * theta
    return CollectiveCost(
        canonical(algorithm),
        float(nbytes),
        cluster.gpus_per_node * nodes,
        float(parts.sum()),
        float(parts[LATENCY].sum()),
        float(parts[BANDWIDTH].sum()),
        float(parts[REDUCTION].sum()),
    )
