#!/usr/bin/env bash
# The GPU half of the flagship path in one command: NCCL world of every GPU, tiny BERT bf16/fp16 training to
# its first evaluation, CUDA-graph capture, varlen attention, LAMB/LARS vs torch's fused optimizers,
# packed BERT-large tokens/s + MFU, ResNet-50 bf16 img/s at 35/64/128 per GPU (+ nvJPEG decode rate with
# torchvision), hierarchical/torus all-reduce vs NCCL (2+ GPUs). Prints a table
# (check | result | number | expected), writes bench-results/gpucheck.json, exits 1 if any check fails.
# Without CUDA the GPU rows are SKIP (with the reason) and it exits 0, unless `nvidia-smi -L` lists a GPU:
# then torch cannot see a GPU this machine has, and it exits 1 saying why. Under 8 minutes on one H100/H200.
#   bash scripts/gpu-check.sh [--setup] [--only nccl,train,...] [--out FILE]
# --setup runs scripts/setup.sh first (installs scaleout's dependencies, keeps an installed CUDA torch).
# Without it, a missing dependency stops the script in one line that says what to run. $PYTHON picks the
# interpreter (default python3: activate the venv first, or set PYTHON=.venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
args=()
setup=0
for arg in "$@"; do
  if [ "$arg" = --setup ]; then setup=1; else args+=("$arg"); fi
done
if [ $setup = 1 ]; then
  PYTHON=$PY bash scripts/setup.sh
fi
command -v "$PY" >/dev/null || { echo "gpu-check.sh: PYTHON=$PY not found: set PYTHON to the venv's python" >&2; exit 2; }
missing=$("$PY" -c '
import importlib.util
print(" ".join(m for m in ("torch", "numpy", "yaml", "pydantic", "mlperf_logging")
               if importlib.util.find_spec(m) is None))') || missing="(python failed)"
if [ -n "$missing" ]; then
  echo "gpu-check.sh: $(command -v "$PY") cannot import $missing: run 'bash scripts/setup.sh' (or this script with --setup), or set PYTHON to the venv's python" >&2
  exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m scaleout bench gpucheck ${args[@]+"${args[@]}"}
