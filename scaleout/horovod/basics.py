"""Process-level part of the Horovod API: init/shutdown, ranks and sizes, reduction ops, process
sets, what the build has. Errors: :mod:`scaleout.horovod.errors`; settings:
:mod:`scaleout.horovod.settings`.

Horovod's API is global by design (``hvd.rank()`` anywhere), so this compat layer keeps one
module-level :class:`_State` holding the scaleout World and the background
:class:`~scaleout.horovod.engine.Engine`; scaleout's own code passes the World explicitly instead.

Settings come from Horovod's own environment variables, read at :func:`init`
(:func:`~scaleout.horovod.settings.settings_from_env`):

- ``HOROVOD_FUSION_THRESHOLD`` (bytes, default 128 MiB as in Horovod 0.28; 0 disables fusion),
- ``HOROVOD_CYCLE_TIME`` (ms, default 1: how long the background thread lets requests accumulate),
- ``HOROVOD_CACHE_CAPACITY`` (default 1024 response-cache entries; 0 disables the cache),
- ``HOROVOD_TIMELINE`` (a path, or ``DYNAMIC`` for :func:`start_timeline`),
  ``HOROVOD_TIMELINE_MARK_CYCLES``,
- ``HOROVOD_STALL_CHECK_TIME_SECONDS`` (default 60), ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``
  (default 0 = never),
- ``HOROVOD_HIERARCHICAL_ALLREDUCE=1`` selects the ``hierarchical`` algorithm
  (``$SCALEOUT_ALGORITHM`` wins).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from scaleout.comm import Algorithm, get_algorithm
from scaleout.horovod.engine import Engine
from scaleout.horovod.errors import HorovodNotSupportedError, HorovodValueError
from scaleout.horovod.settings import Settings, settings_from_env
from scaleout.world import init as init_world

if TYPE_CHECKING:
    from scaleout.world import World


class ReduceOp:
    """``hvd.Average``, ``hvd.Sum``, ``hvd.Min``, ``hvd.Max``, ``hvd.Product``, ``hvd.Adasum``."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"hvd.{self.name}"

    def __reduce__(self) -> str:  # pickles as the module-level singleton
        return self.name


Average = ReduceOp("Average")
Sum = ReduceOp("Sum")
Adasum = ReduceOp("Adasum")
Min = ReduceOp("Min")
Max = ReduceOp("Max")
Product = ReduceOp("Product")
OPS = (Average, Sum, Min, Max, Product)


def resolve_op(average: bool | None, op: Any, what: str = "allreduce") -> ReduceOp:
    """Horovod's ``average=`` (deprecated) / ``op=`` pair -> one op (default Average)."""
    if average is not None and op is not None:
        raise HorovodValueError(
            f"{what}: give either average= (deprecated in Horovod) or op=, not both"
        )
    if average is not None:
        return Average if average else Sum
    op = Average if op is None else op
    if op is Adasum:
        raise HorovodNotSupportedError(f"{what} op=hvd.Adasum is not supported by scaleout.horovod")
    if op not in OPS:
        raise HorovodValueError(
            f"{what} op={op!r}: expected one of hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product"
        )
    return op


