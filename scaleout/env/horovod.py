"""horovodrun: HOROVOD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE/CROSS_RANK/CROSS_SIZE."""

from __future__ import annotations

from collections.abc import Mapping

from scaleout.env.addr import reachable_address
from scaleout.env.base import Environment, WorldSpec, master, opt_port
from scaleout.env.detect import register
from scaleout.errors import LaunchEnvError


@register
class HorovodEnv(Environment):
    """horovodrun's variables.

    horovodrun's own rendezvous is an HTTP key-value store, not a torch TCPStore; unless
    MASTER_ADDR/PORT are set, rank 0 publishes its own address and a free port through that store:
    rank 0 need not run on horovodrun's host (a launch from a login node with ``-H c1:4,c2:4``).
    """

    name = "horovod"
    priority = 30  # before MPI: horovodrun over MPI sets the MPI variables too
    variables = {
        "rank": "HOROVOD_RANK",
        "local_rank": "HOROVOD_LOCAL_RANK",
        "node_rank": "HOROVOD_CROSS_RANK",
        "num_nodes": "HOROVOD_CROSS_SIZE",
        "local_size": "HOROVOD_LOCAL_SIZE",
        "world_size": "HOROVOD_SIZE",
    }

    def detect(self, env: Mapping[str, str]) -> bool:
        return self.variables["rank"] in env

    def read(self, env: Mapping[str, str]) -> WorldSpec:
        addr, port = master(env, self.name)
        return WorldSpec(
            **self.read_ints(env),
            master_addr=addr,
            master_port=port,
            launcher=self.name,
            extra={
                "rendezvous_addr": env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"),
                "rendezvous_port": opt_port(env, "HOROVOD_GLOO_RENDEZVOUS_PORT", self.name),
            },
        )

    def rendezvous(self, spec: WorldSpec) -> tuple[str, int]:
        if spec.master_addr is not None and spec.master_port is not None:
            return spec.master_addr, spec.master_port
        kv_addr, kv_port = spec.extra.get("rendezvous_addr"), spec.extra.get("rendezvous_port")
        if not kv_addr or not kv_port:
            raise LaunchEnvError(
                "horovod environment: set MASTER_ADDR/MASTER_PORT or run under horovodrun --gloo"
            )
        from scaleout.env.horovod_kv import exchange_master  # deferred: http, horovodrun only

        # Rank 0's own address: the one that routes to horovodrun's host, which every node reaches;
        # loopback only when the whole job is on one host.
        mine = None
        if spec.rank == 0:
            mine = spec.master_addr or (
                "127.0.0.1" if spec.num_nodes == 1 else reachable_address([kv_addr])
            )
        return exchange_master(kv_addr, kv_port, spec.rank, mine, spec.master_port)
