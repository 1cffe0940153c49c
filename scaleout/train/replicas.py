"""The replica vote: data parallelism keeps every replica bit-identical, so a rank whose weights
differ from the others' was corrupted (a bad GPU's silent data corruption, a flipped bit in host
memory) or ran different code.

Each rank reduces its parameters to one 64-bit checksum (:func:`digest`: every tensor's bits read
as integers and summed, wrapping, weighted by the tensor's index): exact and independent of the
summation order, so equal replicas give equal checksums on any device, and any single flipped bit
changes it. The vote is cheap enough to run every ``train.replica_vote_every`` steps, not only at
the end (silent corruption shows up mid-run): one read-only pass over the weights (one small
reduction per tensor: a few ms for BERT-large's 1.3 GB on a GPU, against a step of hundreds of ms,
once every hundred steps) and one all-reduce MAX of two int64 values, whose
host read is O(1) in the world size. Only when they differ does every rank all-gather the
checksums (8 bytes a rank: 16 KiB at 2,048 ranks) to name the odd ones. When a strict majority of
ranks agrees, the ranks outside it are the odd ones out and their nodes are named; a tie (two
halves that disagree) says the replicas differ without naming anyone. Under ``scaleout slurm run``
rank 0 leaves the vote in the attempt's verdict folder and the supervisor quarantines the named
nodes (source ``replica-vote``), so the requeue and every later start of the run avoid them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from scaleout.world import World


@dataclass(frozen=True)
class Vote:
    consistent: bool
    odd_ranks: list[int] = field(default_factory=list)  # empty when consistent or a tie
    odd_nodes: list[int] = field(default_factory=list)  # node indices of odd_ranks

    def sentence(self, world_size: int) -> str:
        if self.consistent:
            return f"replica vote: all {world_size} replicas agree"
        if not self.odd_ranks:
            return "replica vote: the replicas differ and no strict majority agrees: no rank named"
        return (
            f"replica vote: ranks {self.odd_ranks} (node {', '.join(map(str, self.odd_nodes))}) "
            f"hold weights that differ from the other {world_size - len(self.odd_ranks)} ranks'"
        )


# Signed integer dtype of each element size: a tensor's bits are read through it.
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def digest(model: torch.nn.Module) -> torch.Tensor:
    """One int64 checksum per replica (module docstring), on the parameters' device."""
    with torch.no_grad():
        parts = []
        for k, p in enumerate(model.parameters()):
            flat = p.detach().contiguous().view(-1)
            bits = flat.view(_BITS[flat.element_size()]) if flat.is_floating_point() else flat
            # the index weight: two tensors swapped (or corrupted alike) still change the sum
            parts.append(bits.sum(dtype=torch.int64) * (k + 1))
        if not parts:
            return torch.zeros(1, dtype=torch.int64)
        return torch.stack(parts).sum().reshape(1)


def odd_ones_out(digests: Sequence[float]) -> list[int] | None:
    """None when every digest is equal; else the indices outside the strict majority's value
    (an empty list: no value has a strict majority)."""
    if len(set(digests)) <= 1:
        return None
    value, count = Counter(digests).most_common(1)[0]
    if 2 * count <= len(digests):
        return []
    return [i for i, d in enumerate(digests) if d != value]


def vote(model: torch.nn.Module, world: World) -> Vote:
    """Every rank calls it at the same step; every rank gets the same Vote. One all-reduce MAX of
    (checksum, -checksum) says whether all agree; only when not, an all-gather names the odd."""
    if world.world_size == 1:
        return Vote(True)
    mine = digest(model).to(world.device)
    bounds = torch.cat([mine, -mine])
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
    high, minus_low = bounds.tolist()
    if high == -minus_low:
        return Vote(True)
    everyone = torch.zeros(world.world_size, dtype=mine.dtype, device=mine.device)
    dist.all_gather_into_tensor(everyone, mine)
    odd = odd_ones_out(everyone.tolist())
    if odd is None:
        return Vote(True)
    nodes = sorted({world.node_of[r] for r in odd if r < len(world.node_of)})
    return Vote(False, odd, nodes)
