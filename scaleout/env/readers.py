"""One small reader per launcher. Each reads only its own variables and returns the same WorldSpec.

Detection order (first match wins; ``launch.env`` / ``--env`` / ``SCALEOUT_ENV`` overrides it):
  1. local    -- ``scaleout launch`` (SCALEOUT_RANK ...)
  2. torchrun -- TORCHELASTIC_RUN_ID, or RANK + LOCAL_RANK + WORLD_SIZE
  3. horovod  -- HOROVOD_RANK (horovodrun also sets MPI variables, so it comes before MPI)
  4. mpi      -- OMPI_COMM_WORLD_RANK, PMIX_RANK or PMI_RANK (mpirun inside an allocation also sets SLURM_*)
  5. slurm    -- SLURM_PROCID inside a job step (SLURM_STEP_ID set: an srun task, not the batch script)
  6. single   -- one process, no launcher
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from scaleout.env.addr import reachable_address
from scaleout.env.base import (
    LOCAL_VARS,
    Environment,
    WorldSpec,
    free_port,
    need_int,
    opt_int,
    opt_port,
)
from scaleout.errors import EnvironmentError_
from scaleout.nodelist import expand_nodelist, parse_tasks_per_node

# Linux's default net.ipv4.ip_local_port_range is 32768-60999 (Documentation/networking/ip-sysctl.rst);
# used when /proc does not say.
_EPHEMERAL_LOW_DEFAULT = 32768
_PORT_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def _master(env: Mapping[str, str], source: str) -> tuple[str | None, int | None]:
    return env.get("MASTER_ADDR") or None, opt_port(env, "MASTER_PORT", source)


def ephemeral_port_low(path: str = _PORT_RANGE_FILE) -> int:
    """Low end of the kernel's ephemeral port range: ports at or above it may already be taken by any
    outgoing connection of the host, so a fixed rendezvous port must stay below it."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _EPHEMERAL_LOW_DEFAULT


class LocalEnv(Environment):
    """Variables set by ``scaleout launch`` (launchers/local.py) for each of its M x G processes."""

    name = "local"
    rank_vars = (LOCAL_VARS["rank"],)

    def detect(self, env: Mapping[str, str]) -> bool:
        return LOCAL_VARS["rank"] in env

    def read(self, env: Mapping[str, str]) -> WorldSpec:
        n = self.name
        v = {field: need_int(env, var, n) for field, var in LOCAL_VARS.items()}
        addr, port = _master(env, n)
        return WorldSpec(
            **v,
            master_addr=addr,
            master_port=port,
            launcher=n,
            tasks_per_node=(v["local_size"],) * v["num_nodes"],
        )


