"""What every launcher environment produces: a :class:`WorldSpec`."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from scaleout.errors import EnvironmentError_


@dataclass(frozen=True)
class WorldSpec:
    """Who this process is, as its launcher told it. Plain data: no process group yet."""

    rank: int
    local_rank: int
    node_rank: int
    num_nodes: int
    local_size: int
    world_size: int
    master_addr: str | None
    master_port: int | None
    source: str
    # Ranks on each node, when the launcher says (Slurm's SLURM_TASKS_PER_NODE); None = not known here,
    # World derives it from an all-gather after init.
    tasks_per_node: tuple[int, ...] | None = None
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        checks = [
            (0 <= self.rank < self.world_size, f"rank {self.rank} not in [0, world_size={self.world_size})"),
            (0 <= self.local_rank < self.local_size, f"local rank {self.local_rank} not in [0, {self.local_size})"),
            (0 <= self.node_rank < self.num_nodes, f"node rank {self.node_rank} not in [0, {self.num_nodes})"),
            (self.num_nodes <= self.world_size, f"{self.num_nodes} nodes but only {self.world_size} ranks"),
        ]
        for ok, msg in checks:
            if not ok:
                raise EnvironmentError_(f"{self.source} environment: {msg}")


class Environment:
    """A small reader of one launcher's variables. Subclasses set ``name`` and implement both methods."""

    name = "base"

    def detect(self, env: Mapping[str, str]) -> bool:
        raise NotImplementedError

    def read(self, env: Mapping[str, str]) -> WorldSpec:
        raise NotImplementedError

    def rendezvous(self, spec: WorldSpec) -> tuple[str, int]:
        """Address and port of the TCP store. Default: what the variables said."""
        if spec.master_addr is None or spec.master_port is None:
            raise EnvironmentError_(
                f"{self.name} environment: MASTER_ADDR/MASTER_PORT not set and this launcher cannot derive them"
            )
        return spec.master_addr, spec.master_port


def need_int(env: Mapping[str, str], name: str, source: str) -> int:
    value = env.get(name)
    if value is None:
        raise EnvironmentError_(f"{source} environment: {name} is not set")
    try:
        return int(value)
    except ValueError:
        raise EnvironmentError_(f"{source} environment: {name}={value!r} is not an integer") from None


def opt_int(env: Mapping[str, str], name: str, source: str) -> int | None:
    return need_int(env, name, source) if env.get(name) not in (None, "") else None


def opt_port(env: Mapping[str, str], name: str, source: str) -> int | None:
    port = opt_int(env, name, source)
    if port is not None and not 1 <= port <= 65535:
        raise EnvironmentError_(f"{source} environment: {name}={port}: expected a port from 1 to 65535")
    return port


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
