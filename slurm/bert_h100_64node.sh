#!/bin/bash
# BERT-large to the MLPerf target (masked-LM accuracy 0.720) on 64 DGX H100 nodes x 8 GPUs = 512 ranks,
# NVIDIA's MLPerf hyper-parameters for this size (configs/bert_large_h100_64x8.yaml cites the file and its variables).
#
#   sbatch slurm/bert_h100_64node.sh [key=value config overrides]          # from the scaleout checkout
#   sbatch slurm/bert_h100_64node.sh launch.container.image=nvcr.io#nvidia/pytorch:24.01-py3 \
#       launch.container.mounts=/lustre/mlperf:/data/mlperf,$PWD:$PWD launch.container.workdir=$PWD  # pyxis
#   sbatch -N 65 slurm/bert_h100_64node.sh launch.spares=1                  # + 1 spare node
#
# The step runs on the allocation's nodes minus launch.spares (sbatch -N k runs on k nodes); on another
# number of GPUs than 512 the recipe's schedule does not hold and the job stops with one line unless the
# command line gives train.global_batch with its schedule (docs/recipes.md). Containers, the supervisor
# (`scaleout slurm run`, outside the image) and everything else: as slurm/bert_256node.sh, docs/launchers.md.
#SBATCH --job-name=bert-h100-64x8
#SBATCH --nodes=64
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=00:15:00
#SBATCH --signal=USR2@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail
[ -f slurm/env.sh ] || { echo "slurm/env.sh not found in $PWD: submit from the scaleout checkout (or sbatch --chdir)" >&2; exit 2; }
source slurm/env.sh
exec scaleout slurm run -- scaleout train configs/bert_large_h100_64x8.yaml \
  train.output_dir="$RUN_DIR" checkpoint.dir="$RUN_DIR/ckpt" "$@"
