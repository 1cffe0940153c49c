"""AdamW as MLPerf llama31_8b runs it: a cosine schedule with linear warm-up to optim.end_lr, the
global gradient norm clipped at optim.clip_grad_norm after the reduction, and the sharded mode
(ShardedLAMB with the trust ratio off, sharded over the world or the node) -- each against
torch.optim.AdamW + torch.nn.utils.clip_grad_norm_ + a hand-written cosine, on real gloo ranks."""

from __future__ import annotations

import math

import pytest
import torch

from scaleout.config.schema import CommConfig, OptimConfig
from scaleout.errors import ConfigError
from scaleout.optim import ShardedLAMB, build_optimizer
from scaleout.optim.factory import build_schedule
from tests.distutil import run_dist

BASE, END, WARM, TOTAL = 3e-3, 3e-4, 3, 10


def _cosine(step: int) -> float:
    """The schedule written out from MLPerf's "cosine with linear warmup" (Megatron-LM)."""
    if step < WARM:
        return BASE * step / WARM
    t = min(step, TOTAL) - WARM
    return END + (BASE - END) * 0.5 * (1 + math.cos(math.pi * t / (TOTAL - WARM)))


def _cfg(**kw) -> OptimConfig:
    base = dict(
        name="adamw",
        lr=BASE,
        end_lr=END,
        warmup_steps=WARM,
        total_steps=TOTAL,
        schedule="cosine",
        betas=(0.9, 0.95),
        eps=1e-5,
        weight_decay=0.1,
        clip_grad_norm=0.05,  # small, so that every step here clips
    )
    return OptimConfig(**{**base, **kw})


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.a, self.norm, self.b = (
            torch.nn.Linear(6, 8),
            torch.nn.LayerNorm(8),
            torch.nn.Linear(8, 3),
        )
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.norm(self.a(x))))


def _torch_reference(net: torch.nn.Module, grads_at, steps: int, clip: float) -> list[float]:
    """torch.optim.AdamW (decay on weights, none on biases and the norm) + clip_grad_norm_ + the
    hand-written cosine; the learning rates it used."""
    decay = [p for n, p in net.named_parameters() if n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in net.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=BASE,
        betas=(0.9, 0.95),
        eps=1e-5,
    )
    lrs = []
    for s in range(steps):
        for g in opt.param_groups:
            g["lr"] = _cosine(s)
        lrs.append(_cosine(s))
        grads_at(net, s)
        torch.nn.utils.clip_grad_norm_(list(net.parameters()), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return lrs


def _loss(net: torch.nn.Module, s: int, rank: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(s + 1000 * rank)
    return ((net(torch.randn(16, 6, generator=g)) - torch.randn(16, 3, generator=g)) ** 2).mean()


@pytest.mark.unit
def test_cosine_schedule_and_clipped_adamw_equal_torch() -> None:
    net, ref = Net(), Net()
    opt = build_optimizer(net, _cfg(), no_decay=("bias",))
    assert type(opt) is torch.optim.AdamW and opt.clip_grad_norm == 0.05
    sched = build_schedule(opt, _cfg())
    steps = TOTAL + 3  # past the end: the rate stays at end_lr
    lrs = []
    for s in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        _loss(net, s).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        assert opt.last_grad_norm is not None and opt.last_grad_norm > 0.05  # it clipped

    def grads_at(m: torch.nn.Module, s: int) -> None:
        _loss(m, s).backward()

    want = _torch_reference(ref, grads_at, steps, 0.05)
    assert lrs == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert lrs[0] == 0.0 and lrs[WARM] == pytest.approx(BASE) and lrs[-1] == pytest.approx(END)
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    # without clipping the same steps land elsewhere: the clip is what made them equal
    free = Net()
    opt2 = build_optimizer(free, _cfg(clip_grad_norm=None), no_decay=("bias",))
    sched2 = build_schedule(opt2, _cfg())
    for s in range(steps):
        _loss(free, s).backward()
        opt2.step()
        opt2.zero_grad()
        sched2.step()
    assert not hasattr(opt2, "last_grad_norm")
    assert (
        max(
            float((p - q).abs().max().detach())
            for p, q in zip(free.parameters(), ref.parameters(), strict=True)
        )
        > 1e-4
    )


@pytest.mark.unit
def test_cosine_keys_are_checked() -> None:
    with pytest.raises(ValueError, match="optim.total_steps=3 must be > optim.warmup_steps=3"):
        _cfg(total_steps=WARM)  # the schema refuses the pair before any rank builds it
    from scaleout.optim.schedule import warmup_cosine

    with pytest.raises(ConfigError, match="total_steps=3 must be > warmup_steps=3"):
        warmup_cosine(build_optimizer(Net(), _cfg()), WARM, WARM, 0.0)  # used without a config
    with pytest.raises(ValueError, match="optim.schedule=cosine decays from the end of warm-up"):
        _cfg(decay_from="start")
    with pytest.raises(ValueError, match="optim.sharded=true is implemented for"):
        OptimConfig(name="sgd", sharded=True)


def _averaged_grads(net: torch.nn.Module, s: int, world_size: int) -> None:
    """The gradient every rank holds after the reduction: the mean of the ranks' gradients."""
    for r in range(world_size):
        _loss(net, s, r).backward()
    for p in net.parameters():
        p.grad /= world_size


def _sharded(world, shard: str) -> dict:
    """Sharded AdamW (ShardedLAMB, trust ratio off) on each rank's own batch vs torch AdamW on the
    averaged gradient (clipped after the average)."""
    net = Net()
    cfg = _cfg(sharded=True, shard=shard)
    opt = build_optimizer(net, cfg, world, CommConfig(bucket_mb=1e-3), no_decay=("bias",))
    assert isinstance(opt, ShardedLAMB)
    assert all(g["trust_ratio"] is False for g in opt.param_groups)
    sched = build_schedule(opt, cfg)
    for s in range(5):
        _loss(net, s, world.rank).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    opt.wait_params()
    ref = Net()
    _torch_reference(ref, lambda m, s: _averaged_grads(m, s, world.world_size), 5, 0.05)
    return {
        "err": max(
            float((p - q).abs().max() / q.abs().max().clamp_min(1e-6))
            for p, q in zip(net.parameters(), ref.parameters(), strict=True)
        ),
        "moved": max(
            float((p - q).abs().max())
            for p, q in zip(Net().parameters(), net.parameters(), strict=True)
        ),
    }


def _both(world) -> dict:
    return {shard: _sharded(world, shard) for shard in ("world", "node")}


@pytest.mark.multi_process
def test_sharded_adamw_equals_torch_adamw_on_the_global_batch() -> None:
    """2 emulated nodes x 2 gloo ranks: sharded over the world and within the node."""
    for out in run_dist(_both, nnodes=2, nproc_per_node=2):
        for shard, r in out.items():
            assert r["moved"] > 1e-3, shard
            assert r["err"] < 1e-4, (shard, r)
