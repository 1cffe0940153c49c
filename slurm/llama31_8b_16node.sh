#!/bin/bash
# MLPerf llama31_8b (Llama 3.1 8B on C4 to log-perplexity 3.3) on 16 nodes x 8 GPUs = 128 ranks: the
# largest data-parallel width the benchmark's RCPs cover (global batch 128 sequences, one per GPU).
# Recipe and sources: configs/llama31_8b_16x8.yaml; guide: docs/llama.md.
#
#   sbatch slurm/llama31_8b_16node.sh [key=value config overrides]        # from the scaleout checkout
#   sbatch -N 2 --ntasks-per-node 2 slurm/llama31_8b_16node.sh launch.nnodes=2 launch.nproc_per_node=2 \
#       train.global_batch=4 <overrides>                                  # the same file, shrunk
#
# One task per GPU, every task sees its node's 8 GPUs (as slurm/bert_256node.sh, which explains the
# rest: slurm/env.sh, the run directory, SIGUSR2 checkpoint + requeue, spare nodes under
# `scaleout slurm run`).
#SBATCH --job-name=llama31-8b-16x8
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --signal=USR2@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail
[ -f slurm/env.sh ] || { echo "slurm/env.sh not found in $PWD: submit from the scaleout checkout (or sbatch --chdir)" >&2; exit 2; }
source slurm/env.sh

exec scaleout slurm run -- scaleout train configs/llama31_8b_16x8.yaml \
  train.output_dir="$RUN_DIR" checkpoint.dir="$RUN_DIR/ckpt" "$@"
