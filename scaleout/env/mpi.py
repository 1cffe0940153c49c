"""mpirun/mpiexec: Open MPI (OMPI_COMM_WORLD_*), MPICH/Hydra (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID),
PMIx.

srun's own PMI plugins (``srun --mpi=pmix|pmi2``, or ``MpiDefault`` in slurm.conf) set some of the
same variables in every task: such a task is a Slurm rank, not an MPI one (:func:`srun_pmi_task`).
"""

from __future__ import annotations

from collections.abc import Mapping

from scaleout.env.addr import reachable_address
from scaleout.env.base import Environment, WorldSpec, free_port, master, need_int, opt_int
from scaleout.env.detect import register
from scaleout.env.slurm import SlurmEnv
from scaleout.errors import LaunchEnvError

# Each MPI's variables, in the order they are looked for (the first flavour whose rank variable is
# set is read): WorldSpec field -> variable names, the first one set wins. rank and world_size are
# required; local_rank/local_size may be absent (then mpi4py tells).
FLAVOURS: dict[str, dict[str, tuple[str, ...]]] = {
    "openmpi": {
        "rank": ("OMPI_COMM_WORLD_RANK",),
        "world_size": ("OMPI_COMM_WORLD_SIZE",),
        "local_rank": ("OMPI_COMM_WORLD_LOCAL_RANK",),
        "local_size": ("OMPI_COMM_WORLD_LOCAL_SIZE",),
    },
    "mpich": {
        "rank": ("PMI_RANK",),
        "world_size": ("PMI_SIZE",),
        "local_rank": ("MPI_LOCALRANKID",),
        "local_size": ("MPI_LOCALNRANKS",),
    },
    "pmix": {
        "rank": ("PMIX_RANK",),
        "world_size": ("PMIX_SIZE", "OMPI_COMM_WORLD_SIZE"),
        "local_rank": ("PMIX_LOCAL_RANK",),
        "local_size": ("PMIX_LOCAL_SIZE",),
    },
}
# The variables of FLAVOURS that srun's own PMI plugins also set, and the Slurm value each one
# equals there (seen on the local Slurm 22.05 with Debian's libpmix 4.2,
# tests/launchers/test_slurm_pmi.py):
# --mpi=pmix sets PMIX_RANK = SLURM_PROCID, PMIX_NAMESPACE, PMIX_SERVER_URI* and no size (PMIx
# publishes it as a key, not a variable); --mpi=pmi2 sets PMI_RANK = SLURM_PROCID, PMI_SIZE = the
# step's task count, PMI_FD, PMI_JOBID. Every other variable of FLAVOURS is set by an mpirun/mpiexec
# only.
SRUN_PMI_VARS = {"PMIX_RANK": "rank", "PMI_RANK": "rank", "PMI_SIZE": "world_size"}
# scaleout's own overrides of the node layout (mpiexec -x ...).
NODE_VARS = {"node_rank": "SCALEOUT_MPI_NODE_RANK", "num_nodes": "SCALEOUT_MPI_NUM_NODES"}
RANKS_PER_NODE_VAR = "SCALEOUT_MPI_RANKS_PER_NODE"


