#!/usr/bin/env bash
# The one-GPU deep check in one command (< 8 minutes on one H100/H200): several ranks sharing the GPU
# over gloo through the real trainer and comm stream, a captured real NCCL op with the pin thread
# alive, the NCCL watchdog path, the JPEG race, group BN's kernels, the cold compile time, the
# flagship BERT-large step. Parts run in priority order, each in its own process under its own cap;
# a table (part | result | number | seconds) at the end, bench-results/gpudeep.json, exit 1 if any
# part FAILs. Without CUDA every part is SKIP ("no GPU") and it exits 0, unless `nvidia-smi -L`
# lists a GPU torch cannot see (exit 1). docs/testing.md says how to read it.
#   bash scripts/gpu-deep-check.sh [--only facts,emu,...] [--out FILE]
# $PYTHON picks the interpreter (default python3); SCALEOUT_DEEP_DIR=DIR keeps every part's log.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || { echo "gpu-deep-check.sh: PYTHON=$PY not found: set PYTHON to the venv's python" >&2; exit 2; }
missing=$("$PY" -c '
import importlib.util
print(" ".join(m for m in ("torch", "numpy", "yaml", "pydantic", "mlperf_logging", "PIL")
               if importlib.util.find_spec(m) is None))') || missing="(python failed)"
if [ -n "$missing" ]; then
  echo "gpu-deep-check.sh: $(command -v "$PY") cannot import $missing: run 'bash scripts/setup.sh', or set PYTHON to the venv's python" >&2
  exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" -m scaleout bench gpudeep "$@"
