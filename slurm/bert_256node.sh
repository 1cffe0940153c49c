#!/bin/bash
# BERT-Large pretraining to the MLPerf target (masked-LM accuracy 0.720) on 256 nodes x 8 GPUs = 2048 ranks.
#
#   sbatch slurm/bert_256node.sh [key=value config overrides]             # from the scaleout checkout
#   sbatch -N 2 --ntasks-per-node 2 slurm/bert_256node.sh <overrides>     # the same file, shrunk: runs on
#                                       the allocation's nodes (command-line options override #SBATCH lines);
#                                       another GPU count needs train.global_batch + its schedule (docs/recipes.md)
#   sbatch -N 3 --ntasks-per-node 2 slurm/bert_256node.sh launch.spares=1 ...      # + 1 spare node
#   sbatch slurm/bert_256node.sh launch.container.image=<image> ...      # ranks in a container (docs/launchers.md)
#   sbatch -J bert-try2 slurm/bert_256node.sh                             # a new run = a new name
#
# One task per GPU; every task sees all 8 GPUs of its node (--gpus-per-node, not --gpus-per-task: per-task
# device cgroups block CUDA IPC / NVLink peer-to-peer between the ranks of a node) and uses GPU local_rank.
# scaleout.init() builds the World from srun's SLURM_* variables. Shared environment: slurm/env.sh.
# Run directory runs/<RUN_NAME> (default: the job name): MLPerf log (one segment per attempt), report,
# checkpoints. Preemption: Slurm sends SIGUSR2 120 s before the time limit; the ranks agree on a step,
# checkpoint, rank 0 runs `scontrol requeue` and the requeued job resumes from the same run directory. A job
# that ended otherwise (time limit, scancel, node failure) resumes by submitting it again under the same name.
# The Slurm log slurm-<name>-<jobid>.out is written to the submit directory (it exists before sbatch opens
# the file); --open-mode=append keeps every attempt of a requeued job in it.
#SBATCH --job-name=bert-256x8
#SBATCH --nodes=256
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=02:00:00
#SBATCH --signal=USR2@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail
[ -f slurm/env.sh ] || { echo "slurm/env.sh not found in $PWD: submit from the scaleout checkout (or sbatch --chdir)" >&2; exit 2; }
source slurm/env.sh

# The training step runs under `scaleout slurm run` (scaleout/cli/slurm.py): srun --kill-on-bad-exit=1 (one
# dead rank ends the step instead of leaving 2047 ranks hanging in a collective) on the allocation's nodes
# but launch.spares (default 0) healthy ones; those are the spares. When the step dies, the node
# whose ranks stopped, hung or were killed is quarantined ($RUN_DIR/quarantine.json) and a new step starts
# on healthy nodes at once, resuming from the latest checkpoint; with too few left the job is requeued
# excluding the quarantined nodes (so is a resubmission). launch.crash_loop (default 3) attempts dying at
# the same step stop the job with one line. Attempt history: $RUN_DIR/ckpt/run.json.
exec scaleout slurm run -- scaleout train configs/bert_large_256x8.yaml \
  train.output_dir="$RUN_DIR" checkpoint.dir="$RUN_DIR/ckpt" "$@"
