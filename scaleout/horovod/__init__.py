"""A drop-in subset of ``horovod.torch`` implemented on scaleout.

Change ``import horovod.torch as hvd`` to ``import scaleout.horovod as hvd`` and the script's all-reduces
run on scaleout.comm, so it gains the hierarchical and 2D-torus algorithms
(``SCALEOUT_ALGORITHM=hierarchical`` or ``hvd.init(algorithm="torus2d")``) and runs under any launcher
scaleout knows: ``scaleout launch``, srun, mpiexec, torchrun, horovodrun. See docs/launchers.md.
"""

from scaleout.horovod.basics import (
    Average,
    Handle,
    Sum,
    algorithm,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    broadcast,
    broadcast_,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    cross_rank,
    cross_size,
    init,
    is_initialized,
    local_rank,
    local_size,
    mpi_threads_supported,
    poll,
    rank,
    shutdown,
    size,
    synchronize,
    world,
)
from scaleout.horovod.compression import Compression
from scaleout.horovod.optimizer import DistributedOptimizer

__all__ = [
    "Average", "Compression", "DistributedOptimizer", "Handle", "Sum", "algorithm", "allgather_object", "allreduce",
    "allreduce_", "allreduce_async", "allreduce_async_", "broadcast", "broadcast_", "broadcast_object",
    "broadcast_optimizer_state", "broadcast_parameters", "cross_rank", "cross_size", "init", "is_initialized",
    "local_rank", "local_size", "mpi_threads_supported", "poll", "rank", "shutdown", "size", "synchronize", "world",
]
