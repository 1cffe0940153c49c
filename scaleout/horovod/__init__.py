"""Horovod's PyTorch API (``horovod.torch``) implemented on scaleout.

Change ``import horovod.torch as hvd`` to ``import scaleout.horovod as hvd`` and the script runs on
torch.distributed under any launcher scaleout knows (scaleout launch, srun, mpiexec, torchrun,
horovodrun), with Horovod's semantics: operations matched by name and negotiated by a background
thread, tensor fusion (``HOROVOD_FUSION_THRESHOLD``, ``HOROVOD_CYCLE_TIME``), a response cache,
``join`` for uneven inputs, the timeline (``HOROVOD_TIMELINE``), and Sum/Average reduced with
scaleout's flat, hierarchical or 2D-torus all-reduce (``hvd.init(algorithm=...)`` or
``SCALEOUT_ALGORITHM``). Not implemented (a one-line error when used): process sets other than the
global one, elastic mode, Adasum, SyncBatchNorm, MPI sub-communicators. See docs/launchers.md.
"""

from scaleout.horovod.basics import (
    Adasum,
    Average,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    algorithm,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    elastic,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
    world,
)
from scaleout.horovod.compression import Compression
from scaleout.horovod.engine import Handle
from scaleout.horovod.errors import (
    HorovodInternalError,
    HorovodNotSupportedError,
    HorovodValueError,
)
from scaleout.horovod.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from scaleout.horovod.movement import (
    allgather,
    allgather_async,
    alltoall,
    alltoall_async,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    sparse_allreduce_async,
)
from scaleout.horovod.ops import (
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    barrier,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    join,
    poll,
    synchronize,
)
from scaleout.horovod.optimizer import DistributedOptimizer
from scaleout.horovod.reducescatter import (
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
)

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "Handle",
    "HorovodInternalError",
    "HorovodNotSupportedError",
    "HorovodValueError",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "Sum",
    "add_process_set",
    "algorithm",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
    "world",
]


def __getattr__(name: str) -> object:
    if name == "SyncBatchNorm":
        raise HorovodNotSupportedError(
            "hvd.SyncBatchNorm is not provided by scaleout.horovod (Horovod's needs CUDA); "
            "use torch.nn.SyncBatchNorm or scaleout's GroupBatchNorm2d"
        )
    raise AttributeError(f"module 'scaleout.horovod' has no attribute {name!r}")
