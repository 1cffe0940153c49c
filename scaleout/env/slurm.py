"""An srun task: SLURM_PROCID/LOCALID/NODEID/NTASKS/NNODES/TASKS_PER_NODE/JOB_NODELIST."""

from __future__ import annotations

from collections.abc import Mapping

from scaleout.env.base import Environment, WorldSpec, master, need_int, opt_int
from scaleout.env.detect import register
from scaleout.env.nodelist import expand_nodelist, parse_tasks_per_node
from scaleout.errors import LaunchEnvError

# Linux's default net.ipv4.ip_local_port_range is 32768-60999
# (Documentation/networking/ip-sysctl.rst); used when /proc does not say.
_EPHEMERAL_LOW_DEFAULT = 32768
_PORT_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_port_low(path: str = _PORT_RANGE_FILE) -> int:
    """Low end of the kernel's ephemeral port range: ports at or above it may already be taken by
    any outgoing connection of the host, so a fixed rendezvous port must stay below it."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _EPHEMERAL_LOW_DEFAULT


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((env[k] for k in names if env.get(k)), None)


@register
class SlurmEnv(Environment):
    """An srun task.

    The step's variables (SLURM_STEP_*) are preferred over the job's: a step may use fewer nodes.
    MASTER_ADDR = first host of the nodelist, MASTER_PORT = derived from the job id, unless set.
    Checked under real srun (Slurm 22.05, tests/launchers/test_slurm.py): the batch script itself
    has
    SLURM_PROCID=0 but no SLURM_STEP_ID, so only srun tasks are detected; srun tasks get
    SLURM_STEP_ID/STEPID, SLURM_STEP_NODELIST, SLURM_STEP_NUM_NODES/NUM_TASKS and
    SLURM_STEP_TASKS_PER_NODE (``2(x2)``, ``2,1``). Tasks of ``srun --mpi=pmix`` / ``--mpi=pmi2``
    (or ``MpiDefault``) are read here too: the MPI environment, tried first, leaves them alone
    (:func:`scaleout.env.mpi.srun_pmi_task`; tests/launchers/test_slurm_pmi.py).
    """

    name = "slurm"
    # after MPI: mpirun inside an allocation also sets SLURM_* (srun's PMI variables do not count)
    priority = 50
    variables = {"rank": "SLURM_PROCID", "local_rank": "SLURM_LOCALID", "node_rank": "SLURM_NODEID"}
    # field -> (the step's variable, the job's): the step's wins when set
    step_or_job = {
        "num_nodes": ("SLURM_STEP_NUM_NODES", "SLURM_NNODES"),
        "world_size": ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
    }
    tasks_per_node_vars = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    nodelist_vars = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    step_vars = ("SLURM_STEP_ID", "SLURM_STEPID")  # older Slurm spells it STEPID
    job_id_vars = ("SLURM_JOB_ID", "SLURM_JOBID")

    PORT_BASE = 15000  # above the common service ports (databases, web, X11 at 6000+)

    def detect(self, env: Mapping[str, str]) -> bool:
        return self.variables["rank"] in env and any(k in env for k in self.step_vars)

    @staticmethod
    def port_for_job(job_id: int, ephemeral_low: int | None = None) -> int:
        """Deterministic, so every task agrees without talking: ``PORT_BASE + job_id % span``
        with the span ending just below the ephemeral range (15000..32767 on a default kernel,
        17768 ports). Every node reads its own range; the nodes of one cluster share their
        sysctls, and MASTER_PORT overrides the map where they do not."""
        low = ephemeral_port_low() if ephemeral_low is None else ephemeral_low
        base = SlurmEnv.PORT_BASE if low - SlurmEnv.PORT_BASE >= 1024 else 1024
        if low - base < 1024:
            raise LaunchEnvError(
                f"slurm environment: the ephemeral port range starts at {low} "
                f"({_PORT_RANGE_FILE}), "
                "leaving no room for a rendezvous port below it: set MASTER_PORT"
            )
        return base + job_id % (low - base)

    def _step_or_job(self, env: Mapping[str, str], field: str) -> int:
        step, job = self.step_or_job[field]
        return opt_int(env, step, self.name) or need_int(env, job, self.name)

    def read(self, env: Mapping[str, str]) -> WorldSpec:
        n = self.name
        if not any(k in env for k in self.step_vars):  # forced (launch.env=slurm) in a batch shell
            raise LaunchEnvError(
                "slurm environment: SLURM_STEP_ID is not set, so srun did not start this process "
                "(the batch script itself is not a rank): run it as `srun scaleout train ...`"
            )
        nnodes = self._step_or_job(env, "num_nodes")
        ntasks = self._step_or_job(env, "world_size")
        tpn_raw = _first(env, self.tasks_per_node_vars)
        if not tpn_raw:
            raise LaunchEnvError("slurm environment: SLURM_TASKS_PER_NODE is not set")
        tpn = parse_tasks_per_node(tpn_raw, nnodes)
        if sum(tpn) != ntasks:
            raise LaunchEnvError(
                f"slurm environment: SLURM_TASKS_PER_NODE={tpn_raw!r} sums to {sum(tpn)}, expected "
                f"SLURM_NTASKS={ntasks}"
            )
        v = self.read_ints(env)
        node_id = v["node_rank"]
        if not 0 <= node_id < nnodes:
            raise LaunchEnvError(f"slurm environment: SLURM_NODEID={node_id} not in [0, {nnodes})")
        addr, port = master(env, n)
        nodelist = _first(env, self.nodelist_vars)
        hosts = expand_nodelist(nodelist) if nodelist else []
        if addr is None:
            if not hosts:
                raise LaunchEnvError(
                    "slurm environment: neither MASTER_ADDR nor SLURM_JOB_NODELIST is set"
                )
            addr = hosts[0]
        if port is None:
            step_job, job_job = self.job_id_vars
            job = opt_int(env, step_job, n) or need_int(env, job_job, n)
            port = self.port_for_job(job)
        return WorldSpec(
            rank=v["rank"],
            local_rank=v["local_rank"],
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
