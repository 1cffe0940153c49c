#!/bin/bash
# Weak-scaling sweep: one job per node count, each allocating exactly its nodes, the same per-GPU batch at
# every size (train.global_batch = SWEEP_BATCH_PER_GPU x nodes x tasks per node); each job runs the timed
# training loop and writes its throughput to runs/<RUN_NAME>/<nodes>n (RUN_NAME defaults to the job name,
# the same for every point, so a resubmitted point writes to, and resumes in, its own folder).
#
#   bash slurm/scaling_sweep.sh [key=value overrides]         # submits 1 .. 256 nodes, one sbatch per size
#   SWEEP_NODES="1 2" SWEEP_TASKS_PER_NODE=2 bash slurm/scaling_sweep.sh <overrides>           # shrunk
#   sbatch -N 4 slurm/scaling_sweep.sh <overrides>             # one point: the size of the job it runs in
#
# Run with bash (outside a job) it submits itself once per entry of SWEEP_NODES (default 1 2 4 ... 256) with
# `sbatch -N <n> --ntasks-per-node <SWEEP_TASKS_PER_NODE, default 8>`: a point holds only the nodes it uses
# (a job array would hold the largest size for every task). Inside a job it runs one point on all of the
# job's nodes. SWEEP_BATCH_PER_GPU: rows per GPU per step (default: the config's own, 2 for
# bert_large_256x8 = 4096 / 2048 GPUs, 35 for resnet50_128x8; required for another SWEEP_CONFIG).
# GPUs, CPUs, NCCL and the run directory as in slurm/bert_256node.sh (slurm/env.sh).
#SBATCH --job-name=scaleout-sweep
#SBATCH --nodes=256
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=00:30:00
#SBATCH --signal=USR2@60
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail
[ -f slurm/env.sh ] || { echo "slurm/env.sh not found in $PWD: submit from the scaleout checkout (or sbatch --chdir)" >&2; exit 2; }
CONFIG=${SWEEP_CONFIG:-configs/bert_large_256x8.yaml}
case "$CONFIG" in
  configs/bert_large_256x8.yaml) default_per_gpu=2 ;;
  configs/resnet50_128x8.yaml) default_per_gpu=35 ;;
  *) default_per_gpu= ;;
esac
PER_GPU=${SWEEP_BATCH_PER_GPU:-$default_per_gpu}
[[ "$PER_GPU" =~ ^[1-9][0-9]*$ ]] || { echo "SWEEP_BATCH_PER_GPU='$PER_GPU': expected rows per GPU (an integer >= 1) for SWEEP_CONFIG=$CONFIG" >&2; exit 2; }
for arg in "$@"; do
  case $arg in
    train.global_batch=*) echo "$arg: a weak-scaling sweep sets train.global_batch per point; set SWEEP_BATCH_PER_GPU instead" >&2; exit 2 ;;
  esac
done

if [ -z "${SLURM_JOB_ID:-}" ]; then  # the submitter: one job per size, each sized to its point
  TPN=${SWEEP_TASKS_PER_NODE:-8}
  NAME=${RUN_NAME:-scaleout-sweep}
  for n in ${SWEEP_NODES:-1 2 4 8 16 32 64 128 256}; do
    [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "SWEEP_NODES entry '$n': expected a node count >= 1" >&2; exit 2; }
    job=$(sbatch -N "$n" --ntasks-per-node "$TPN" -J "$NAME" \
      --export="ALL,SWEEP_CONFIG=$CONFIG,SWEEP_BATCH_PER_GPU=$PER_GPU" "$0" "$@")
    echo "sweep point $n nodes x $TPN tasks, global batch $((PER_GPU * n * TPN)): $job"
  done
  exit 0
fi

source slurm/env.sh
NODES=${SLURM_JOB_NUM_NODES:?not set: run this script with bash to submit the sweep, or with sbatch}
TPN=${SLURM_NTASKS_PER_NODE:-8}
TPN=${TPN%%(*}  # 8(x4) -> 8
BATCH=$((PER_GPU * NODES * TPN))
OUT=$RUN_DIR/${NODES}n
echo "sweep point: $NODES nodes x $TPN tasks, $PER_GPU rows per GPU = global batch $BATCH ($CONFIG) -> $OUT"
srun --kill-on-bad-exit=1 -N "$NODES" --ntasks-per-node "$TPN" \
  scaleout train "$CONFIG" train.global_batch="$BATCH" train.output_dir="$OUT" checkpoint.dir="$OUT/checkpoints" "$@"