class TorchrunEnv(Environment):
    """torchrun / torch.distributed.elastic: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK."""

    name = "torchrun"
    rank_vars = ("RANK",)

    def detect(self, env: Mapping[str, str]) -> bool:
        return "TORCHELASTIC_RUN_ID" in env or all(
            k in env for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")
        )

    def read(self, env: Mapping[str, str]) -> WorldSpec:
        n = self.name
        rank = need_int(env, "RANK", n)
        world = need_int(env, "WORLD_SIZE", n)
        local_size = opt_int(env, "LOCAL_WORLD_SIZE", n)
        local_size = world if local_size is None else local_size
        for key, value in (("WORLD_SIZE", world), ("LOCAL_WORLD_SIZE", local_size)):
            if value < 1:
                raise EnvironmentError_(f"{n} environment: {key}={value}: expected an integer >= 1")
        node_rank = opt_int(env, "GROUP_RANK", n)
        if node_rank is None:
            node_rank = rank // local_size
        num_nodes = opt_int(env, "GROUP_WORLD_SIZE", n) or max(1, -(-world // local_size))
        addr, port = _master(env, n)
        return WorldSpec(
            rank=rank,
            local_rank=need_int(env, "LOCAL_RANK", n),
            node_rank=node_rank,
            num_nodes=num_nodes,
            local_size=local_size,
            world_size=world,
            master_addr=addr,
            master_port=port,
            launcher=n,
        )


class SlurmEnv(Environment):
    """An srun task: SLURM_PROCID/LOCALID/NODEID/NTASKS/NNODES/TASKS_PER_NODE/JOB_NODELIST.

    The step's variables (SLURM_STEP_*) are preferred over the job's: a step may use fewer nodes.
    MASTER_ADDR = first host of the nodelist, MASTER_PORT = derived from the job id, unless set.
    Checked under real srun (Slurm 22.05, tests/test_slurm.py): the batch script itself has SLURM_PROCID=0
    but no SLURM_STEP_ID, so only srun tasks are detected; srun tasks get SLURM_STEP_ID/STEPID,
    SLURM_STEP_NODELIST, SLURM_STEP_NUM_NODES/NUM_TASKS and SLURM_STEP_TASKS_PER_NODE (``2(x2)``, ``2,1``).
    """

    name = "slurm"
    rank_vars = ("SLURM_PROCID",)

    def detect(self, env: Mapping[str, str]) -> bool:
        return "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env)

    PORT_BASE = 15000  # above the common service ports (databases, web, X11 at 6000+)

    @staticmethod
    def port_for_job(job_id: int, ephemeral_low: int | None = None) -> int:
        """Deterministic, so every task agrees without talking: ``PORT_BASE + job_id % span`` with the
        span ending just below the ephemeral range (15000..32767 on a default kernel, 17768 ports).
        Every node reads its own range; the nodes of one cluster share their sysctls, and MASTER_PORT
        overrides the map where they do not."""
        low = ephemeral_port_low() if ephemeral_low is None else ephemeral_low
        base = SlurmEnv.PORT_BASE if low - SlurmEnv.PORT_BASE >= 1024 else 1024
        if low - base < 1024:
            raise EnvironmentError_(
                f"slurm environment: the ephemeral port range starts at {low} ({_PORT_RANGE_FILE}), leaving no "
                "room for a rendezvous port below it: set MASTER_PORT"
            )
        return base + job_id % (low - base)

    def read(self, env: Mapping[str, str]) -> WorldSpec:
        n = self.name
        if (
            "SLURM_STEP_ID" not in env and "SLURM_STEPID" not in env
        ):  # forced (launch.env=slurm) in a batch shell
            raise EnvironmentError_(
                "slurm environment: SLURM_STEP_ID is not set, so srun did not start this process "
                "(the batch script itself is not a rank): run it as `srun scaleout train ...`"
            )
        nnodes = opt_int(env, "SLURM_STEP_NUM_NODES", n) or need_int(env, "SLURM_NNODES", n)
        ntasks = opt_int(env, "SLURM_STEP_NUM_TASKS", n) or need_int(env, "SLURM_NTASKS", n)
        tpn_raw = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        if not tpn_raw:
            raise EnvironmentError_("slurm environment: SLURM_TASKS_PER_NODE is not set")
        tpn = parse_tasks_per_node(tpn_raw, nnodes)
        if sum(tpn) != ntasks:
            raise EnvironmentError_(
                f"slurm environment: SLURM_TASKS_PER_NODE={tpn_raw!r} sums to {sum(tpn)}, expected SLURM_NTASKS={ntasks}"
            )
        node_id = need_int(env, "SLURM_NODEID", n)
        if not 0 <= node_id < nnodes:
            raise EnvironmentError_(
                f"slurm environment: SLURM_NODEID={node_id} not in [0, {nnodes})"
            )
        addr, port = _master(env, n)
        nodelist = (
            env.get("SLURM_STEP_NODELIST")
            or env.get("SLURM_JOB_NODELIST")
            or env.get("SLURM_NODELIST")
        )
        hosts = expand_nodelist(nodelist) if nodelist else []
        if addr is None:
            if not hosts:
                raise EnvironmentError_(
                    "slurm environment: neither MASTER_ADDR nor SLURM_JOB_NODELIST is set"
                )
            addr = hosts[0]
        if port is None:
            job = opt_int(env, "SLURM_JOB_ID", n) or need_int(env, "SLURM_JOBID", n)
            port = self.port_for_job(job)
        return WorldSpec(
            rank=need_int(env, "SLURM_PROCID", n),
            local_rank=need_int(env, "SLURM_LOCALID", n),
            node_rank=node_id,
            num_nodes=nnodes,
            local_size=tpn[node_id],
            world_size=ntasks,
            master_addr=addr,
            master_port=port,
            launcher=n,
            tasks_per_node=tuple(tpn),
            extra={"hosts": hosts},
        )


class MPIEnv(Environment):
    """mpirun/mpiexec: Open MPI (OMPI_COMM_WORLD_*), MPICH/Hydra (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID), PMIx.

    Node rank and node count are not in the variables of every MPI (Open MPI 5 sets OMPI_COMM_WORLD_LOCAL_*
    but no node index); they come from mpi4py (ranks sharing memory = one node), which also gives the local
    rank, so all four agree. SCALEOUT_MPI_RANKS_PER_NODE=k emulates nodes of k ranks on one host. The
    rendezvous address and a free port are broadcast from rank 0 with mpi4py.
    """

    name = "mpi"
    rank_vars = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")

    def detect(self, env: Mapping[str, str]) -> bool:
        return any(k in env for k in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"))

    def read(self, env: Mapping[str, str]) -> WorldSpec:
        n = self.name
        if "OMPI_COMM_WORLD_RANK" in env:
            rank = need_int(env, "OMPI_COMM_WORLD_RANK", n)
            size = need_int(env, "OMPI_COMM_WORLD_SIZE", n)
            local_rank = opt_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", n)
            local_size = opt_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", n)
        elif "PMI_RANK" in env:
            rank = need_int(env, "PMI_RANK", n)
            size = need_int(env, "PMI_SIZE", n)
            local_rank = opt_int(env, "MPI_LOCALRANKID", n)
            local_size = opt_int(env, "MPI_LOCALNRANKS", n)
        else:
            rank = need_int(env, "PMIX_RANK", n)
            size = opt_int(env, "PMIX_SIZE", n) or need_int(env, "OMPI_COMM_WORLD_SIZE", n)
            local_rank = opt_int(env, "PMIX_LOCAL_RANK", n)
            local_size = opt_int(env, "PMIX_LOCAL_SIZE", n)
        node_rank = opt_int(env, "SCALEOUT_MPI_NODE_RANK", n)
        num_nodes = opt_int(env, "SCALEOUT_MPI_NUM_NODES", n)
        per_node = opt_int(env, "SCALEOUT_MPI_RANKS_PER_NODE", n)
        if per_node is not None:
            # Emulated nodes of k consecutive ranks on one host (`mpiexec -x SCALEOUT_MPI_RANKS_PER_NODE=2`):
            # mpiexec can only give every rank the same variables, so the split is computed here.
            if per_node < 1 or size % per_node:
                raise EnvironmentError_(
                    f"mpi environment: SCALEOUT_MPI_RANKS_PER_NODE={per_node} does not divide the {size} ranks"
                )
            node_rank, local_rank = divmod(rank, per_node)
            num_nodes, local_size = size // per_node, per_node
        if None in (local_rank, local_size, node_rank, num_nodes):
            local_rank, local_size, node_rank, num_nodes = _mpi_topology()
        addr, port = _master(env, n)
        return WorldSpec(
            rank=rank,
            local_rank=local_rank,
            node_rank=node_rank,
            num_nodes=num_nodes,
            local_size=local_size,
            world_size=size,
            master_addr=addr,
            master_port=port,
            launcher=n,
        )

    def rendezvous(self, spec: WorldSpec) -> tuple[str, int]:
        if spec.master_addr is not None and spec.master_port is not None:
            return spec.master_addr, spec.master_port
        from mpi4py import MPI  # noqa: PLC0415 -- only under mpirun

        comm = MPI.COMM_WORLD
        names = comm.gather(MPI.Get_processor_name(), root=0)  # ~20 bytes per rank, to rank 0 only
        payload = None
        if comm.Get_rank() == 0:
            addr = spec.master_addr or master_address(names)
            payload = (
                addr,
                spec.master_port or free_port(addr if addr != "localhost" else "127.0.0.1"),
            )
        addr, port = comm.bcast(payload, root=0)
        return addr, int(port)


def master_address(hosts: list[str], **kwargs) -> str:
    """Rank 0's rendezvous address given every rank's host name (rank 0's first): loopback when the whole
    job is on rank 0's host, else an address of rank 0's host that routes to the others (never 127.0.1.1)."""
    peers = sorted(set(hosts) - {hosts[0]})
    return "127.0.0.1" if not peers else reachable_address(peers, hosts[0], **kwargs)


def _mpi_topology() -> tuple[int, int, int, int]:
    """(local_rank, local_size, node_rank, num_nodes) from mpi4py: a node = ranks that share memory."""
    try:
        from mpi4py import MPI  # noqa: PLC0415
    except ImportError:
        raise EnvironmentError_(
            "mpi environment: local rank / node not in the variables and mpi4py is not installed "
            "(pip install 'scaleout[mpi]')"
        ) from None
    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    leader = comm.Get_rank() if local.Get_rank() == 0 else -1
    leaders = sorted(x for x in comm.allgather(leader) if x >= 0)
    my_leader = local.bcast(comm.Get_rank() if local.Get_rank() == 0 else None, root=0)
    out = (local.Get_rank(), local.Get_size(), leaders.index(my_leader), len(leaders))
    local.Free()
    return out


class HorovodEnv(Environment):
    """horovodrun: HOROVOD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE/CROSS_RANK/CROSS_SIZE.

    horovodrun's own rendezvous is an HTTP key-value store, not a torch TCPStore; unless MASTER_ADDR/PORT
    are set, rank 0 publishes its own address and a free port through that store: rank 0 need not run on
    horovodrun's host (a launch from a login node with ``-H c1:4,c2:4``).
    """

    name = "horovod"
    rank_vars = ("HOROVOD_RANK",)

    def detect(self, env: Mapping[str, str]) -> bool:
        return "HOROVOD_RANK" in env

    def read(self, env: Mapping[str, str]) -> WorldSpec:
        n = self.name
        addr, port = _master(env, n)
        return WorldSpec(
            rank=need_int(env, "HOROVOD_RANK", n),
            local_rank=need_int(env, "HOROVOD_LOCAL_RANK", n),
            node_rank=need_int(env, "HOROVOD_CROSS_RANK", n),
            num_nodes=need_int(env, "HOROVOD_CROSS_SIZE", n),
            local_size=need_int(env, "HOROVOD_LOCAL_SIZE", n),
            world_size=need_int(env, "HOROVOD_SIZE", n),
            master_addr=addr,
            master_port=port,
            launcher=n,
            extra={
                "rendezvous_addr": env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"),
                "rendezvous_port": opt_port(env, "HOROVOD_GLOO_RENDEZVOUS_PORT", n),
            },
        )

    def rendezvous(self, spec: WorldSpec) -> tuple[str, int]:
        if spec.master_addr is not None and spec.master_port is not None:
            return spec.master_addr, spec.master_port
        kv_addr, kv_port = spec.extra.get("rendezvous_addr"), spec.extra.get("rendezvous_port")
        if not kv_addr or not kv_port:
            raise EnvironmentError_(
                "horovod environment: set MASTER_ADDR/MASTER_PORT or run under horovodrun --gloo"
            )
        from scaleout.env.horovod_kv import exchange_master  # noqa: PLC0415

        # Rank 0's own address: the one that routes to horovodrun's host, which every node reaches; loopback
        # only when the whole job is on one host.
        mine = None
        if spec.rank == 0:
            mine = spec.master_addr or (
                "127.0.0.1" if spec.num_nodes == 1 else reachable_address([kv_addr])
            )
        return exchange_master(kv_addr, kv_port, spec.rank, mine, spec.master_port)


class SingleEnv(Environment):
    """No launcher: one process, world size 1."""

    name = "single"

    def detect(self, env: Mapping[str, str]) -> bool:
        return True

    def read(self, env: Mapping[str, str]) -> WorldSpec:
        addr, port = _master(env, self.name)
        return WorldSpec(
            0, 0, 0, 1, 1, 1, addr or "127.0.0.1", port, self.name, tasks_per_node=(1,)
        )

    def rendezvous(self, spec: WorldSpec) -> tuple[str, int]:
        return spec.master_addr or "127.0.0.1", spec.master_port or free_port()


ENVIRONMENTS: dict[str, Environment] = {
    e.name: e for e in (LocalEnv(), TorchrunEnv(), HorovodEnv(), MPIEnv(), SlurmEnv(), SingleEnv())
}
DETECTION_ORDER = ("local", "torchrun", "horovod", "mpi", "slurm", "single")
# Where this process's global rank is, before any World exists (scaleout.log), in detection order.
RANK_VARS = tuple(v for name in DETECTION_ORDER for v in ENVIRONMENTS[name].rank_vars)


def detect_environment(
    env: Mapping[str, str] | None = None, explicit: str | None = None
) -> Environment:
    """The environment to read: ``explicit`` (or SCALEOUT_ENV) if given and not 'auto', else the first match."""
    env = os.environ if env is None else env
    choice = explicit if explicit not in (None, "auto") else env.get("SCALEOUT_ENV")
    if choice not in (None, "", "auto"):
        if choice not in ENVIRONMENTS:
            raise EnvironmentError_(
                f"launch.env={choice!r}: expected one of auto, {', '.join(ENVIRONMENTS)}"
            )
        return ENVIRONMENTS[choice]
    for name in DETECTION_ORDER:
        if ENVIRONMENTS[name].detect(env):
            return ENVIRONMENTS[name]
    raise AssertionError("unreachable: SingleEnv always matches")
