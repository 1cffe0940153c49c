"""``reduce_scatter`` and ``all_gather`` over the same algorithm registry as ``all_reduce``.

The tensor-in/tensor-out pair a ZeRO-style sharded optimizer needs (apex DistributedFusedLAMB):
``reduce_scatter(out, inp, world)`` gives every rank the sum of one of ``world_size`` equal slices
of ``inp``; ``all_gather(out, inp, world)`` is its inverse, writing every rank's ``inp`` into its
slice of ``out``. Which slice a rank owns depends on the algorithm: :func:`shard_index`.

* ``flat``: torch.distributed's own collective on the world group; rank r owns slice r.
* ``hierarchical`` / ``torus2d``: the row x column grid of :mod:`scaleout.comm.grid` (rows = a
  node's ranks, or the X ranks of a torus row). Reduce-scatter along the row (every row member gets
  1/g of the buffer, summed over the row, over the fast intra-node links), then reduce-scatter of
  that part along the column (the k same-local-rank peers on other nodes): each rank ends with n/(g
  k) = n/p elements summed over every rank. A node's links carry (k-1)/k * n bytes outwards, the
  same as the hierarchical all-reduce's reduce-scatter half and g times less than a reduce-scatter
  that crossed nodes first. The owned slice is therefore ``row index * k + column index`` (not the
  global rank). The all-gather runs the two phases in reverse (column, then row).

Both phases use the tensor collectives (``reduce_scatter_single`` / ``all_gather_single``, the torch
2.13 names of ``*_tensor``), which NCCL and, since torch 2.x, gloo implement. Averaging
(``op='avg'``) divides by the world size after the sum, as ``all_reduce`` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from scaleout.comm.algorithm import get_algorithm
from scaleout.comm.api import dispatch, op_name
from scaleout.comm.grid import all_gather_tensor, reduce_scatter_tensor
from scaleout.errors import UserError
from scaleout.telemetry.profiler import traced

if TYPE_CHECKING:
    from scaleout.world import World

# the single-collective path's ops (the algorithms' runtimes: scaleout.comm.scatter)
_reduce_scatter = reduce_scatter_tensor
_all_gather = all_gather_tensor


def _resolve(world: World, algorithm: str, options: dict[str, Any], what: str) -> tuple:
    """(algorithm, its options, what it prepared in this thread: e.g. the row/column groups)."""
    alg = get_algorithm(algorithm)
    opts = alg.options(what, **options)
    return alg, opts, alg.prepare(world, opts)


def shard_index(world: World, algorithm: str = "flat", **options: Any) -> int:
    """Which of the ``world_size`` equal slices this rank owns in :func:`reduce_scatter` /
    :func:`all_gather` with this algorithm (every rank owns a different one)."""
    alg, opts, prepared = _resolve(world, algorithm, options, "shard_index")
    return alg.shard_index(world, opts, prepared)


def _check(out: torch.Tensor, inp: torch.Tensor, world: World, what: str, big: str) -> None:
    full, part = (inp, out) if big == "input" else (out, inp)
    if not (out.is_contiguous() and inp.is_contiguous()):
        raise UserError(f"{what}: input and output must be contiguous tensors")
    if out.dtype != inp.dtype or out.device != inp.device:
        raise UserError(
            f"{what}: input {inp.dtype} on {inp.device} and output {out.dtype} on {out.device} "
            "must match"
        )
    if full.numel() != part.numel() * world.world_size:
        raise UserError(
            f"{what}: the {big} has {full.numel()} elements, expected world_size "
            f"({world.world_size}) "
            f"x {part.numel()} = {part.numel() * world.world_size}"
        )


def _run(
    world: World,
    out: torch.Tensor,
    alg: Any,
    job: Any,
    native_op: Any,
    inp: torch.Tensor,
    finish: Any,
    async_op: bool,
    shard: int,
) -> Any:
    """One collective in call order: ``job`` (the algorithm's blocking runtime) then ``finish``; a
    ``single_collective`` algorithm starts ``native_op`` on the world group as one async work."""

    def native() -> Any:
        if world.world_size == 1:
            out.copy_(inp)
            return None
        return native_op(out, inp, group=world.group, async_op=True) if shard else None

    def run() -> None:
        if shard:
            job()
        finish()

    return dispatch(world, out, run, native if alg.single_collective else None, finish, async_op)


@traced(
    "reduce_scatter"
)  # a profiler range scaleout.reduce_scatter (scaleout/telemetry/profiler.py)
def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    world: World,
    algorithm: str = "flat",
    op: Any = "sum",
    async_op: bool = False,
    **options: Any,
) -> Any:
    """``output`` = sum (or average) over every rank of slice ``shard_index(world, algorithm)`` of
    ``input`` (``input.numel() == world_size * output.numel()``; both contiguous, same
    dtype/device).

    Returns ``output`` or, with ``async_op=True``, a :class:`~scaleout.comm.handles.Handle`. Ranks
    must issue their collectives in the same order, as for ``all_reduce``. ``options``: the
    algorithm's.
    """
    opname = op_name(op, "reduce_scatter")
    _check(output, input, world, "reduce_scatter", "input")
    alg, opts, prepared = _resolve(world, algorithm, options, "reduce_scatter")

    def finish() -> None:
        if opname == "avg":
            output.div_(world.world_size)

    def job() -> None:
        alg.reduce_scatter(output, input, world, opts, prepared)

    return _run(world, output, alg, job, _reduce_scatter, input, finish, async_op, output.numel())


@traced("all_gather")
def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    world: World,
    algorithm: str = "flat",
    async_op: bool = False,
    **options: Any,
) -> Any:
    """Inverse of :func:`reduce_scatter`: slice ``shard_index`` of ``output`` on every rank =
    that rank's ``input`` (``output.numel() == world_size * input.numel()``). Returns ``output``
    or a Handle."""
    _check(output, input, world, "all_gather", "output")
    alg, opts, prepared = _resolve(world, algorithm, options, "all_gather")

    def job() -> None:
        alg.all_gather(output, input, world, opts, prepared)

    return _run(world, output, alg, job, _all_gather, input, lambda: None, async_op, input.numel())