# -- process sets: only the global one -------------------------------------------------------------
class ProcessSet:
    """Horovod's process set; scaleout.horovod has exactly one, :data:`global_process_set` (all
    ranks)."""

    process_set_id = 0

    def size(self) -> int:
        return size()

    def rank(self) -> int:
        return rank()

    def included(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "hvd.global_process_set"


global_process_set = ProcessSet()


def check_process_set(process_set: Any) -> None:
    if process_set is not None and process_set is not global_process_set:
        raise HorovodNotSupportedError(
            f"process_set={process_set!r}: process sets are not supported by scaleout.horovod, "
            "only hvd.global_process_set (all ranks)"
        )


def add_process_set(*_args: Any, **_kwargs: Any) -> ProcessSet:
    raise HorovodNotSupportedError(
        "hvd.add_process_set: process sets are not supported by scaleout.horovod"
    )


def remove_process_set(*_args: Any, **_kwargs: Any) -> bool:
    raise HorovodNotSupportedError(
        "hvd.remove_process_set: process sets are not supported by scaleout.horovod"
    )


class _Elastic:
    """``hvd.elastic``: any use is a one-line error (elastic mode is not implemented)."""

    def __getattr__(self, name: str) -> Any:
        raise HorovodNotSupportedError(
            f"hvd.elastic.{name}: elastic training is not supported by scaleout.horovod"
        )


elastic = _Elastic()


# -- init / shutdown -------------------------------------------------------------------------------
@dataclass
class _State:
    world: World
    algorithm: str
    owns_world: bool
    engine: Any
    settings: Settings


_state: _State | None = None


def _default_algorithm() -> str:
    return os.environ.get("SCALEOUT_ALGORITHM") or (
        "hierarchical" if os.environ.get("HOROVOD_HIERARCHICAL_ALLREDUCE") == "1" else "flat"
    )


def _prepare_groups(world: World, alg: Algorithm) -> None:
    """Create the algorithm's process groups now, in the caller's thread, in the same order on every
    rank."""
    if world.world_size < 2:
        return
    alg.prepare(world, alg.options())


def init(
    comm: Any = None,
    process_sets: Any = None,
    *,
    world: World | None = None,
    algorithm: str | None = None,
) -> None:
    """Start (or adopt, ``world=``) the scaleout World and the background thread. Called again while
    initialised, it only switches the all-reduce algorithm for the operations submitted after it."""
    global _state
    if comm is not None:
        raise HorovodNotSupportedError(
            "hvd.init(comm=...): MPI sub-communicators are not supported; pass comm=None"
        )
    if process_sets is not None:
        raise HorovodNotSupportedError(
            "hvd.init(process_sets=...): process sets are not supported by scaleout.horovod"
        )
    algorithm = algorithm or _default_algorithm()
    alg = get_algorithm(algorithm)  # one-line UserError naming the choices
    if _state is not None:
        _prepare_groups(_state.world, alg)
        _state.algorithm = algorithm
        return
    settings = settings_from_env()
    owns = world is None
    if world is None:
        world = init_world()
    _prepare_groups(world, alg)

    _state = _State(world, algorithm, owns, Engine(world, settings), settings)


def shutdown() -> None:
    """Stop the background thread (every rank must call it); close the World if :func:`init` created
    it."""
    global _state
    st, _state = _state, None
    if st is None:
        return
    try:
        st.engine.shutdown()
    finally:
        if st.owns_world:
            st.world.close()


def is_initialized() -> bool:
    return _state is not None


def state() -> _State:
    if _state is None:
        raise HorovodValueError("scaleout.horovod is not initialized: call hvd.init() first")
    return _state


def world() -> Any:
    """The scaleout World behind this API (not in Horovod)."""
    return state().world


def algorithm() -> str:
    """The all-reduce algorithm used for Sum/Average (not in Horovod)."""
    return state().algorithm


def size() -> int:
    return state().world.world_size


def rank() -> int:
    return state().world.rank


def local_rank() -> int:
    return state().world.local_rank


def local_size() -> int:
    return state().world.local_size


def cross_rank() -> int:
    """Index of this rank's node (Horovod: rank among the ranks with the same local rank)."""
    return state().world.node_rank


def cross_size() -> int:
    return state().world.num_nodes


def is_homogeneous() -> bool:
    return bool(state().world.uniform)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record a Chrome-trace timeline (negotiation and every collective) until
    :func:`stop_timeline`."""
    state().engine.start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Write the timeline (every rank's events merged into one file by rank 0). Every rank must call
    it."""
    state().engine.stop_timeline()


# What the build has, as Horovod reports it. "Built" means torch.distributed has the backend (this
# API runs on torch.distributed, so that is what scaleout.horovod was "built with"); "enabled" means
# this API uses it: gloo always carries the negotiation (and the tensors on CPU), MPI never does
# (the World's backends are gloo and NCCL; under mpiexec MPI only starts the ranks).
def mpi_threads_supported() -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def mpi_built() -> bool:
    """Whether torch.distributed has its MPI backend (scaleout.horovod itself never uses it)."""
    return dist.is_mpi_available()


def gloo_enabled() -> bool:
    return dist.is_gloo_available()


def gloo_built() -> bool:
    """Whether torch.distributed has its gloo backend."""
    return dist.is_gloo_available()


def nccl_built() -> int:
    """Horovod's NCCL_VERSION_CODE (e.g. 22105 for 2.21.5) when torch.distributed has NCCL, else
    0."""
    if not dist.is_nccl_available():
        return 0
    try:
        major, minor, patch = torch.cuda.nccl.version()[:3]
    except (RuntimeError, AttributeError, TypeError):  # a build with NCCL but no version to report
        return 1
    # NCCL's own NCCL_VERSION(X, Y, Z): X*1000 + Y*100 + Z before 2.9, X*10000 + Y*100 + Z since.
    return major * (10000 if (major, minor) >= (2, 9) else 1000) + minor * 100 + patch


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    """Whether torch was built with CUDA (not whether a GPU is visible: that is
    torch.cuda.is_available)."""
    return torch.backends.cuda.is_built()


def rocm_built() -> bool:
    return torch.version.hip is not None
