"""Sharded LAMB on real gloo processes: the same parameters as LAMB on the averaged gradient, 1/world state."""

from __future__ import annotations

import copy

import torch

from scaleout.optim import LAMB, ShardedLAMB, state_bytes
from tests.distutil import run_dist
from tests.test_optim import SHAPES, ZERO_ALL, grads_for, groups_of, make_params

HP = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-6, clip_grad_norm=2.0)


def local_grads(step: int, params, rank: int) -> list[torch.Tensor]:
    return grads_for(step, params, seed=10 + rank)


def _sharded_vs_lamb(world, group, W: int, steps: int, chunk):
    """Every rank of ``group``: ShardedLAMB on its local grads vs LAMB on the average of all its ranks' grads."""
    r = world.rank
    params = make_params(7)
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = ShardedLAMB(groups_of(params, 0.1), world, chunk=chunk, group=group, **HP)
    ref = LAMB(groups_of(ref_params, 0.1), chunk=None, **HP)
    ckpt = None
    for s in range(steps):
        for p, g in zip(params, local_grads(s, params, r), strict=True):
            p.grad = g
        all_g = [local_grads(s, params, k) for k in range(W)]
        for i, p in enumerate(ref_params):
            p.grad = sum(gs[i] for gs in all_g) / W
        opt.step()
        ref.step()
        if s == 1:
            ckpt = (copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params])
    rel = max(float((p.detach() - q.detach()).abs().max()) / max(float(q.detach().abs().max()), 1e-6)
              for p, q in zip(params, ref_params, strict=True))
    moved = float(params[ZERO_ALL].detach().abs().max())
    # resume from the step-2 checkpoint into a fresh optimizer: same result as running on
    state, saved = ckpt
    params2 = make_params(7)
    for p, t in zip(params2, saved, strict=True):
        p.data.copy_(t)
    opt2 = ShardedLAMB(groups_of(params2, 0.1), world, chunk=chunk, group=group, **HP)
    opt2.load_state_dict(state)
    for s in range(2, steps):
        for p, g in zip(params2, local_grads(s, params2, r), strict=True):
            p.grad = g
        opt2.step()
    resumed_equal = all(torch.equal(a, b) for a, b in zip(params, params2, strict=True))
    return {
        "rel": rel, "moved": moved, "resumed_equal": resumed_equal, "state_bytes": state_bytes(opt),
        "full_bytes": state_bytes(ref), "checksum": float(sum(p.detach().double().sum() for p in params)),
        "timings": sorted(opt.timings),
    }


def _all_world_sizes(world, steps: int, chunk):
    """World sizes 1..4 in one pool of 4 processes: groups of the first W ranks (real gloo groups)."""
    import torch.distributed as dist

    out = {}
    for W in range(1, world.world_size + 1):
        group = world.group if W == world.world_size else dist.new_group(list(range(W)))
        if world.rank < W:
            out[W] = _sharded_vs_lamb(world, group, W, steps, chunk)
    return out


def test_sharded_lamb_matches_lamb_on_the_global_gradient_for_world_sizes_1_to_4():
    numel = sum(torch.Size(s).numel() for s in SHAPES) + 15
    by_rank = run_dist(_all_world_sizes, 2, 2, args=(4, 5))
    for W in range(1, 5):
        out = [by_rank[r][W] for r in range(W)]
        for r, res in enumerate(out):
            assert res["rel"] <= 1e-6, f"rank {r} of {W}: relative difference {res['rel']:.3g} from LAMB"
            assert res["moved"] == 0.0
            assert res["resumed_equal"], f"rank {r} of {W}: resuming from the state_dict diverged"
            # each rank holds two fp32 moments of ceil(numel / W) elements: 1/W of LAMB's state (+ padding)
            assert res["state_bytes"] == 2 * 4 * -(-numel // W)
            assert res["full_bytes"] == 2 * 4 * numel
            assert res["timings"] == ["all_gather", "norm_allreduce", "pack", "reduce_scatter", "update"]
        assert len({res["checksum"] for res in out}) == 1, f"world {W}: ranks ended with different parameters"
