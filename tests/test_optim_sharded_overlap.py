"""Overlapped sharded LAMB on real gloo processes (2 emulated nodes x 2): same parameters as the
non-overlapped ShardedLAMB and as LAMB on the averaged gradient, with real backward passes driving the hooks."""

from __future__ import annotations

import pytest
import torch

from scaleout.config.schema import OptimConfig
from scaleout.errors import ConfigError
from scaleout.optim import LAMB, ShardedLAMB, build_optimizer
from scaleout.optim.sharded_overlap import OverlappedShardedLAMB
from tests.distutil import run_dist

HP = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-6)
BUCKET_MB = 200 * 4 / 2**20  # ~200 fp32 elements: the model below splits into several buckets


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.a = torch.nn.Linear(13, 21)
        self.norm = torch.nn.LayerNorm(21)
        self.b = torch.nn.Linear(21, 17)
        self.c = torch.nn.Linear(17, 5)
        self.unused = torch.nn.Linear(3, 3)  # never in the graph: its gradient stays None
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(self.norm(self.a(x)))))


def groups(model: torch.nn.Module) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def batch(step: int, rank: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + 10 * rank + micro)
    return torch.randn(8, 13, generator=g), torch.randn(8, 5, generator=g)


def loss_of(model, step: int, rank: int, micro: int = 0) -> torch.Tensor:
    x, y = batch(step, rank, micro)
    return ((model(x) - y) ** 2).mean()


def _run(world, steps: int, clip, accum: int, use_no_sync: bool, manual: bool, skip: int = -1) -> dict:
    """One configuration: overlapped vs plain ShardedLAMB vs LAMB on the average, relative max difference."""
    W, r = world.world_size, world.rank
    nets = [Net() for _ in range(3)]
    over = ShardedLAMB(groups(nets[0]), world, overlap=True, bucket_mb=BUCKET_MB, clip_grad_norm=clip, **HP)
    plain = ShardedLAMB(groups(nets[1]), world, clip_grad_norm=clip, **HP)
    ref = LAMB(groups(nets[2]), chunk=None, clip_grad_norm=clip, **HP)
    for s in range(steps):
        for i in range(accum):  # the trainer's micro-batch loop: backward per micro-batch, step once
            if manual:  # gradients set by hand, no backward: step() packs and launches every bucket
                shadow = Net()  # a hook-free copy computes the gradients
                shadow.load_state_dict(nets[0].state_dict())
                loss_of(shadow, s, r, i).backward()
                for p, q in zip(nets[0].parameters(), shadow.parameters(), strict=True):
                    p.grad = q.grad
                break
            last = i == accum - 1
            ctx = over.no_sync() if use_no_sync and not last else torch.enable_grad()
            with ctx:
                loss_of(nets[0], s, r, i).backward()
        for i in range(1 if manual else accum):
            loss_of(nets[1], s, r, i).backward()
        for k in range(W):  # LAMB on the average of every rank's (accumulated) gradient
            for i in range(1 if manual else accum):
                (loss_of(nets[2], s, k, i) / W).backward()
        for q in nets[2].unused.parameters():  # ShardedLAMB treats a missing gradient as zero (decay still applies)
            q.grad = torch.zeros_like(q)
        sent = over._next  # buckets whose reduce-scatter backward already started
        if s != skip:  # a skipped step (the trainer's non-finite check): backward ran, only zero_grad follows
            over.step()
            plain.step()
            ref.step()
        for o in (over, plain, ref):
            o.zero_grad(set_to_none=True)

    @torch.no_grad()
    def rel(m1, m2) -> float:
        return max(float((p - q).abs().max()) / max(float(q.abs().max()), 1e-6)
                   for p, q in zip(m1.parameters(), m2.parameters(), strict=True))

    with torch.no_grad():
        moved = max(float((p - q).abs().max()) for p, q in zip(nets[0].parameters(), Net().parameters(), strict=True))
    return {
        "vs_plain": rel(nets[0], nets[1]), "vs_lamb": rel(nets[0], ref_net := nets[2]), "moved": moved,
        "buckets": len(over._buckets), "sent_in_backward": sent, "state_ratio": over.state_bytes() / sum(4 * 2 * p.numel() for p in ref_net.parameters()),
        "checksum": float(sum(p.detach().double().sum() for p in nets[0].parameters())),
        "timings": sorted(over.timings), "layout": over.state_dict()["layout"],
    }


def _all_cases(world) -> dict:
    return {
        "plain": _run(world, 3, None, 1, False, False),
        "clip": _run(world, 3, 0.5, 1, False, False),
        "accum_no_sync": _run(world, 2, None, 2, True, False),
        "accum_resend": _run(world, 2, 0.5, 2, False, False),
        "manual": _run(world, 2, None, 1, False, True),
        "skipped_step": _run(world, 3, None, 1, False, False, skip=1),
    }


def test_overlapped_sharded_lamb_matches_plain_sharded_and_lamb_on_2x2():
    by_rank = run_dist(_all_cases, 2, 2)
    for case in by_rank[0]:
        for r, res in enumerate(b[case] for b in by_rank):
            assert res["vs_plain"] <= 1e-6, f"{case} rank {r}: {res['vs_plain']:.3g} from non-overlapped ShardedLAMB"
            assert res["vs_lamb"] <= 1e-6, f"{case} rank {r}: {res['vs_lamb']:.3g} from LAMB on the average"
            assert res["moved"] > 1e-3, f"{case}: parameters did not move"
            assert res["buckets"] >= 3, f"{case}: only {res['buckets']} buckets, the overlap path is not exercised"
            assert res["state_ratio"] < 0.3, f"{case}: rank {r} holds {res['state_ratio']:.2f} of the full state"
            assert "reduce_scatter_wait" in res["timings"] and "all_gather_wait" in res["timings"]
        assert len({b[case]["checksum"] for b in by_rank}) == 1, f"{case}: ranks disagree on the parameters"
    for case in ("plain", "clip", "accum_no_sync"):  # from step 2 on (the unused layer learnt), backward sends all
        assert all(b[case]["sent_in_backward"] == b[case]["buckets"] for b in by_rank), case
    assert by_rank[0]["manual"]["sent_in_backward"] == 0  # no backward: step() sends everything
    assert by_rank[0]["plain"]["layout"]["buckets"] == by_rank[0]["plain"]["buckets"]


def test_factory_and_config_select_the_overlapped_path():
    assert OptimConfig().overlap_comm is False
    model = Net()
    with pytest.raises(ConfigError, match="overlap_comm"):
        build_optimizer(model, OptimConfig(overlap_comm=True), world=None)
    with pytest.raises(ConfigError, match="bucket_mb"):
        OverlappedShardedLAMB(groups(model), object(), bucket_mb=-1)


def _factory(world) -> str:
    opt = build_optimizer(Net(), OptimConfig(sharded=True, overlap_comm=True), world)
    return type(opt).__name__


def test_factory_builds_overlapped_optimizer_on_real_world():
    assert run_dist(_factory, 2, 2) == ["OverlappedShardedLAMB"] * 4