@register
class MPIEnv(Environment):
    """mpirun/mpiexec, one of :data:`FLAVOURS`.

    Node rank and node count are not in the variables of every MPI (Open MPI 5 sets
    OMPI_COMM_WORLD_LOCAL_* but no node index); they come from mpi4py (ranks sharing memory = one
    node), which also gives the local rank, so all four agree. SCALEOUT_MPI_RANKS_PER_NODE=k
    emulates nodes of k ranks on one host. The rendezvous address and a free port are broadcast from
    rank 0 with mpi4py.
    """

    name = "mpi"
    priority = 40  # before Slurm: mpirun inside an allocation also sets SLURM_*
    rank_vars = tuple(f["rank"][0] for f in FLAVOURS.values())

    def detect(self, env: Mapping[str, str]) -> bool:
        return any(k in env for k in self.rank_vars) and not srun_pmi_task(env)

    def _get(self, env: Mapping[str, str], names: tuple[str, ...], required: bool) -> int | None:
        for var in names:
            value = opt_int(env, var, self.name)
            if value is not None:
                return value
        return need_int(env, names[-1], self.name) if required else None

    def read(self, env: Mapping[str, str]) -> WorldSpec:
        n = self.name
        # forced (launch.env=mpi) with none set: the last flavour's error names its variable
        flavours = list(FLAVOURS.values())
        flavour = next((f for f in flavours if f["rank"][0] in env), flavours[-1])
        rank = need_int(env, flavour["rank"][0], n)
        size = self._get(env, flavour["world_size"], required=True)
        local_rank = self._get(env, flavour["local_rank"], required=False)
        local_size = self._get(env, flavour["local_size"], required=False)
        node_rank = opt_int(env, NODE_VARS["node_rank"], n)
        num_nodes = opt_int(env, NODE_VARS["num_nodes"], n)
        per_node = opt_int(env, RANKS_PER_NODE_VAR, n)
        if per_node is not None:
            # Emulated nodes of k consecutive ranks on one host (`mpiexec -x
            # SCALEOUT_MPI_RANKS_PER_NODE=2`): mpiexec can only give every rank the same variables,
            # so the split is computed here.
            if per_node < 1 or size % per_node:
                raise LaunchEnvError(
                    f"mpi environment: {RANKS_PER_NODE_VAR}={per_node} does not divide the {size} "
                    "ranks"
                )
            node_rank, local_rank = divmod(rank, per_node)
            num_nodes, local_size = size // per_node, per_node
        if None in (local_rank, local_size, node_rank, num_nodes):
            local_rank, local_size, node_rank, num_nodes = _mpi_topology()
        addr, port = master(env, n)
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
        from mpi4py import MPI  # deferred: only under mpirun

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


def _as_int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def srun_pmi_task(env: Mapping[str, str]) -> bool:
    """True for an srun task whose only MPI variables are those of srun's own PMI plugin (``srun
    --mpi=pmix`` or ``--mpi=pmi2``, or a cluster's ``MpiDefault``): a Slurm rank, which the slurm
    environment reads.

    False when an mpirun/mpiexec started the process, also inside an allocation or an srun step: it
    sets variables srun never does (Open MPI's OMPI_COMM_WORLD_*, Hydra's MPI_LOCALRANKID), and its
    PMI rank or size differs from the srun task's own where srun started a launcher rather than the
    ranks (Hydra's proxies are srun tasks, one per node, and the ranks are their children; ``srun
    -n1 mpiexec -n 4``).
    """
    if not SlurmEnv().detect(env):
        return False
    flavour_vars = {v for f in FLAVOURS.values() for names in f.values() for v in names}
    if any(v in env for v in flavour_vars - SRUN_PMI_VARS.keys()):
        return False
    # srun's own rank and task count (the step's, else the job's), which its PMI plugin's variables
    # repeat
    tasks = next((env[v] for v in SlurmEnv.step_or_job["world_size"] if env.get(v)), None)
    own = {"rank": _as_int(env.get(SlurmEnv.variables["rank"])), "world_size": _as_int(tasks)}
    for var, field in SRUN_PMI_VARS.items():
        if var in env and (own[field] is None or _as_int(env[var]) != own[field]):
            return False
    return True


def master_address(hosts: list[str], **kwargs) -> str:
    """Rank 0's rendezvous address given every rank's host name (rank 0's first): loopback when
    the whole job is on rank 0's host, else an address of rank 0's host that routes to the others
    (never 127.0.1.1)."""
    peers = sorted(set(hosts) - {hosts[0]})
    return "127.0.0.1" if not peers else reachable_address(peers, hosts[0], **kwargs)


def _mpi_topology() -> tuple[int, int, int, int]:
    """(local_rank, local_size, node_rank, num_nodes) from mpi4py: a node = ranks that share
    memory."""
    try:
        from mpi4py import MPI  # deferred: only under mpirun
    except ImportError:
        raise LaunchEnvError(
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
