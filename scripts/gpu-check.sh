#!/usr/bin/env bash
# The GPU half of the flagship path in one command: NCCL world of every GPU, tiny BERT bf16/fp16 training to
# its first evaluation, CUDA-graph capture, varlen attention, LAMB/LARS vs torch's fused optimizers,
# packed BERT-large tokens/s + MFU, hierarchical/torus all-reduce vs NCCL (2+ GPUs). Prints a table
# (check | result | number | expected), writes bench-results/gpucheck.json, exits 1 if any check fails.
# Without CUDA the GPU rows are SKIP (with the reason) and it exits 0. Under 8 minutes on one H100/H200.
#   bash scripts/gpu-check.sh [--only nccl,train,...] [--out FILE]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m scaleout bench gpucheck "$@"
