"""What NCCL's ring does to low-precision sums, emulated on CPU (test helper).

NCCL's ring reduce-scatter (and the reduce-scatter half of its ring all-reduce) adds one rank's
chunk per hop *in the wire dtype*: every hop's partial sum is rounded to bf16/fp16 before it is
sent on, so a ring over p ranks rounds p - 1 times, at partial sums that grow along the ring. gloo
on CPU does not (scaleout.comm.grid's row phase accumulates in fp32 and rounds once, and the CPU
tests' grids are 2 x 2), so the CPU tests see a fraction of the error a 2,048-GPU run gets.
These helpers redo the sum hop by hop in ring order for a configured grid:

* flat: one ring over all p ranks;
* hierarchical / torus2d: a ring over each row (reduce-scatter), then a ring over each column
  (the all-reduce of the shard); the all-gathers copy without arithmetic.

Each chunk c of a ring over q ranks starts at rank c + 1 and ends at its owner c (NCCL's ring
order); every chunk is emulated at once, so a 2,048-rank ring of 8,192 elements takes well under a
second.
"""

from __future__ import annotations

import torch


def ring_sum(x: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    """Sum ``x[..., q, n]`` over dimension -2 as a ring over q ranks, rounding every hop's partial
    sum to ``wire`` (computed in float64). n must be a multiple of q. Returns ``[..., n]``
    (float64)."""
    q, n = x.shape[-2], x.shape[-1]
    assert n % q == 0, (n, q)
    chunks = x.reshape(*x.shape[:-1], q, n // q).double()  # [..., rank, chunk, element]
    idx = torch.arange(q)

    def hop(k: int) -> torch.Tensor:  # chunk c's value on rank (c + k) % q
        return chunks[..., (idx + k) % q, idx, :]

    acc = hop(1)
    for k in range(2, q + 1):
        acc = (acc + hop(k)).to(wire).double()
    return acc.reshape(*x.shape[:-2], n)


def grid_sum(x: torch.Tensor, row: int, wire: torch.dtype) -> torch.Tensor:
    """Sum ``x[p, n]`` (rank r = column index * row + position in its row, as hierarchical's nodes)
    by a ring over each row, then a ring over the column; ``row == p`` is the flat ring."""
    p, n = x.shape
    rows = ring_sum(x.reshape(p // row, row, n), wire)  # [column index, n]
    return rows[0] if p == row else ring_sum(rows, wire)


def averaged_gradient_error(
    ranks: int, row: int, wire: torch.dtype | None, signal: float, n: int = 8192, seed: int = 0
) -> float:
    """Relative L2 error of the averaged gradient as the wire computes it (pre-divided by the
    world size, cast to ``wire``, ring-summed per hop, cast back) vs the exact mean. Per-rank
    gradients are ``signal * mean + noise`` (standard normal): signal 0 = noise-dominated small
    per-rank batches, 1 = ranks agreeing as much as they differ (partial sums then grow linearly
    along the ring and late terms are swamped)."""
    gen = torch.Generator().manual_seed(seed)
    g = signal * torch.randn(n, generator=gen) + torch.randn(ranks, n, generator=gen)
    dt = wire or torch.float32
    sent = (g / ranks).to(dt)
    got = grid_sum(sent, row, dt).to(dt).double()
    exact = g.double().mean(0)
    return ((got - exact).norm() / exact.norm()).item()


def sharded_node_error(
    ranks: int, row: int, wire: torch.dtype, signal: float, n: int = 8192, seed: int = 0
) -> float:
    """The same relative error for the node-sharded LAMB's compressed reduce-scatter
    (scaleout.optim.sharded ``_compressed``): each rank's gradient / p rounded once to ``wire``,
    summed in fp32 over its node (all-to-all), that node sum rounded to ``wire`` and summed in fp32
    over the nodes (all-to-all), the result rounded to ``wire`` once more (the all-gather among the
    nodes' peers): three roundings whatever the node count, never a rounding per hop."""
    gen = torch.Generator().manual_seed(seed)
    g = signal * torch.randn(n, generator=gen) + torch.randn(ranks, n, generator=gen)
    sent = (g / ranks).to(wire).float()
    node = sent.reshape(ranks // row, row, n).sum(1, dtype=torch.float32)
    total = node.to(wire).float().sum(0, dtype=torch.float32)
    got = total.to(wire).double()
    exact = g.double().mean(0)
    return ((got - exact).norm() / exact.norm()).item()
