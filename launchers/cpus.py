"""Each Slurm task's share of its node's CPUs, for the launchers that write their own batch script
(``scaleout launch --launcher slurm``'s ``sbatch --wrap`` and submitit's executor).

Slurm's default is one CPU per task, bound to it (task/affinity and cgroups), with ``DefMemPerCPU``
memory. That one core would carry the rank, its data-loader workers, the pin thread, NCCL's proxy
threads and inductor's compile workers (review gpu-day-two §13). The node's core count is only
known on the node, so the share is computed there, at run time, with the same arithmetic as
``slurm/env.sh``: ``SLURM_CPUS_ON_NODE / tasks per node`` (at least 1), unless the job asked for
``--cpus-per-task`` (``SLURM_CPUS_PER_TASK``) or the user exported ``SRUN_CPUS_PER_TASK``. srun >=
22.05 reads ``SRUN_CPUS_PER_TASK``; it no longer inherits the batch allocation's value. A GPU job
asks for whole nodes (``--exclusive``), so the node's CPUs are the job's to share.
"""

from __future__ import annotations

CPUS_VAR = "SRUN_CPUS_PER_TASK"


def cpu_share_lines(tasks_per_node: int) -> list[str]:
    """POSIX-shell lines that export each task's CPU share (and a matching OpenMP width)."""
    n = max(1, int(tasks_per_node))
    share = f"$(( ${{SLURM_CPUS_ON_NODE:-1}} / {n} > 0 ? ${{SLURM_CPUS_ON_NODE:-1}} / {n} : 1 ))"
    return [
        f'export {CPUS_VAR}="${{{CPUS_VAR}:-${{SLURM_CPUS_PER_TASK:-{share}}}}}"',
        f'export OMP_NUM_THREADS="${{OMP_NUM_THREADS:-${CPUS_VAR}}}"',
    ]
