"""Sharded LAMB on real gloo processes (world sizes 1..4, flat / hierarchical / torus2d
reduce-scatter): the overlapped (buckets sent during backward) and non-overlapped (one bucket
sent in step()) optimizers equal each other and LAMB on the gradient of the global batch, with
parameters that only some ranks use (a different set per rank and step), a skipped non-finite
step, clipping, gradient accumulation and hand-set gradients."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch

from scaleout.config.schema import CommConfig, OptimConfig
from scaleout.errors import ConfigError
from scaleout.optim import LAMB, ShardedLAMB, build_optimizer, state_bytes
from tests.distutil import run_dist

HP = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-6)
BUCKET_MB = (
    100 * 4 / 2**20
)  # ~100 fp32 elements: the model below splits into 5 buckets, layer d alone in the first


class Net(torch.nn.Module):
    """Two branches whose use depends on the rank and the step; one layer no rank ever uses."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        # registered first, so it sits in the last bucket: a parameter that never gets a gradient
        # holds its bucket and every later one back until the end of backward (buckets go out in
        # order), as in DDP
        self.unused = torch.nn.Linear(3, 3)
        self.a = torch.nn.Linear(13, 21)
        self.norm = torch.nn.LayerNorm(21)
        self.b = torch.nn.Linear(21, 21)
        self.c = torch.nn.Linear(21, 21)
        self.d = torch.nn.Linear(21, 5)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x: torch.Tensor, step: int, rank: int) -> torch.Tensor:
        h = self.norm(self.a(x))
        if (
            step + rank
        ) % 2 == 0:  # rank-dependent: on 2+ ranks, used by some ranks only at every step
            h = torch.tanh(self.b(h))
        if (step + rank) % 3 != 0:
            h = h + self.c(h)
        return self.d(torch.tanh(h))


def groups(model: torch.nn.Module) -> list[dict]:
    named = list(model.named_parameters())
    decay = [(n, p) for n, p in named if n.endswith("weight") and "norm" not in n]
    rest = [(n, p) for n, p in named if not (n.endswith("weight") and "norm" not in n)]
    return [
        {"params": [p for _, p in ps], "names": [n for n, _ in ps], "weight_decay": wd}
        for ps, wd in ((decay, 0.1), (rest, 0.0))
    ]


def loss_of(model: torch.nn.Module, step: int, rank: int, micro: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + 10 * rank + micro)
    x, y = torch.randn(8, 13, generator=g), torch.randn(8, 5, generator=g)
    return ((model(x, step, rank) - y) ** 2).mean()


def _backward(net, opt, s: int, rank: int, accum: int, use_no_sync: bool, manual: bool) -> None:
    if manual:  # gradients set by hand, no backward: step() packs and sends every bucket
        shadow = Net()
        shadow.load_state_dict(net.state_dict())
        loss_of(shadow, s, rank).backward()
        for p, q in zip(net.parameters(), shadow.parameters(), strict=True):
            p.grad = q.grad
        return
    for i in range(accum):  # the trainer's micro-batch loop
        last = i == accum - 1
        with opt.no_sync() if use_no_sync and not last else torch.enable_grad():
            loss_of(net, s, rank, i).backward()


def _rel(m1, m2) -> float:
    with torch.no_grad():
        return max(
            float((p - q).abs().max()) / max(float(q.abs().max()), 1e-6)
            for p, q in zip(m1.parameters(), m2.parameters(), strict=True)
        )


def _global_batch_grads(net: torch.nn.Module, s: int, W: int, accum: int) -> None:
    """The gradient of the global batch as the sharded path forms it: every rank's micro-batches
    summed, the ranks summed, / W (a parameter no rank used: zero). Same arithmetic order, so
    that fp32 rounding in nearly cancelling elements (amplified by LAMB's m / sqrt(v) to ~1e-5
    relative) does not hide a bug."""
    total = None
    for k in range(W):
        rank_net = copy.deepcopy(net)
        rank_net.zero_grad(set_to_none=True)
        for i in range(accum):
            loss_of(rank_net, s, k, i).backward()
        g = [q.grad if q.grad is not None else torch.zeros_like(q) for q in rank_net.parameters()]
        total = g if total is None else [a + b for a, b in zip(total, g, strict=True)]
    for p, g in zip(net.parameters(), total, strict=True):
        p.grad = g / W


