"""Alpha-beta-gamma cost of all-reduce algorithms on a cluster: the dispatch to each algorithm's
cost.

Every algorithm is written as a :class:`~scaleout.sim.cost.Plan` (the algebra and its building
blocks: :mod:`scaleout.sim.cost`, re-exported here): a sum of terms ``mult * max(option . theta)``
where theta is the constants vector and each option is a coefficient vector; the max is a lock-step
phase.

Algorithms (p = g x k ranks, g per node, k nodes, n bytes per rank): every algorithm of
``scaleout.comm.ALGORITHMS`` prices itself (``Algorithm.cost``, next to its runtime: ``flat`` in
scaleout/comm/flat.py, the row/column grids through :func:`grid_plan`). Besides those, two models
with no runtime in scaleout, for comparisons (:data:`SIMULATOR_ONLY`):

- ``tree``: NCCL's double binary tree between nodes (Sanders, Speck & Traeff 2009; NCCL 2.4): a
  chain inside the node, 2 ceil(log2 k) network steps of latency instead of 2(p-1); each node still
  sends and receives 2n bytes, pipelined, so the bandwidth term is ~2n / node bandwidth.
- ``leader`` (the Horovod 2018 comparison): binomial reduce to a node leader, ring all-reduce of the
  full n among the k leaders (one process, one NIC), binomial broadcast (Horovod PR #329).

In-network reduction (``cluster.sharp``, SHARP through NCCL CollNet): the inter-node all-reduce of
``tree`` (NCCL's CollNet replaces the tree between nodes) and of the row/column grids (the column
all-reduce, when each column has one rank per node) is done by the switches: one ``alpha_sharp``
latency and ~1 x the column's bytes through each NIC each way, instead of 2(k-1) ring steps of
2(k-1)/k x the bytes. ``flat`` is unchanged (a ring is point to point), and
reduce-scatter/all-gather never use it.

Grid algorithms can be chunk-pipelined (scaleout.comm.grid on gloo: 4 MiB chunks, at most 64): the
time is one chunk's three stages plus (chunks - 1) x the slowest stage.

``cluster.backend == "gloo"`` models torch's CPU path as scaleout.comm.grid drives it: the row
phases are direct point-to-point exchanges (one latency, (g-1)/g of a chunk each way) instead of
rings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from scaleout.comm import ALGORITHMS, Algorithm, Options
from scaleout.comm.rowcol import GridAlgorithm
from scaleout.comm.torus2d import square_x
from scaleout.errors import ConfigError, TopologyError
from scaleout.sim.cluster import Cluster
from scaleout.sim.cost import (  # noqa: F401  (the building blocks, re-exported for the simulator)
    PARAMS,
    Plan,
    ceil_log2,
    direct_phase,
    grid_plan,
    ring_phase,
    row_col_half_plan,
    sharp_phase,
    vec,
)

if TYPE_CHECKING:
    from scaleout.config.schema import CommConfig

_IDX = {k: i for i, k in enumerate(PARAMS)}
LATENCY = [_IDX["base"], _IDX["alpha_intra"], _IDX["alpha_inter"], _IDX["alpha_sharp"]]
BANDWIDTH = [_IDX["beta_intra"], _IDX["beta_inter"]]
REDUCTION = [_IDX["gamma"]]


def algorithm_names() -> tuple[str, ...]:
    """The default comparison: the registry's algorithms, then NCCL's tree (``leader``, the Horovod
    2018 model, is priced on request)."""
    return (*ALGORITHMS.names(), "tree")


def canonical(algorithm: str) -> str:
    """``algorithm`` if the simulator can price it, else a one-line ConfigError listing the
    choices."""
    if algorithm not in ALGORITHMS and algorithm not in SIMULATOR_ONLY:
        raise ConfigError(
            f"unknown all-reduce algorithm {algorithm!r}; expected one of "
            f"{', '.join((*ALGORITHMS.names(), *SIMULATOR_ONLY))}"
        )
    return algorithm


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


def tree_plan(cluster: Cluster, nodes: int, nbytes: float) -> Plan:
    g = cluster.gpus_per_node
    if nodes == 1:  # NCCL runs rings inside a node; the tree only matters between nodes
        return ALGORITHMS.get("flat").cost(Options(), cluster, nodes, nbytes)
    plan = Plan().add(1, vec(base=1))
    # CollNet: a chain in the node, the switches reduce between nodes (n each way)
    if cluster.sharp:
        plan.add(1, vec(alpha_intra=2 * (g - 1), alpha_sharp=1, gamma=nbytes))
        inter = vec(beta_inter=nbytes / (cluster.inter_streams(1) * cluster.sharp_efficiency))
        return plan.add(1, inter, vec(beta_intra=2 * nbytes) if g > 1 else inter)
    plan.add(1, vec(alpha_intra=2 * (g - 1), alpha_inter=2 * ceil_log2(nodes), gamma=nbytes))
    # Pipelined reduce + broadcast: each node sends and receives 2n through its NICs (double binary
    # tree: interior in one tree, leaf in the other); the intra chain sends n up and n down per GPU.
    inter = vec(beta_inter=2 * nbytes / cluster.inter_streams(1))
    intra = vec(beta_intra=2 * nbytes) if g > 1 else inter
    return plan.add(1, inter, intra)


def leader_plan(cluster: Cluster, nodes: int, nbytes: float) -> Plan:
    g = cluster.gpus_per_node
    lg = ceil_log2(g)
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


# Models with no runtime in scaleout.comm (NCCL's tree, Horovod 2018's leader ring), priced only
# here.
SIMULATOR_ONLY = {"tree": tree_plan, "leader": leader_plan}


def torus_x_option(cluster: Cluster, nodes: int, torus_x: int | str | None) -> int | None:
    """The simulator's torus row knob as the grid's ``x`` option: an integer, "node" / None (the
    default: x = ranks per node) or "square" (~sqrt(p), :func:`scaleout.comm.torus2d.square_x`)."""
    if torus_x in (None, "", "node"):
        return None
    if torus_x == "square":
        return square_x(cluster.gpus_per_node, nodes)
    try:
        return int(torus_x)
    except (TypeError, ValueError):
        raise ConfigError(f"torus x {torus_x!r}: expected an integer, 'node' or 'square'") from None


def config_row_length(comm: CommConfig, nodes: int, ranks_per_node: int) -> int | None:
    """The row length of the run config's row/column grid (the algorithm's own rule: for the torus
    ``comm.torus_x`` and ``comm.torus_y`` through ``resolve_grid``); None for other algorithms
    (and for ``auto``: the simulator picks the grid's square default when it prices the torus)."""
    if comm.auto:
        return None
    alg = ALGORITHMS.get(comm.algorithm)
    if not isinstance(alg, GridAlgorithm):
        return None
    return alg.row_length(comm.options(), nodes * ranks_per_node, ranks_per_node)


def sim_options(
    alg: Algorithm,
    cluster: Cluster,
    nodes: int,
    torus_x: int | str | None = None,
    chunk_bytes: int | None = None,
) -> Options:
    """A registered algorithm's ``Options`` from the simulator's knobs (those it has: ``x``,
    ``chunk_bytes``)."""
    knobs = {"x": torus_x_option(cluster, nodes, torus_x), "chunk_bytes": chunk_bytes}
    fields = alg.Options.model_fields
    return alg.options("simulator", **{k: v for k, v in knobs.items() if k in fields})


def plan_for(
    algorithm: str,
    cluster: Cluster,
    nodes: int,
    nbytes: float,
    chunks: int | None = None,
    torus_x: int | str | None = None,
    chunk_bytes: int | None = None,
) -> Plan:
    """The cost plan of one all-reduce. ``chunks`` None: 1 on NCCL, scaleout.comm.grid's rule on
    gloo."""
    if nodes < 1:
        raise TopologyError(f"number of nodes must be >= 1, got {nodes}")
    if nbytes < 0:
        raise ConfigError(f"message size must be >= 0 bytes, got {nbytes}")
    if chunks is not None and chunks < 1:
        raise ConfigError(f"pipeline chunks must be >= 1, got {chunks}")
    alg = canonical(algorithm)
    if alg in SIMULATOR_ONLY:
        return SIMULATOR_ONLY[alg](cluster, nodes, nbytes)
    algo = ALGORITHMS.get(alg)
    return algo.cost(
        sim_options(algo, cluster, nodes, torus_x, chunk_bytes), cluster, nodes, nbytes, chunks
    )


def allreduce_cost(
    algorithm: str,
    cluster: Cluster,
    nodes: int,
    nbytes: float,
    chunks: int | None = None,
    torus_x: int | str | None = None,
) -> CollectiveCost:
    """Predicted time of one all-reduce of ``nbytes`` per rank, split into
    latency/bandwidth/reduction."""
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
