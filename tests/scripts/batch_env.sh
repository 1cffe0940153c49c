#!/bin/bash
# Which environment does scaleout detect in the batch script itself (no srun) and in srun tasks?
echo "BATCH step_id=${SLURM_STEP_ID-unset} procid=${SLURM_PROCID-unset} env=$(python3 -c 'from scaleout.env import detect_environment; print(detect_environment().name)')"
srun python3 tests/scripts/world_report.py   # relative to --chdir: Slurm runs a copy of this script from its spool
