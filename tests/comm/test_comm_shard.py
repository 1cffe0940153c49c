"""reduce_scatter / all_gather of scaleout.comm on real gloo processes: every algorithm gives
each rank the sum of the slice ``shard_index`` names (every slice owned once), all_gather inverts
it, async handles and bad input. One run_dist call per world shape batches every check."""

from __future__ import annotations

import pytest
import torch

from tests.distutil import run_dist

pytestmark = pytest.mark.multi_process


def _data(rank: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float64) * (rank + 1) + rank).to(
        dtype
    )  # integer-valued: exact sums


def _shard_checks(world, algorithms):
    from scaleout.comm import all_gather, reduce_scatter, shard_index
    from scaleout.errors import UserError

    W, r = world.world_size, world.rank
    out = {}
    for alg in algorithms:
        for S in (5, 1, 0):  # 0: nothing to send, every rank must still agree
            n = S * W
            idx = shard_index(world, alg)
            mine = torch.empty(S)
            reduce_scatter(mine, _data(r, n), world, alg)
            total = sum(_data(k, n) for k in range(W))
            ok_rs = torch.equal(mine, total[idx * S : (idx + 1) * S])
            avg = torch.empty(S)
            reduce_scatter(avg, _data(r, n), world, alg, op="avg", async_op=True).wait()
            ok_avg = torch.allclose(avg, mine / W)
            full = torch.full((n,), -1.0)
            h = all_gather(full, mine, world, alg, async_op=True)
            ok_ag = h.wait() is full and torch.equal(
                full, total
            )  # every slice back where it came from
            inplace = torch.zeros(
                n
            )  # the sharded optimizer gathers into the buffer it owns a slice of
            inplace[idx * S : (idx + 1) * S] = mine
            all_gather(inplace, inplace[idx * S : (idx + 1) * S], world, alg)
            out[(alg, S)] = {
                "idx": idx,
                "rs": ok_rs,
                "avg": ok_avg,
                "ag": ok_ag,
                "inplace": torch.equal(inplace, total),
            }
    errors = []
    for call in (
        lambda: reduce_scatter(torch.empty(3), torch.empty(3 * W + 1), world),
        lambda: all_gather(torch.empty(3 * W), torch.empty(3, dtype=torch.float64), world),
        lambda: reduce_scatter(torch.empty(1), torch.empty(W), world, "flat", x=2),
        lambda: reduce_scatter(torch.empty(1), torch.empty(W), world, "flat", op="max"),
    ):
        try:
            call()
            errors.append(None)
        except UserError as e:
            errors.append(str(e))
    out["errors"] = errors
    return out


@pytest.mark.parametrize("nnodes,nproc", [(1, 1), (1, 3), (2, 1), (2, 2)])
def test_reduce_scatter_and_all_gather_every_algorithm(nnodes: int, nproc: int) -> None:
    algorithms = ["flat", "hierarchical"] + (["torus2d"] if nnodes * nproc > 1 else [])
    res = run_dist(_shard_checks, nnodes, nproc, args=(algorithms,), timeout=300)
    W = nnodes * nproc
    for alg in algorithms:
        for S in (5, 1, 0):
            owners = sorted(r[(alg, S)]["idx"] for r in res)
            assert owners == list(range(W)), f"{alg}: slices owned {owners}"
            for rank, r in enumerate(res):
                assert all(r[(alg, S)][k] for k in ("rs", "avg", "ag", "inplace")), (
                    alg,
                    S,
                    rank,
                    r[(alg, S)],
                )
    if (
        nnodes == 2 and nproc == 2
    ):  # intra-node reduce-scatter first: rank (node j, local i) owns slice 2 i + j
        assert [r[("hierarchical", 5)]["idx"] for r in res] == [0, 2, 1, 3]
    msgs = res[0]["errors"]
    assert "input has" in msgs[0] and "expected world_size" in msgs[0]
    assert "must match" in msgs[1]
    assert "not understood by algorithm 'flat'" in msgs[2]
    assert "op='max'" in msgs[3]
