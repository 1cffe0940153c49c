"""What every launcher environment produces: a :class:`WorldSpec`."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from scaleout.errors import LaunchEnvError


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
    launcher: str  # the name of the environment that described it (scaleout.env.ENVIRONMENTS)
    # Ranks on each node, when the launcher says (Slurm's SLURM_TASKS_PER_NODE); None = not known
    # here, World derives it from an all-gather after init.
    tasks_per_node: tuple[int, ...] | None = None
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        checks = [
            (
                0 <= self.rank < self.world_size,
                f"rank {self.rank} not in [0, world_size={self.world_size})",
            ),
            (
                0 <= self.local_rank < self.local_size,
                f"local rank {self.local_rank} not in [0, {self.local_size})",
            ),
            (
                0 <= self.node_rank < self.num_nodes,
                f"node rank {self.node_rank} not in [0, {self.num_nodes})",
            ),
            (
                self.num_nodes <= self.world_size,
                f"{self.num_nodes} nodes but only {self.world_size} ranks",
            ),
        ]
        for ok, msg in checks:
            if not ok:
                raise LaunchEnvError(f"{self.launcher} environment: {msg}")


class Environment:
    """A small reader of one launcher's variables (submitit's ``JobEnvironment``, cut down).

    Subclasses set ``name``, ``priority`` (detection order: lower is tried first; the one place the
    order is written), ``variables`` (WorldSpec field -> the variable that holds it, as data) and
    implement ``detect`` and ``read``; :func:`scaleout.env.detect.register` adds an instance to
    ``ENVIRONMENTS``.
    """

    name: ClassVar[str] = "base"
    priority: ClassVar[int] = 0
    variables: ClassVar[Mapping[str, str]] = {}
    # Where the global rank is, before any World exists (scaleout.log); default: variables["rank"].
    rank_vars: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.__dict__.get("rank_vars") and "rank" in cls.variables:
            cls.rank_vars = (cls.variables["rank"],)

    def detect(self, env: Mapping[str, str]) -> bool:
        raise NotImplementedError

    def read(self, env: Mapping[str, str]) -> WorldSpec:
        raise NotImplementedError

    def read_ints(
        self, env: Mapping[str, str], variables: Mapping[str, str] | None = None
    ) -> dict[str, int]:
        """``{field: int(env[variable])}`` over ``variables`` (default: the declared ones); one
        line naming the variable when one is missing or not an integer."""
        mapping = self.variables if variables is None else variables
        return {field: need_int(env, var, self.name) for field, var in mapping.items()}

    def rendezvous(self, spec: WorldSpec) -> tuple[str, int]:
        """Address and port of the TCP store. Default: what the variables said."""
        if spec.master_addr is None or spec.master_port is None:
            raise LaunchEnvError(
                f"{self.name} environment: MASTER_ADDR/MASTER_PORT not set and this launcher "
                "cannot derive them"
            )
        return spec.master_addr, spec.master_port


def master(env: Mapping[str, str], source: str) -> tuple[str | None, int | None]:
    """MASTER_ADDR / MASTER_PORT when set (every launcher lets them override its own rule)."""
    return env.get("MASTER_ADDR") or None, opt_port(env, "MASTER_PORT", source)


def need_int(env: Mapping[str, str], name: str, source: str) -> int:
    value = env.get(name)
    if value is None:
        raise LaunchEnvError(f"{source} environment: {name} is not set")
    try:
        return int(value)
    except ValueError:
        raise LaunchEnvError(f"{source} environment: {name}={value!r} is not an integer") from None


def opt_int(env: Mapping[str, str], name: str, source: str) -> int | None:
    return need_int(env, name, source) if env.get(name) not in (None, "") else None


def opt_port(env: Mapping[str, str], name: str, source: str) -> int | None:
    port = opt_int(env, name, source)
    if port is not None and not 1 <= port <= 65535:
        raise LaunchEnvError(
            f"{source} environment: {name}={port}: expected a port from 1 to 65535"
        )
    return port


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free on ``host`` right now: all n sockets are held until every port
    is known. (Free when chosen, like torchrun's; the rendezvous binds its port within seconds.)"""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


# What scaleout's own launchers tell every rank (launchers/local.py; launchers/submit.py under
# submitit's local executor) and LocalEnv reads back: WorldSpec field -> variable. One mapping, so
# writer and reader agree.
LOCAL_VARS = {
    "rank": "SCALEOUT_RANK",
    "local_rank": "SCALEOUT_LOCAL_RANK",
    "node_rank": "SCALEOUT_NODE_RANK",
    "num_nodes": "SCALEOUT_NNODES",
    "local_size": "SCALEOUT_NPROC_PER_NODE",
    "world_size": "SCALEOUT_WORLD_SIZE",
}
# The CUDA device index of this rank among the ranks on this physical host, set by scaleout's own
# launchers (every rank of a local or netns launch is on this host, however many nodes it emulates,
# so it is the rank). scaleout.world uses it instead of the local rank, which restarts at 0 on each
# emulated node: two emulated nodes on one GPU box would otherwise both use cuda:0.
DEVICE_VAR = "SCALEOUT_DEVICE"


def local_rank_env(rank: int, nnodes: int, nproc: int, addr: str, port: int) -> dict[str, str]:
    """The variables of rank ``rank`` of ``nnodes`` x ``nproc`` ranks (node-major) meeting at
    ``addr:port``, all on this host: :data:`LOCAL_VARS`, :data:`DEVICE_VAR`, plus torchrun's
    names so that torch-native scripts run unchanged."""
    node, local = divmod(rank, nproc)
    values = {
        "rank": rank,
        "local_rank": local,
        "node_rank": node,
        "num_nodes": nnodes,
        "local_size": nproc,
        "world_size": nnodes * nproc,
    }
    env = {LOCAL_VARS[k]: str(v) for k, v in values.items()}
    env[DEVICE_VAR] = str(rank)  # one GPU per rank of this host, across its emulated nodes
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(local),
        GROUP_RANK=str(node),
        WORLD_SIZE=str(nnodes * nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
    )
    return env
