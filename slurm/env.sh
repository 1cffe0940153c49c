# Sourced by the batch scripts in slurm/ (not run on its own): the environment every rank of a scaleout job
# shares, and the job's run directory. Every value is a default: a variable the user already exported before
# sbatch wins (sbatch passes the submitting shell's environment to the job).

# NCCL: InfiniBand with GPUDirect RDMA when the fabric has it.
export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}
# NCCL_NET_GDR_LEVEL is left to NCCL, which picks GPUDirect RDMA from the PCI topology.
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# TORCH_NCCL_ASYNC_ERROR_HANDLING is deliberately not set here: scaleout.init() sets 3 (skip clean-up: the
# watchdog ends the process at once, torch 2.13's own default) when it is unset, so a hung or dead peer
# ends the step through --kill-on-bad-exit. 1 would first abort the communicators, which can itself hang
# and hold every GPU of the job until its time limit. A value exported before sbatch is still respected.

# CPUs: each task gets its share of the CPUs Slurm reports for the node (the scripts ask for --exclusive), or
# what `sbatch --cpus-per-task` asked for. srun >= 22.05 no longer inherits --cpus-per-task from the batch
# allocation: SRUN_CPUS_PER_TASK passes it on. Tasks are bound to their cores (SLURM_CPU_BIND = srun
# --cpu-bind) and laid out in blocks (SLURM_DISTRIBUTION = srun -m): on an 8-GPU, 2-socket node, local ranks
# 0-3 share the socket of GPUs 0-3. Data-loader workers are processes and run on the task's cores too.
_tasks_on_node=${SLURM_NTASKS_PER_NODE:-1}
_cpus_on_node=${SLURM_CPUS_ON_NODE:-$(nproc)}
_cpus_per_task=$(( _cpus_on_node / _tasks_on_node > 0 ? _cpus_on_node / _tasks_on_node : 1 ))
export SRUN_CPUS_PER_TASK=${SRUN_CPUS_PER_TASK:-${SLURM_CPUS_PER_TASK:-$_cpus_per_task}}
export SLURM_CPU_BIND=${SLURM_CPU_BIND:-cores}
export SLURM_DISTRIBUTION=${SLURM_DISTRIBUTION:-block:block}
# One OpenMP team per rank, as wide as its CPUs.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$SRUN_CPUS_PER_TASK}

# Preemption notice: #SBATCH --signal=USR2@120 (USR2 because NCCL may install its own USR1 handler).
export SCALEOUT_PREEMPT_SIGNAL=${SCALEOUT_PREEMPT_SIGNAL:-USR2}

# The run directory (MLPerf log, report, checkpoints) is keyed by the run's NAME, never by the job id: a
# requeued job keeps its id, but a manual resubmission gets a new one and must still find the checkpoints.
# RUN_NAME defaults to the job name (sbatch -J); a new run needs a new name.
RUN_NAME=${RUN_NAME:-${SLURM_JOB_NAME:-scaleout}}
case "$RUN_NAME" in
  "" | */* | .*) echo "RUN_NAME='$RUN_NAME': expected a plain name (no '/', not starting with '.')" >&2; exit 2 ;;
esac
RUN_DIR=${RUN_ROOT:-runs}/$RUN_NAME
mkdir -p "$RUN_DIR"
echo "job ${SLURM_JOB_ID:-?} restart ${SLURM_RESTART_COUNT:-0}: ${SLURM_JOB_NUM_NODES:-?} nodes (${SLURM_JOB_NODELIST:-?}), ${SLURM_NTASKS:-?} tasks x ${SRUN_CPUS_PER_TASK} CPUs, run dir $RUN_DIR, $(date -Is)"
