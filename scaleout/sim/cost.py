"""The simulator's alpha-beta-gamma algebra: what :mod:`scaleout.sim` builds on and what each
all-reduce algorithm writes its cost model in (``Algorithm.cost``, importing this module only when
it is priced: the simulator owns pricing, the algorithm only says its shape).

A cost is a :class:`Plan`: a sum of terms ``mult * max(option . theta)`` where theta is the
constants vector (:data:`PARAMS`) and each option is a coefficient vector. The max expresses
lock-step phases (a ring step lasts as long as its slowest hop; pipelined stages run at the pace of
the slowest stage). Fixing which option wins makes the cost linear in theta, which is what lets
:mod:`scaleout.sim.calibrate` fit the constants with non-negative least squares.

The cluster argument is a :class:`scaleout.sim.cluster.Cluster` (node shape, NICs, backend, SHARP).
numpy only: no torch; the algorithm files import this module when they are priced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

import numpy as np

from scaleout.errors import ConfigError, TopologyError

if TYPE_CHECKING:
    from scaleout.sim.cluster import Cluster

# The constants, in the order of the vector calibration fits (scaleout.sim.cluster.Constants):
PARAMS = ("base", "alpha_intra", "alpha_inter", "beta_intra", "beta_inter", "gamma", "alpha_sharp")
_IDX = {k: i for i, k in enumerate(PARAMS)}


def vec(**coeffs: float) -> np.ndarray:
    v = np.zeros(len(PARAMS))
    for k, c in coeffs.items():
        v[_IDX[k]] = c
    return v


Option = Union[np.ndarray, "Plan"]


@dataclass
class Plan:
    """sum(mult * max(option . theta)) over terms; an option is a coefficient vector or a
    sub-plan."""

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
    """Options for one lock-step step moving ``chunk`` bytes per rank (``nics`` overrides the NIC
    count)."""
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
    """A ring reduce-scatter ("rs"), all-gather ("ag") or all-reduce ("ar") of ``nbytes`` per
    member."""
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
    """In-network all-reduce of ``nbytes`` per member among ``rings_crossing`` concurrent groups
    per node: each member sends its bytes to the switch once and receives the result once (full
    duplex)."""
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


def ceil_log2(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


# -- the algorithms -------------------------------------------------------------------------------
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


def row_col_half_plan(
    kind: str, x: int | None, cluster: Cluster, nodes: int, nbytes: float
) -> Plan:
    """The building block of :func:`half_plan`: ``x`` ranks per row, then the column
    (scaleout.comm's row x column reduce-scatter: row first; the all-gather: column first); ``x``
    None: one ring."""
    g = cluster.gpus_per_node
    p = g * nodes
    gloo = cluster.backend == "gloo"
    # gloo: each reduce-scatter is an all-reduce, sliced
    phase = "ar" if kind == "rs" and gloo else kind
    plan = Plan().add(1, vec(base=1))
    if x is None or x >= p:
        ring_phase(plan, cluster, p, nbytes, phase, crosses_nodes=nodes > 1, intra_hop=g > 1)
    else:
        y = p // x
        row = (x, nbytes, dict(crosses_nodes=x > g))
        col = (
            y,
            nbytes / x,
            dict(crosses_nodes=nodes > 1 and y > 1, rings_crossing=min(x, g), intra_hop=x < g),
        )
        for members, size, kw in (row, col) if kind == "rs" else (col, row):
            ring_phase(plan.add(1, vec(base=1)), cluster, members, size, phase, **kw)
    if kind == "ag" and gloo:
        # all_gather into a list, then one more copy into the flat output
        plan.add(1, vec(gamma=nbytes))
    return plan
