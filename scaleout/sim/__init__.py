"""Cost-model simulator: all-reduce algorithms and data-parallel training steps at thousands of
GPUs.

- :mod:`scaleout.sim.cluster`      link constants (alpha, beta, gamma), node shape, presets
- :mod:`scaleout.sim.collectives`  cost plans of the registered all-reduce algorithms (+ tree,
  leader), SHARP
- :mod:`scaleout.sim.sharded`      optimizer placement: replicated, ZeRO-1 over the world, sharded
  per node
- :mod:`scaleout.sim.step`         bucketed, overlapped training step, fixed per-step host cost;
  scaling sweep; time to train with MLPerf's evaluation schedule
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

from scaleout.sim.cluster import PRESETS, Cluster, Constants, get_cluster, with_sharp
from scaleout.sim.collectives import SIMULATOR_ONLY, algorithm_names, allreduce_cost
from scaleout.sim.sharded import OPTIMIZERS
from scaleout.sim.step import (
    MODELS,
    ModelSpec,
    TrainSpec,
    get_model,
    step_time,
    sweep,
    time_to_train,
)

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
