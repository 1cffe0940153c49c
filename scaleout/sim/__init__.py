"""Cost-model simulator: all-reduce algorithms and data-parallel training steps at thousands of
GPUs.

- :mod:`scaleout.sim.cluster`      link constants (alpha, beta, gamma), node shape, presets
- :mod:`scaleout.sim.collectives`  cost plans of the registered all-reduce algorithms (+ tree,
  leader), SHARP
- :mod:`scaleout.sim.sharded`      optimizer placement: replicated, ZeRO-1 over the world, sharded
  per node
- :mod:`scaleout.sim.step`         bucketed, overlapped training step, fixed per-step host cost;
  scaling sweep; time to train with MLPerf's evaluation schedule
- :mod:`scaleout.sim.overhead`     the fixed per-step cost calibrations (``--overhead``)
- :mod:`scaleout.sim.convergence`  samples to converge vs global batch: MLCommons' RCPs (installed
  mlperf-logging) or a fit to ``scaleout bench largebatch`` runs
- :mod:`scaleout.sim.fromconfig`   what a training config tells the simulator (optim.sharded,
  comm.*, batch)
- :mod:`scaleout.sim.calibrate`    fit the constants to ``scaleout bench allreduce`` JSON, held-out
  checks
- :mod:`scaleout.sim.mlperf`       published MLPerf BERT runs (from their logs) and how each is
  simulated
- :mod:`scaleout.sim.validate`     checks against published numbers (nccl-tests, MLPerf runs and a
  speed-up between two of them, Horovod)

Pure Python + numpy; no torch import, so ``scaleout simulate`` is instant.
"""

from __future__ import annotations

import importlib
from typing import Any

# Lazy: an all-reduce algorithm imports the cost algebra (scaleout.sim.cost) when it is priced, and
# that must not run the step model and the collectives table, which import the algorithms.
_LAZY = {
    "PRESETS": "scaleout.sim.cluster",
    "Cluster": "scaleout.sim.cluster",
    "Constants": "scaleout.sim.cluster",
    "get_cluster": "scaleout.sim.cluster",
    "with_sharp": "scaleout.sim.cluster",
    "SIMULATOR_ONLY": "scaleout.sim.collectives",
    "algorithm_names": "scaleout.sim.collectives",
    "allreduce_cost": "scaleout.sim.collectives",
    "OPTIMIZERS": "scaleout.sim.sharded",
    "MODELS": "scaleout.sim.step",
    "ModelSpec": "scaleout.sim.step",
    "TrainSpec": "scaleout.sim.step",
    "get_model": "scaleout.sim.step",
    "step_time": "scaleout.sim.step",
    "sweep": "scaleout.sim.step",
    "time_to_train": "scaleout.sim.step",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'scaleout.sim' has no attribute {name!r}")


__all__ = [
    "MODELS",
    "OPTIMIZERS",
    "PRESETS",
    "SIMULATOR_ONLY",
    "Cluster",
    "Constants",
    "ModelSpec",
    "TrainSpec",
    "algorithm_names",
    "allreduce_cost",
    "get_cluster",
    "get_model",
    "step_time",
    "sweep",
    "time_to_train",
    "with_sharp",
]
