"""torchrun / torch.distributed.elastic: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK."""

from __future__ import annotations

from collections.abc import Mapping

from scaleout.env.base import Environment, WorldSpec, master, opt_int
from scaleout.env.detect import register
from scaleout.errors import LaunchEnvError


@register
class TorchrunEnv(Environment):
    """torchrun's variables; the node layout, when GROUP_* are absent, from RANK //
    LOCAL_WORLD_SIZE."""

    name = "torchrun"
    priority = 20
    variables = {"rank": "RANK", "local_rank": "LOCAL_RANK", "world_size": "WORLD_SIZE"}
    optional = {
        "local_size": "LOCAL_WORLD_SIZE",
        "node_rank": "GROUP_RANK",
        "num_nodes": "GROUP_WORLD_SIZE",
    }

    def detect(self, env: Mapping[str, str]) -> bool:
        return "TORCHELASTIC_RUN_ID" in env or all(k in env for k in self.variables.values())

    def read(self, env: Mapping[str, str]) -> WorldSpec:
        n = self.name
        v = self.read_ints(env)
        opt = {field: opt_int(env, var, n) for field, var in self.optional.items()}
        world = v["world_size"]
        local_size = world if opt["local_size"] is None else opt["local_size"]
        for key, value in (("WORLD_SIZE", world), ("LOCAL_WORLD_SIZE", local_size)):
            if value < 1:
                raise LaunchEnvError(f"{n} environment: {key}={value}: expected an integer >= 1")
        node_rank = opt["node_rank"]
        if node_rank is None:
            node_rank = v["rank"] // local_size
        num_nodes = opt["num_nodes"] or max(1, -(-world // local_size))
        addr, port = master(env, n)
        return WorldSpec(
            rank=v["rank"],
            local_rank=v["local_rank"],
            node_rank=node_rank,
            num_nodes=num_nodes,
            local_size=local_size,
            world_size=world,
            master_addr=addr,
            master_port=port,
            launcher=n,
        )
