"""Where the optimizer's state lives, and what that costs on the wire and in HBM.

``OPTIMIZERS`` (``TrainSpec.optimizer``):

- ``replicated``: every rank all-reduces the gradients and runs LAMB on every parameter (torch DDP +
  apex FusedLAMB; scaleout's ``LAMB`` with ``optim.sharded=false``).
- ``sharded``: ZeRO stage 1 over the whole world (Rajbhandari et al. 2020, arXiv 1910.02054;
  scaleout's ``ShardedLAMB``, ``optim.sharded=true``): reduce-scatter the gradients with the
  configured algorithm, LAMB on this rank's 1/p of the parameters, all-gather the updated
  parameters. A ring reduce-scatter plus all-gather moves the same bytes as one all-reduce; the
  optimizer's HBM traffic and state shrink p-fold.
- ``sharded-node``: apex ``DistributedFusedLAMB`` with its default group of one node
  (``dwu_group_size`` 0 = one node; NVIDIA's MLPerf BERT runs): reduce-scatter inside the node,
  all-reduce of that 1/g shard among the ranks with the same local index (one rail per GPU, so SHARP
  applies), LAMB on 1/g of the parameters, all-gather inside the node.

With a compressed wire (``comm.compression`` bf16/fp16, ``TrainSpec.wire_a2a``) scaleout's
ShardedLAMB never sums in the wire dtype: each reduce-scatter is an all-to-all of wire-dtype slices
summed locally in fp32, and ``sharded-node``'s exchange between nodes is such an all-to-all over the
same-local-rank peers followed by an all-gather done as one all-to-all (scaleout.optim.sharded
``_compressed``). Each all-to-all is one direct exchange with every peer (one latency, (m-1)/m of
the bytes each way: :func:`~scaleout.sim.cost.direct_phase`); in-network reduction does not apply.

Reduce-scatter and all-gather have no tree variant in NCCL (they run as rings); ``hierarchical`` and
``torus2d`` do them in two phases, row then column (scaleout.comm.shard: a node's links carry
(k-1)/k of the bytes). In-network reduction does not apply to them. On gloo, torch's reduce_scatter
all-reduces the whole input and slices it (measured; scaleout.sim.cluster), so it costs a full
all-reduce.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from scaleout.comm import ALGORITHMS
from scaleout.errors import ConfigError
from scaleout.sim.cluster import Cluster
from scaleout.sim.collectives import (
    SIMULATOR_ONLY,
    Plan,
    allreduce_cost,
    canonical,
    direct_phase,
    row_col_half_plan,
    sim_options,
)

OPTIMIZERS = ("replicated", "sharded", "sharded-node")


def check_optimizer(name: str) -> str:
    if name not in OPTIMIZERS:
        raise ConfigError(
            f"unknown optimizer placement {name!r}; expected one of {', '.join(OPTIMIZERS)}"
        )
    return name


def shard_ranks(optimizer: str, cluster: Cluster, nodes: int) -> int:
    """How many ranks share one copy of the optimizer state (each updates 1/shard of the
    parameters)."""
    check_optimizer(optimizer)
    if optimizer == "replicated":
        return 1
    return cluster.gpus_per_node * (nodes if optimizer == "sharded" else 1)


def half_plan(
    kind: str,
    algorithm: str,
    cluster: Cluster,
    nodes: int,
    nbytes: float,
    torus_x: int | str | None = None,
) -> Plan:
    """Reduce-scatter (``kind="rs"``) of ``nbytes`` per rank, or the all-gather (``"ag"``) whose
    output is ``nbytes`` per rank, over the whole world, as ``algorithm`` runs it
    (``Algorithm.half_cost``; the simulator-only models as one ring)."""
    alg = canonical(algorithm)
    if alg in SIMULATOR_ONLY:
        return row_col_half_plan(kind, None, cluster, nodes, nbytes)
    algo = ALGORITHMS.get(alg)
    return algo.half_cost(kind, sim_options(algo, cluster, nodes, torus_x), cluster, nodes, nbytes)


def rail_cluster(cluster: Cluster) -> Cluster:
    """One rank per node, as seen by the g concurrent same-local-rank groups: each gets 1/g of
    the NICs."""
    g = cluster.gpus_per_node
    share = cluster.inter_streams(g) / g  # NIC-equivalents per rail when all g rails send at once
    rail = replace(
        cluster, gpus_per_node=1, nics_per_node=1, streams_per_ring=1, stream_fraction=1.0
    )
    return rail.with_constants(beta_inter=cluster.constants.beta_inter / share)


def _time(plan: Plan, cluster: Cluster) -> float:
    return plan.cost(np.array(cluster.constants.vector()))


def reduce_time(
    optimizer: str,
    algorithm: str,
    cluster: Cluster,
    nodes: int,
    nbytes: float,
    chunks: int | None = None,
    torus_x: int | str | None = None,
    wire_a2a: bool = False,
) -> float:
    """Seconds to reduce one bucket of ``nbytes`` gradient bytes per rank before the update
    (``wire_a2a``: the sharded LAMB's compressed wire, all-to-alls with fp32 sums)."""
    if optimizer == "replicated":
        return allreduce_cost(algorithm, cluster, nodes, nbytes, chunks, torus_x).time
    if wire_a2a:
        return a2a_reduce_time(optimizer, cluster, nodes, nbytes)
    if optimizer == "sharded":
        return _time(half_plan("rs", algorithm, cluster, nodes, nbytes, torus_x), cluster)
    intra = _time(half_plan("rs", "flat", cluster, 1, nbytes), cluster)
    if nodes == 1:
        return intra
    return (
        intra
        + allreduce_cost(
            algorithm, rail_cluster(cluster), nodes, nbytes / cluster.gpus_per_node
        ).time
    )


def a2a_reduce_time(optimizer: str, cluster: Cluster, nodes: int, nbytes: float) -> float:
    """The compressed reduce-scatter of scaleout's ShardedLAMB (module doc): ``sharded``, one
    all-to-all over the world; ``sharded-node``, one within the node, then an all-to-all and an
    all-to-all all-gather of the node's 1/g over the same-local-rank peers (one rail each)."""
    if optimizer == "sharded":
        return _time(
            direct_phase(Plan(), cluster, cluster.gpus_per_node * nodes, nbytes, True, nodes > 1),
            cluster,
        )
    g = cluster.gpus_per_node
    t = _time(direct_phase(Plan(), cluster, g, nbytes, True, False), cluster)
    if nodes > 1:
        rail = rail_cluster(cluster)
        t += _time(direct_phase(Plan(), rail, nodes, nbytes / g, True, True), rail)
        t += _time(direct_phase(Plan(), rail, nodes, nbytes / g, False, True), rail)
    return t


def gather_time(
    optimizer: str,
    algorithm: str,
    cluster: Cluster,
    nodes: int,
    nbytes: float,
    torus_x: int | str | None = None,
) -> float:
    """Seconds to all-gather ``nbytes`` of updated parameters per rank (0 when replicated)."""
    if optimizer == "replicated":
        return 0.0
    if optimizer == "sharded":
        return _time(half_plan("ag", algorithm, cluster, nodes, nbytes, torus_x), cluster)
    return _time(half_plan("ag", "flat", cluster, 1, nbytes), cluster)


def norm_time(optimizer: str, algorithm: str, cluster: Cluster, nodes: int, tensors: int) -> float:
    """LAMB's per-tensor norms are partial sums on a shard: one small all-reduce of [2, tensors]
    fp32 over the ranks that share the state (scaleout ShardedLAMB adds a usage row: 3 x
    tensors)."""
    if optimizer == "replicated":
        return 0.0
    nbytes = 3 * 4 * tensors
    if optimizer == "sharded":
        return allreduce_cost(algorithm, cluster, nodes, nbytes).time
    return allreduce_cost("flat", cluster, 1, nbytes).time
