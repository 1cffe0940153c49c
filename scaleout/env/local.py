"""``scaleout launch`` (launchers/local.py) and submitit's local executor: the SCALEOUT_*
variables."""

from __future__ import annotations

from collections.abc import Mapping

from scaleout.env.base import LOCAL_VARS, Environment, WorldSpec, master
from scaleout.env.detect import register


@register
class LocalEnv(Environment):
    """Variables set by ``scaleout launch`` for each of its M x G processes
    (env.base.local_rank_env)."""

    name = "local"
    priority = 10  # first: scaleout's own launchers also set torchrun's variables
    variables = LOCAL_VARS

    def detect(self, env: Mapping[str, str]) -> bool:
        return self.variables["rank"] in env

    def read(self, env: Mapping[str, str]) -> WorldSpec:
        v = self.read_ints(env)
        addr, port = master(env, self.name)
        return WorldSpec(
            **v,
            master_addr=addr,
            master_port=port,
            launcher=self.name,
            tasks_per_node=(v["local_size"],) * v["num_nodes"],
        )
