#!/bin/bash
# Weak-scaling sweep: one array task per node count, same per-GPU batch, fixed number of steps; each task
# runs the timed training loop and writes its throughput to runs/<RUN_NAME>/<nodes>n (RUN_NAME defaults to
# the job name, so a resubmitted array writes to, and resumes in, the same folders).
#
#   sbatch slurm/scaling_sweep.sh [key=value overrides]                       # 1 .. 256 nodes
#   SWEEP_NODES="1 2" sbatch --array=0-1 -N 2 --ntasks-per-node 2 slurm/scaling_sweep.sh <overrides>  # shrunk
# The array allocates the largest size for every task and each task's srun uses the first N nodes of it
# (sbatch cannot vary --nodes inside one array); submit one job per size instead when the queue is tight.
# GPUs, CPUs, NCCL and the run directory as in slurm/bert_256node.sh (slurm/env.sh).
#SBATCH --job-name=scaleout-sweep
#SBATCH --array=0-8
#SBATCH --nodes=256
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=00:30:00
#SBATCH --signal=USR2@60
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%A_%a.out
set -euo pipefail
[ -f slurm/env.sh ] || { echo "slurm/env.sh not found in $PWD: submit from the scaleout checkout (or sbatch --chdir)" >&2; exit 2; }
source slurm/env.sh
SWEEP_NODES=(${SWEEP_NODES:-1 2 4 8 16 32 64 128 256})
CONFIG=${SWEEP_CONFIG:-configs/bert_large_256x8.yaml}
IDX=${SLURM_ARRAY_TASK_ID:-0}
NODES=${SWEEP_NODES[$IDX]:?array index $IDX has no entry in SWEEP_NODES=${SWEEP_NODES[*]}}
if (( NODES > SLURM_JOB_NUM_NODES )); then
  echo "sweep task $IDX wants $NODES nodes but the job has $SLURM_JOB_NUM_NODES" >&2; exit 2
fi
TPN=${SLURM_NTASKS_PER_NODE:-8}
OUT=$RUN_DIR/${NODES}n
echo "sweep task $IDX: $NODES nodes x $TPN tasks ($CONFIG) -> $OUT"
srun --kill-on-bad-exit=1 -N "$NODES" --ntasks-per-node "$TPN" \
  scaleout train "$CONFIG" train.output_dir="$OUT" checkpoint.dir="$OUT/checkpoints" "$@"
