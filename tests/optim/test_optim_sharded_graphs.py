"""The sharded LAMB under CUDA graphs (``ShardedLAMB.use_graphs``, scaleout/train/capture.py's
``sharded_step``), on real gloo ranks (2 emulated nodes x 2) and an emulated GPU
(tests/fakecuda.py ``FakeCuda(graphs=True)``: a mock, since no GPU can exist here; its capture
records the device ops, forbids host reads and replays no Python, as a CUDA graph does).

The whole step (forward, backward with the bucket reduce-scatters issued by its hooks, the LAMB
update, the all-gathers) is captured once per shape and replayed, and must still equal the eager
sharded LAMB step for step while the learning rate changes every step, with global clipping, and
with a non-finite gradient on one rank at a replayed step skipped on every rank (nothing written,
the step not counted)."""

from __future__ import annotations

import pytest
import torch

from scaleout.optim import ShardedLAMB
from scaleout.train.capture import StepGraphs, sharded_step
from tests.distutil import run_dist
from tests.fakecuda import DEVICE, FakeCuda
from tests.optim.test_optim_sharded import groups

pytestmark = pytest.mark.multi_process

STEPS = 9  # 3 eager warm-ups, the capture (and its first replay), 5 more replays
NAN_AT = 6  # a replayed step: rank 3's input is NaN there
HP = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-6, clip_grad_norm=0.5)
BUCKET_MB = 200 * 4 / 2**20  # a few buckets: reduce-scatters go out during backward


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.a = torch.nn.Linear(13, 21)
        self.norm = torch.nn.LayerNorm(21)
        self.b = torch.nn.Linear(21, 5)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.norm(self.a(x))))


def _loss(model: torch.nn.Module, mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = mb
    return ((model(x) - y) ** 2).mean()


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(8, 13, generator=g), torch.randn(8, 5, generator=g)
    if step == NAN_AT and rank == 3:
        x[0, 0] = float("nan")
    return x.to(DEVICE), y.to(DEVICE)


def _train(world, graphed: bool, shard: str, compression: str | None, warmup: int = 3) -> dict:
    net = _MLP()
    with FakeCuda(world, graphs=True) as fc:
        opt = ShardedLAMB(
            groups(net),
            world,
            overlap=True,
            bucket_mb=BUCKET_MB,
            param_order=net.parameters(),
            shard=shard,
            compression=compression,
            module=net,
            **HP,
        )
        # warm-up: the learning rate differs at every step, as the flagship's schedule
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / STEPS)
        graphs = None
        if graphed:
            opt.use_graphs()
            step = sharded_step(net, _loss, opt)
            graphs = StepGraphs(step, DEVICE, warmup=warmup, stage=opt.stage)
        skipped, unchanged = [], None
        for s in range(STEPS):
            mb = _batch(s, world.rank)
            before = [t.clone() for t in (*net.parameters(), opt.exp_avg, opt.exp_avg_sq)]
            if graphs is not None:
                graphs([mb])
                skip = bool(opt.nonfinite_flag())  # (the trainer reads it with the agreement)
                opt.settle(skip)
            else:
                _loss(net, mb).backward()
                opt.step()
                skip = opt.skipped
                opt.wait_params()
            if not skip:
                schedule.step()
            opt.zero_grad()
            skipped.append(skip)
            if s == NAN_AT:
                after = (*net.parameters(), opt.exp_avg, opt.exp_avg_sq)
                unchanged = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        return {
            "params": [p.detach().clone() for p in net.parameters()],
            "steps": [g["step"] for g in opt.param_groups],
            "skipped": skipped,
            "unchanged": unchanged,
            "disabled": graphs.disabled if graphs else None,
            "captures": fc.captures,
            "replays": fc.replays,
        }


def _both(world) -> dict:
    out = {}
    for shard, comp in (("node", "bf16"), ("world", None)):
        out[(shard, comp)] = (
            _train(world, True, shard, comp),
            _train(world, True, shard, comp, warmup=STEPS + 1),  # the same step, never captured
            _train(world, False, shard, comp),
        )
    return out


def test_the_captured_sharded_step_equals_the_eager_one() -> None:
    """Captured once after 3 eager warm-ups, then replayed: bitwise the same weights as the same
    device-only step never captured (a replay that read the capture's learning rate or bias
    correction instead of the staged ones, or a stale buffer, would differ), the same skipped
    step on every rank with its state untouched, and the same step count. Against the eager
    sharded LAMB (Python scalars, the clip factor folded into the moments' weights): relative
    2e-4, rounding apart; LAMB's m / sqrt(v) carries a last-bit difference of a near-zero
    gradient element to an O(lr) difference of its update, and a wrong formula (a missing bias
    correction, an unclipped gradient, a frozen learning rate) is O(10 %)."""
    by_rank = run_dist(_both, 2, 2, timeout=300)
    for r, res in enumerate(by_rank):
        for key, (graphed, uncaptured, eager) in res.items():
            what = f"rank {r} {key}"
            assert graphed["disabled"] is None, f"{what}: the capture failed: {graphed['disabled']}"
            assert graphed["captures"] == 1 and graphed["replays"] == STEPS - 3, (what, graphed)
            assert uncaptured["captures"] == eager["captures"] == 0, what
            expected = [s == NAN_AT for s in range(STEPS)]
            assert graphed["skipped"] == expected == eager["skipped"], what
            assert graphed["unchanged"] is True, f"{what}: the skipped replay wrote something"
            assert graphed["steps"] == eager["steps"] == [STEPS - 1] * 2, what
            for p, q, e in zip(
                graphed["params"], uncaptured["params"], eager["params"], strict=True
            ):
                assert torch.equal(p, q), f"{what}: the replays differ from the same step eager"
                rel = float((p - e).abs().max()) / float(e.abs().max())
                assert rel < 2e-4, (what, rel)
            for p, q in zip(graphed["params"], by_rank[0][key][0]["params"], strict=True):
                assert torch.equal(p, q), f"{what}: the replicas differ"
