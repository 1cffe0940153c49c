"""The ``netns`` launcher: the local launcher with each emulated node in its own network namespace.

Node i's ranks run via ``ip netns exec <ns_i>`` (launchers/netns.py's :class:`Cluster`) and meet at
node 0's cluster address. Either a private cluster, brought up for the largest launch
(:meth:`prepare`) and always torn down after (by the watchdog too, if this process is SIGKILLed), or
an existing one (``scaleout bench cluster up --name NAME``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from scaleout.env.base import free_port
from scaleout.errors import UserError
from scaleout.launchers.base import LaunchOptions, register
from scaleout.launchers.local import LocalJob, LocalLauncher
from scaleout.launchers.netns import (
    MAX_NODES,
    Cluster,
    parse_node_rates,
    parse_rate,
    require_root,
)


def private_cluster_name(pid: int) -> str:
    """'so' + the pid in base 36 (<= 5 characters up to Linux's largest pid, 2^22): unique among
    running launches, and short enough for Linux's 15-character interface names (<name>-br,
    <name>-v249)."""
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        pid, r = divmod(pid, 36)
        out = digits[r] + out
        if not pid:
            return f"so{out}"


@register
class NetnsLauncher(LocalLauncher):
    """``rate``: each node's link (tc units; 'none' = unlimited) of a private cluster;
    ``node_rates``: single nodes' own rates ({1: "100mbit"} or "1=100mbit"); ``cluster_name``:
    use that existing cluster instead (its own rate). ``master_port``: the
    rendezvous port on node 0 (default: one free here, as good a guess as any for node 0's
    namespace, distinct per launch)."""

    name = "netns"

    def __init__(
        self,
        rate: str | None = "1gbit",
        cluster_name: str | None = None,
        master_port: int | None = None,
        extra_env: Mapping[str, str] | None = None,
        node_rates: Mapping[int, str] | str | None = None,
        **job_options: Any,
    ):
        super().__init__(extra_env=extra_env, **job_options)
        self.rate, self.cluster_name, self.master_port = rate, cluster_name, master_port
        self.node_rates, self._node_rate_spec = parse_node_rates(node_rates), node_rates
        if self.node_rates and cluster_name:
            raise UserError(
                f"--node-rate with --netns-cluster {cluster_name}: an existing cluster keeps the "
                "rates it was brought up with (scaleout bench cluster up --node-rate ...)"
            )
        self.cluster: Cluster | None = None
        self._owned = False
        self.on_orphan: list[list[str]] = []

    @classmethod
    def from_options(cls, options: LaunchOptions) -> NetnsLauncher:
        if options.slurm:
            raise UserError(
                f"--slurm {', '.join(options.slurm)}: sbatch options need --launcher slurm or "
                "submit"
            )
        return cls(rate=options.rate or "1gbit", extra_env=options.extra_env)

    def check(self, shapes: Sequence[tuple[int, int]]) -> None:
        most = max((nnodes for nnodes, _ in shapes), default=1)
        if most > MAX_NODES:
            raise UserError(
                f"--nnodes={most}: expected at most {MAX_NODES} emulated nodes with "
                "--netns/--netns-cluster"
            )
        if self.cluster_name is None:  # a private cluster will be brought up: root, a valid rate
            require_root()
            parse_rate(self.rate)
            parse_node_rates(self._node_rate_spec, most)

    def prepare(self, max_nnodes: int) -> None:
        if self.cluster is not None:
            return
        if self.cluster_name:
            cluster = Cluster(max_nnodes, None, name=self.cluster_name)
            cluster.check_ready(max_nnodes)
            status = cluster.status()
            rates, subnet = status["rates"], status["subnet"] or cluster.subnet
            cluster = Cluster(max_nnodes, None, name=self.cluster_name, subnet=subnet)
            rate = rates.get(cluster.ns(0))
            rate = None if rate in (None, "unlimited") else rate
            own = {
                i: r if r != "unlimited" else "none"
                for i in range(1, max_nnodes)
                if (r := rates.get(cluster.ns(i))) is not None and r != (rate or "unlimited")
            }
            if rate or own:
                cluster = Cluster(
                    max_nnodes, rate, name=self.cluster_name, subnet=subnet, node_rates=own
                )
            self.cluster = cluster
            return
        # A private name per launcher, so concurrent launches and a persistent `cluster up` never
        # collide.
        name = private_cluster_name(os.getpid())
        self.cluster = Cluster(
            max_nnodes, self.rate, name=name, node_rates=self.node_rates
        ).__enter__()
        self._owned = True
        # If this process is SIGKILLed, the ranks' watchdog removes the private cluster after them.
        self.on_orphan = [
            [sys.executable, "-m", "scaleout", "bench", "cluster", "down", "--name", name]
        ]

    def close(self) -> None:
        if self.cluster is not None and self._owned:
            self.cluster.__exit__(None, None, None)
        self.cluster, self._owned, self.on_orphan = None, False, []

    def start(
        self,
        argv: Sequence[str],
        nnodes: int,
        nproc_per_node: int,
        *,
        log: Path | None = None,
        name: str = "scaleout",
    ) -> LocalJob:
        self.prepare(nnodes)
        assert self.cluster is not None
        if nnodes > self.cluster.nodes:
            raise UserError(
                f"{nnodes} nodes, but the emulated cluster {self.cluster.name!r} was brought up "
                "with "
                f"{self.cluster.nodes}"
            )
        kwargs = self.job_kwargs(log)
        kwargs.update(
            master_addr=self.cluster.addr(0),
            master_port=self.master_port or free_port("0.0.0.0"),
            env={**kwargs["env"], **self.cluster.rank_env()},
            node_wrapper=self.cluster.wrapper,
            on_orphan=self.on_orphan,
        )
        job = LocalJob(argv, nnodes, nproc_per_node, **kwargs)
        job.start()
        return job
