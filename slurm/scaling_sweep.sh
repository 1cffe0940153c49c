#!/bin/bash
# Weak-scaling sweep: one array task per node count, same per-GPU batch, fixed number of steps; each task
# runs the timed training loop and writes its throughput to runs/sweep-<array job>/<nodes>n.
#
#   sbatch slurm/scaling_sweep.sh [key=value overrides]                       # 1 .. 256 nodes
#   SWEEP_NODES="1 2" sbatch --array=0-1 -N 2 --ntasks-per-node 2 slurm/scaling_sweep.sh <overrides>  # shrunk
# The array allocates the largest size for every task and each task's srun uses the first N nodes of it
# (sbatch cannot vary --nodes inside one array); submit one job per size instead when the queue is tight.
#SBATCH --job-name=scaleout-sweep
#SBATCH --array=0-8
#SBATCH --nodes=256
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-task=1
#SBATCH --exclusive
#SBATCH --time=00:30:00
#SBATCH --signal=USR2@60
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%A_%a.out
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
mkdir -p logs
SWEEP_NODES=(${SWEEP_NODES:-1 2 4 8 16 32 64 128 256})
CONFIG=${SWEEP_CONFIG:-configs/bert_large_256x8.yaml}
IDX=${SLURM_ARRAY_TASK_ID:-0}
NODES=${SWEEP_NODES[$IDX]:?array index $IDX has no entry in SWEEP_NODES=${SWEEP_NODES[*]}}
if (( NODES > SLURM_JOB_NUM_NODES )); then
  echo "sweep task $IDX wants $NODES nodes but the job has $SLURM_JOB_NUM_NODES" >&2; exit 2
fi
TPN=${SLURM_NTASKS_PER_NODE:-8}
export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0} NCCL_DEBUG=${NCCL_DEBUG:-WARN} TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export SCALEOUT_PREEMPT_SIGNAL=USR2
OUT=runs/sweep-${SLURM_ARRAY_JOB_ID:-$SLURM_JOB_ID}/${NODES}n
echo "sweep task $IDX: $NODES nodes x $TPN tasks ($CONFIG) -> $OUT"
srun --kill-on-bad-exit=1 -N "$NODES" --ntasks-per-node "$TPN" \
  scaleout train "$CONFIG" train.output_dir="$OUT" checkpoint.dir="$OUT/checkpoints" "$@"
