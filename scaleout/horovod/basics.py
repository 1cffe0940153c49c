"""The process-level part of the Horovod API on scaleout: init, ranks and sizes, all-reduce, broadcast.

Horovod's API is global by design (``hvd.rank()`` anywhere), so this compat layer keeps one module-level
:class:`_State` holding the scaleout World; scaleout's own code passes the World explicitly instead.
All-reduces go through ``scaleout.comm.all_reduce`` with the algorithm chosen at init: ``algorithm=``,
else $SCALEOUT_ALGORITHM, else ``hierarchical`` when Horovod's own HOROVOD_HIERARCHICAL_ALLREDUCE=1,
else ``flat``. Collectives must be issued in the same order on every rank (Horovod negotiates the order
by tensor name; torch.distributed, and so scaleout, matches by call order).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from scaleout.errors import UserError
from scaleout.horovod.compression import Compression


class _Op:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"hvd.{self.name}"


Average = _Op("Average")
Sum = _Op("Sum")


@dataclass
class _State:
    world: Any
    algorithm: str
    owns_world: bool


_state: _State | None = None


def init(comm: Any = None, *, world: Any = None, algorithm: str | None = None) -> None:
    """Start (or adopt) the scaleout World. ``comm`` is accepted for signature compatibility and must be None."""
    global _state
    if comm is not None:
        raise UserError("scaleout.horovod.init(comm=...): MPI sub-communicators are not supported; pass comm=None")
    from scaleout.comm import get_algorithm

    if algorithm is None:
        algorithm = os.environ.get("SCALEOUT_ALGORITHM") or (
            "hierarchical" if os.environ.get("HOROVOD_HIERARCHICAL_ALLREDUCE") == "1" else "flat"
        )
    get_algorithm(algorithm)  # one-line UserError naming the choices
    if _state is not None:
        _state.algorithm = algorithm
        return
    owns = world is None
    if world is None:
        import scaleout

        world = scaleout.init()
    _state = _State(world, algorithm, owns)


def shutdown() -> None:
    global _state
    if _state is not None and _state.owns_world:
        _state.world.close()
    _state = None


def is_initialized() -> bool:
    return _state is not None


def _s() -> _State:
    if _state is None:
        raise UserError("scaleout.horovod is not initialized: call hvd.init() first")
    return _state


def world() -> Any:
    """The scaleout World behind this API (not in Horovod)."""
    return _s().world


def algorithm() -> str:
    return _s().algorithm


def size() -> int:
    return _s().world.world_size


def rank() -> int:
    return _s().world.rank


def local_rank() -> int:
    return _s().world.local_rank


def local_size() -> int:
    return _s().world.local_size


def cross_rank() -> int:
    """Index of this rank's node (Horovod: rank among the ranks with the same local rank)."""
    return _s().world.node_rank


def cross_size() -> int:
    return _s().world.num_nodes


def mpi_threads_supported() -> bool:
    return False


# -- all-reduce -----------------------------------------------------------------------------------------
class Handle:
    """What ``allreduce_async`` returns; pass it to :func:`synchronize` (or :func:`poll`)."""

    def __init__(self, inner: Any, output: torch.Tensor, ctx: Any, compression: Any, postscale: float,
                 target: torch.Tensor | None):
        self.inner, self.output, self.ctx = inner, output, ctx
        self.compression, self.postscale, self.target = compression, postscale, target


def _resolve_op(average: bool | None, op: _Op | None) -> _Op:
    if average is not None and op is not None:
        raise UserError("allreduce: give either average= (deprecated in Horovod) or op=, not both")
    if average is not None:
        return Average if average else Sum
    op = Average if op is None else op
    if op not in (Average, Sum):
        raise UserError(f"allreduce op={op!r}: expected hvd.Average or hvd.Sum (Adasum is not supported)")
    return op


def _start(tensor: torch.Tensor, average: bool | None, op: _Op | None, compression: Any,
           prescale_factor: float, postscale_factor: float, inplace: bool) -> Handle:
    from scaleout.comm import all_reduce

    st = _s()
    op = _resolve_op(average, op)
    wire, ctx = compression.compress(tensor)
    if wire is tensor and not inplace:
        wire = tensor.clone()
    if prescale_factor != 1.0:
        wire.mul_(prescale_factor)
    inner = all_reduce(wire, st.world, algorithm=st.algorithm, op="avg" if op is Average else "sum", async_op=True)
    return Handle(inner, wire, ctx, compression, postscale_factor, tensor if inplace else None)


def synchronize(handle: Handle) -> torch.Tensor:
    """Wait for an async all-reduce and return its result (the input tensor itself for the ``_`` forms)."""
    handle.inner.wait()
    out = handle.compression.decompress(handle.output, handle.ctx)
    if handle.postscale != 1.0:
        out.mul_(handle.postscale)  # a buffer of ours, or the caller's tensor for the in-place forms
    if handle.target is not None and out is not handle.target:
        handle.target.copy_(out)
        return handle.target
    return out


def poll(handle: Handle) -> bool:
    return handle.inner.is_completed()


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: _Op | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    compression: Any = Compression.none) -> Handle:
    return _start(tensor, average, op, compression, prescale_factor, postscale_factor, inplace=False)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: _Op | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     compression: Any = Compression.none) -> Handle:
    return _start(tensor, average, op, compression, prescale_factor, postscale_factor, inplace=True)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: _Op | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0) -> torch.Tensor:
    """Average (default) or sum over all ranks; returns a new tensor, ``tensor`` is left unchanged."""
    return synchronize(allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor, compression))


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: _Op | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               compression: Any = Compression.none) -> torch.Tensor:
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, compression))


# -- broadcast ------------------------------------------------------------------------------------------
def _check_root(root_rank: int) -> None:
    if not 0 <= root_rank < size():
        raise UserError(f"root_rank={root_rank}: expected a rank in [0, {size()})")


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    _check_root(root_rank)
    dist.broadcast(tensor, src=root_rank)
    return tensor


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    return broadcast_(tensor.clone(), root_rank, name)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    _check_root(root_rank)
    box = [obj if rank() == root_rank else None]
    dist.broadcast_object_list(box, src=root_rank)
    return box[0]


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    out: list[Any] = [None] * size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """``model.state_dict()`` or ``model.named_parameters()`` -> every rank gets root's values, in place.
    Sorted by name (as Horovod does) so that every rank broadcasts in the same order."""
    _check_root(root_rank)
    items = sorted(params.items()) if isinstance(params, dict) else sorted(params, key=lambda kv: kv[0])
    with torch.no_grad():
        for name, value in items:
            if not isinstance(value, torch.Tensor):
                raise UserError(f"broadcast_parameters: {name!r} is a {type(value).__name__}, expected a tensor")
            dist.broadcast(value.data if hasattr(value, "data") else value, src=root_rank)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Every rank loads root's ``optimizer.state_dict()`` (state tensors and hyper-parameters)."""
    state = broadcast_object(optimizer.state_dict() if rank() == root_rank else None, root_rank)
    if rank() != root_rank:
        optimizer.load_state_dict(state)
