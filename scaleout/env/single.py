"""No launcher: one process, world size 1 (always matches, so it is tried last)."""

from __future__ import annotations

from collections.abc import Mapping

from scaleout.env.base import Environment, WorldSpec, free_port, master
from scaleout.env.detect import register


@register
class SingleEnv(Environment):
    """No launcher: one process, world size 1."""

    name = "single"
    priority = 1000  # the fallback: every other environment is tried first

    def detect(self, env: Mapping[str, str]) -> bool:
        return True

    def read(self, env: Mapping[str, str]) -> WorldSpec:
        addr, port = master(env, self.name)
        return WorldSpec(
            0, 0, 0, 1, 1, 1, addr or "127.0.0.1", port, self.name, tasks_per_node=(1,)
        )

    def rendezvous(self, spec: WorldSpec) -> tuple[str, int]:
        return spec.master_addr or "127.0.0.1", spec.master_port or free_port()