def _case(
    world, algorithm: str, steps=4, clip=None, accum=1, use_no_sync=True, manual=False, skip=1
) -> dict:
    """Overlapped vs one-bucket ShardedLAMB vs LAMB on the global batch (the average of every
    rank's gradient; a parameter no rank used gets gradient zero, as allow_unused=True says)."""
    W, r = world.world_size, world.rank
    nets = [Net() for _ in range(3)]
    kw = dict(clip_grad_norm=clip, algorithm=algorithm, allow_unused=True, **HP)
    over = ShardedLAMB(
        groups(nets[0]),
        world,
        overlap=True,
        bucket_mb=BUCKET_MB,
        param_order=nets[0].parameters(),
        **kw,
    )
    plain = ShardedLAMB(groups(nets[1]), world, **kw)
    ref = LAMB(groups(nets[2]), chunk=None, clip_grad_norm=clip, **HP)
    launched = []
    for s in range(steps):
        _backward(nets[0], over, s, r, accum, use_no_sync, manual)
        launched.append(over.last_stats.get("launched_in_backward") if not manual else None)
        _backward(nets[1], plain, s, r, 1 if manual else accum, False, False)
        _global_batch_grads(nets[2], s, W, 1 if manual else accum)
        if (
            s != skip
            # a skipped step (every rank saw a non-finite gradient somewhere): only zero_grad
            # follows
        ):
            for o in (over, plain, ref):
                o.step()
        for o in (over, plain, ref):
            o.zero_grad(set_to_none=True)
    with torch.no_grad():
        moved = max(
            float((p - q).abs().max())
            for p, q in zip(nets[0].parameters(), Net().parameters(), strict=True)
        )
    return {
        "over_plain": _rel(nets[0], nets[1]),
        "over_ref": _rel(nets[0], nets[2]),
        "plain_ref": _rel(nets[1], nets[2]),
        "moved": moved,
        "buckets": len(over.buckets),
        "launched": launched,
        "checksum": float(sum(p.detach().double().sum() for p in nets[0].parameters())),
        "state": (state_bytes(over), over.shard_numel, over.numel),
        "timings": sorted(over.timings),
    }


def _cases(world, algorithms) -> dict:
    out = {}
    for alg in algorithms:
        out[(alg, "rank-dependent unused + skipped step")] = _case(world, alg)
        out[(alg, "clip")] = _case(world, alg, clip=0.5, steps=3)
        out[(alg, "accumulation, no_sync")] = _case(world, alg, accum=2, steps=2, skip=-1)
        out[(alg, "accumulation, re-sent")] = _case(
            world, alg, accum=2, steps=2, use_no_sync=False, skip=-1
        )
        out[(alg, "hand-set gradients")] = _case(world, alg, manual=True, steps=3)
    return out


@pytest.mark.multi_process
@pytest.mark.parametrize("nnodes,nproc", [(1, 1), (1, 2), (1, 3), (2, 2)])
def test_overlapped_equals_one_bucket_equals_lamb_on_the_global_batch(
    nnodes: int, nproc: int
) -> None:
    algorithms = ["flat", "hierarchical"] + (["torus2d"] if (nnodes, nproc) == (2, 2) else [])
    by_rank = run_dist(_cases, nnodes, nproc, args=(algorithms,), timeout=400)
    W = nnodes * nproc
    for case in by_rank[0]:
        for r, res in enumerate(b[case] for b in by_rank):
            for k in ("over_plain", "over_ref", "plain_ref"):
                assert res[k] <= 1e-6, f"{case} rank {r}: {k} relative difference {res[k]:.3g}"
            assert res["moved"] > 1e-3, f"{case}: parameters did not move"
            assert res["buckets"] >= 3, (
                f"{case}: {res['buckets']} buckets, the overlap path is not exercised"
            )
            nbytes, shard, numel = res["state"]
            assert nbytes == 2 * 4 * shard and numel / W <= shard <= numel / W + res["buckets"], (
                res["state"]
            )
            assert res["timings"] == [
                "all_gather",
                "norm_allreduce",
                "pack",
                "reduce_scatter",
                "update",
            ]
        assert len({b[case]["checksum"] for b in by_rank}) == 1, (
            f"{case}: ranks disagree on the parameters"
        )
    for alg in algorithms:  # backward sent all but the buckets whose parameters it never reached
        launched = by_rank[0][(alg, "rank-dependent unused + skipped step")]["launched"]
        assert all(n is not None and n >= 1 for n in launched), launched
        assert by_rank[0][(alg, "hand-set gradients")]["launched"] == [None] * 3


