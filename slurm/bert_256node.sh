#!/bin/bash
# BERT-Large pretraining to the MLPerf target (masked-LM accuracy 0.720) on 256 nodes x 8 GPUs = 2048 ranks.
#
#   sbatch slurm/bert_256node.sh [key=value config overrides]
#   sbatch -N 2 --ntasks-per-node 2 slurm/bert_256node.sh <overrides>   # the same file, shrunk (command-line
#                                                                      # options override #SBATCH lines)
# One task per GPU; scaleout.init() builds the World from srun's SLURM_* variables (MASTER_ADDR = first node
# of the allocation, port from the job id). Preemption: Slurm sends SIGUSR2 120 s before the time limit
# (USR2 because NCCL may catch USR1); rank 0 checkpoints and runs `scontrol requeue`, the requeued job
# resumes from checkpoint.dir. --open-mode=append keeps the log of every run of a requeued job.
#SBATCH --job-name=bert-256x8
#SBATCH --nodes=256
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-task=1
#SBATCH --exclusive
#SBATCH --time=02:00:00
#SBATCH --signal=USR2@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
mkdir -p logs

# NCCL: InfiniBand with GPUDirect RDMA when the fabric has it; fail fast and loudly on a hung collective
# instead of waiting out the job (async error handling replaces the watchdog's 30 min default).
export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}
export NCCL_NET_GDR_LEVEL=${NCCL_NET_GDR_LEVEL:-PHB}
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
# One OpenMP team per rank sized to its share of the node (data-loader workers are separate processes).
CPUS_ON_NODE=${SLURM_CPUS_ON_NODE:-$(nproc)}
TASKS_ON_NODE=${SLURM_NTASKS_PER_NODE:-8}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CPUS_ON_NODE / TASKS_ON_NODE > 0 ? CPUS_ON_NODE / TASKS_ON_NODE : 1 ))}
export SCALEOUT_PREEMPT_SIGNAL=USR2

echo "job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}: $SLURM_JOB_NUM_NODES nodes ($SLURM_JOB_NODELIST), ${SLURM_NTASKS} tasks, $(date -Is)"
# --kill-on-bad-exit: one dead rank ends the step instead of leaving 2047 ranks hanging in a collective.
srun --kill-on-bad-exit=1 scaleout train configs/bert_large_256x8.yaml checkpoint.dir="checkpoints/$SLURM_JOB_NAME-$SLURM_JOB_ID" "$@"
