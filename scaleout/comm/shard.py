"""The runtimes of ``reduce_scatter`` and ``all_gather`` (called through
:class:`scaleout.comm.collective.Collective`, like ``all_reduce``).

The tensor-in/tensor-out pair a ZeRO-style sharded optimizer needs (apex DistributedFusedLAMB):
``reduce_scatter(out, inp, world)`` gives every rank the sum of one of ``world_size`` equal slices
of ``inp``; ``all_gather(out, inp, world)`` is its inverse, writing every rank's ``inp`` into its
slice of ``out``. Which slice a rank owns depends on the algorithm: ``shard_index``.

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

from scaleout.comm.api import dispatch
from scaleout.comm.grid import all_gather_tensor, reduce_scatter_tensor
from scaleout.errors import UserError

if TYPE_CHECKING:
    from scaleout.world import World

_reduce_scatter = reduce_scatter_tensor
_all_gather = all_gather_tensor


def check(out: torch.Tensor, inp: torch.Tensor, world: World, what: str, big: str) -> None:
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


def run(
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

    def blocking() -> None:
        if shard:
            job()
        finish()

    return dispatch(
        world, out, blocking, native if alg.single_collective else None, finish, async_op
    )