def _unused_is_an_error(world) -> list[str]:
    from scaleout.errors import UserError

    net = Net()
    opt = ShardedLAMB(groups(net), world, overlap=True, bucket_mb=BUCKET_MB, **HP)
    loss_of(net, 0, world.rank).backward()
    try:
        opt.step()
    except UserError as e:
        msg = str(e)
    else:
        msg = ""
    opt.zero_grad()
    loss_of(
        net, 1, world.rank
    ).backward()  # the ranks are still in step: the next step communicates normally
    with pytest.raises(UserError):
        opt.step()
    return [msg]


@pytest.mark.multi_process
def test_parameter_unused_on_every_rank_is_the_same_error_everywhere() -> None:
    msgs = run_dist(_unused_is_an_error, 1, 2, timeout=120)
    for (msg,) in msgs:
        assert "received no gradient on any rank: ['unused.weight', 'unused.bias']" in msg
        assert "allow_unused=True" in msg


def _resume_same_layout(world) -> bool:
    nets = [Net(), Net()]
    kw = dict(overlap=True, bucket_mb=BUCKET_MB, allow_unused=True, **HP)
    opts = [ShardedLAMB(groups(n), world, **kw) for n in nets]
    for s in range(4):
        if s == 2:  # the second optimizer starts from the first one's state after 2 steps
            nets[1].load_state_dict(nets[0].state_dict())
            opts[1].load_state_dict(copy.deepcopy(opts[0].state_dict()))
        for n, o in zip(nets, opts, strict=True):
            loss_of(n, s, world.rank).backward()
            o.step()
            o.zero_grad()
    return all(
        torch.equal(p, q) for p, q in zip(nets[0].parameters(), nets[1].parameters(), strict=True)
    )


@pytest.mark.multi_process
def test_same_layout_state_dict_resumes_bitwise() -> None:
    assert run_dist(_resume_same_layout, 1, 2, timeout=120) == [True, True]


@pytest.mark.unit
def test_bad_arguments_are_one_line_errors() -> None:
    assert OptimConfig().overlap_comm is False
    with pytest.raises(ValueError, match="overlap_comm"):  # the schema's rule (OptimConfig)
        OptimConfig(overlap_comm=True)
    with pytest.raises(ConfigError, match="needs the World"):
        build_optimizer(Net(), OptimConfig(sharded=True), world=None)
    with pytest.raises(ConfigError, match="bucket_mb"):
        ShardedLAMB(groups(Net()), object(), bucket_mb=-1)


def _factory(world) -> tuple:
    opt = build_optimizer(
        Net(),
        OptimConfig(sharded=True, overlap_comm=True),
        world,
        CommConfig(algorithm="hierarchical", bucket_mb=BUCKET_MB),
    )
    one = build_optimizer(Net(), OptimConfig(sharded=True), world, CommConfig(bucket_mb=BUCKET_MB))
    return (
        type(opt).__name__,
        opt.overlap,
        len(opt.buckets),
        opt.comm.name,
        one.overlap,
        len(one.buckets),
    )


@pytest.mark.multi_process
def test_factory_chooses_overlapped_or_one_bucket() -> None:
    for name, overlap, nb, alg, one_overlap, one_nb in run_dist(_factory, 2, 2):
        assert (name, overlap, alg, one_overlap, one_nb) == (
            "ShardedLAMB",
            True,
            "hierarchical",
            False,
            1,
        ) and nb >= 3


@pytest.mark.unit
def test_no_import_cycle_in_optim() -> None:
    """Every import between scaleout.optim modules, also those inside functions, points one way."""
    root = Path(__file__).resolve().parents[2] / "scaleout" / "optim"
    graph: dict[str, set[str]] = {}
    for f in root.glob("*.py"):
        if f.stem == "__init__":
            continue
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            deps |= {n.split(".")[2] for n in names if n.startswith("scaleout.optim.")}
        graph[f.stem] = deps
    assert "sharded_overlap" not in graph, "one sharded LAMB module"
    done: set[str] = set()

    def visit(m: str, path: tuple[str, ...]) -> None:
        assert m not in path, f"import cycle: {' -> '.join(path + (m,))}"
        if m not in done:
            for d in graph.get(m, ()):
                visit(d, path + (m,))
            done.add(m)

    for m in graph:
        visit(m, ())
