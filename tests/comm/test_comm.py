"""scaleout.comm on real gloo processes: every algorithm equals ``flat`` (bit for bit on
integer-valued data, to rounding on random data) for world sizes 1..8 over grids 1xN, Nx1, 2x2, 2x3,
3x2, 2x4, element counts 1, 7 and 1,000,003, fp32/bf16/fp16, sum and avg, in place, non-contiguous,
async; plus the error paths. One run_dist call per world shape batches all of its checks (spawning
costs seconds).
"""

from __future__ import annotations

import pytest
import torch
from distutil import run_dist

from scaleout.comm import ALGORITHMS, all_reduce
from scaleout.env import WorldSpec
from scaleout.errors import TopologyError, UserError
from scaleout.parallel import ddp_comm_hook
from scaleout.world import World

pytestmark = pytest.mark.multi_process

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
COUNTS = (1, 7, 1_000_003)


def _variants(world, grids):
    out = [("hierarchical", {}), ("torus2d", {}), ("hierarchical", {"composition": "leader"})]
    out += [("torus2d", {"x": x, "y": y}) for x, y in grids]
    return out


def _equality(world, grids):
    """For every variant/count/dtype/op: integer data -> exact; random data -> within dtype
    rounding."""
    failures = []
    checked = 0
    for alg, opts in _variants(world, grids):
        for n in COUNTS:
            for dtype in DTYPES:
                for op in ("sum", "avg"):
                    # Time budget: the big count runs every dtype with sum (fp32 also avg) on the
                    # default grids, and fp32 sum on the explicit ones; counts 1 and 7 run the full
                    # cross product.
                    if n == COUNTS[-1] and (
                        (dtype != torch.float32 and op == "avg")
                        or (opts and (dtype, op) != (torch.float32, "sum"))
                    ):
                        continue
                    g = torch.Generator().manual_seed(1000 * world.rank + n)
                    ints = torch.randint(-3, 4, (n,), generator=g).to(dtype)
                    ref, got = ints.clone(), ints.clone()
                    all_reduce(ref, world, "flat", op=op)
                    assert all_reduce(got, world, alg, op=op, **opts) is got  # in place
                    if not torch.equal(ref, got):
                        failures.append(
                            (alg, opts, n, str(dtype), op, "int", (ref - got).abs().max().item())
                        )
                    checked += 1
        # random (non-integer) data: equal to flat to the dtype's rounding
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
            g = torch.Generator().manual_seed(world.rank)
            x = torch.randn(10_007, generator=g).to(dtype)
            ref, got = x.clone(), x.clone()
            all_reduce(ref, world, "flat", op="avg")
            all_reduce(got, world, alg, op="avg", **opts)
            err = (ref.float() - got.float()).abs().max().item()
            if err > tol * max(1.0, ref.float().abs().max().item()):
                failures.append((alg, opts, "randn", str(dtype), "avg", err))
            checked += 1
    return failures, checked


def _layouts(world):
    """Non-contiguous input, chunk pipelining (small chunks), several async calls in flight,
    int64."""
    out = {}
    p = world.world_size
    base = torch.arange(24 * 35, dtype=torch.float32).reshape(24, 35) * (world.rank + 1)
    expect = torch.arange(24 * 35, dtype=torch.float32).reshape(24, 35) * (p * (p + 1) // 2)
    for alg in ALGORITHMS:
        t = base.clone().t()  # a transposed view: not contiguous
        storage = t.data_ptr()
        all_reduce(t, world, alg)
        out[f"noncontig-{alg}"] = bool(torch.equal(t, expect.t())) and t.data_ptr() == storage
    v = torch.full((100_003,), float(world.rank))
    all_reduce(v, world, "hierarchical", chunk_bytes=4096)  # capped at MAX_CHUNKS chunks
    out["chunked"] = bool((v == p * (p - 1) / 2).all())
    # several in flight, mixed algorithms, waited in reverse order
    ts = [torch.full((50_000 + i,), float(world.rank + i)) for i in range(5)]
    algs = ["hierarchical", "flat", "torus2d", "flat", "hierarchical"]
    hs = [
        all_reduce(t, world, a, async_op=True, chunk_bytes=65536)
        if a != "flat"
        else all_reduce(t, world, a, async_op=True)
        for t, a in zip(ts, algs, strict=True)
    ]
    ok = True
    for i in reversed(range(5)):
        r = hs[i].wait()
        ok &= r is ts[i] and bool((r == p * (p - 1) / 2 + p * i).all()) and hs[i].is_completed()
    out["async"] = ok
    i64 = torch.full((9,), world.rank, dtype=torch.int64)
    all_reduce(i64, world, "torus2d")
    out["int64"] = bool((i64 == p * (p - 1) // 2).all())
    return out


def _errors(world):
    msgs = {}
    for name, call in {
        "grid": lambda: all_reduce(torch.ones(3), world, "torus2d", x=world.world_size + 1, y=1),
        "grid_x": lambda: all_reduce(torch.ones(3), world, "torus2d", x=3),
        "alg": lambda: all_reduce(torch.ones(3), world, "ring9"),
        "op": lambda: all_reduce(torch.ones(3), world, "flat", op="max"),
        "opt": lambda: all_reduce(torch.ones(3), world, "flat", chunk_bytes=4),
        "avg_int": lambda: all_reduce(
            torch.ones(3, dtype=torch.int32), world, "hierarchical", op="avg"
        ),
        "chunk": lambda: all_reduce(torch.ones(3), world, "hierarchical", chunk_bytes=0),
        "comp": lambda: all_reduce(torch.ones(3), world, "torus2d", composition="tree"),
    }.items():
        try:
            call()
            msgs[name] = None
        except UserError as exc:
            msgs[name] = (type(exc).__name__, str(exc))
    return msgs


def _ddp(world):
    """A DDP model with scaleout.parallel.ddp_comm_hook gets the same averaged gradients as plain
    DDP."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    grads = {}
    for alg in ("flat", "hierarchical"):
        m = DDP(
            __import__("copy").deepcopy(model), bucket_cap_mb=0.001
        )  # several buckets -> several in flight
        if alg != "flat":
            m.register_comm_hook(None, ddp_comm_hook(alg, world))
        x = torch.full((8, 16), float(world.rank + 1))
        m(x).square().sum().backward()
        grads[alg] = [p.grad.clone() for p in m.parameters()]
    return all(
        torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(grads["flat"], grads["hierarchical"], strict=True)
    )


def _all(world, grids):
    return {
        "eq": _equality(world, grids),
        "layouts": _layouts(world),
        "errors": _errors(world),
        "ddp": _ddp(world) if world.world_size > 1 else True,
    }


# (nnodes, nproc_per_node, explicit torus grids): world sizes 1..6 and 8 (5 is the odd prime: 7
# ranks cost the suite 20 s on 2 cores and exercise nothing 5 does not); grids 1xN and Nx1 on every
# size, 2x2, 2x3, 3x2, 2x4 (and 4x2 via the default) where they fit.
SHAPES = [
    (1, 1, [(1, 1)]),
    (2, 1, [(1, 2), (2, 1)]),
    (1, 3, [(1, 3), (3, 1)]),
    (2, 2, [(1, 4), (4, 1)]),
    (5, 1, [(1, 5), (5, 1)]),
    (2, 3, [(2, 3), (3, 2), (1, 6), (6, 1)]),
    (4, 2, [(2, 4), (1, 8), (8, 1)]),
]


@pytest.mark.parametrize(
    ("nnodes", "nproc", "grids"), SHAPES, ids=[f"{a}x{b}" for a, b, _ in SHAPES]
)
def test_equal_to_flat(nnodes: int, nproc: int, grids) -> None:
    res = run_dist(_all, nnodes, nproc, args=(grids,), timeout=300)
    p = nnodes * nproc
    for rank, r in enumerate(res):
        failures, checked = r["eq"]
        assert checked >= 3 * (2 * 3 * 2 + 4) and failures == [], f"rank {rank}: {failures[:5]}"
        assert all(r["layouts"].values()), f"rank {rank}: {r['layouts']}"
        assert r["ddp"]
        e = r["errors"]
        assert (
            e["grid"][0] == "TopologyError" and f"does not match the world size {p}" in e["grid"][1]
        )
        if p % 3:
            assert (
                e["grid_x"][0] == "TopologyError"
                and f"x=3 does not divide the world size {p}" in e["grid_x"][1]
            )
        assert (
            "unknown all-reduce algorithm 'ring9'" in e["alg"][1] and "hierarchical" in e["alg"][1]
        )
        assert "op='max'" in e["op"][1]
        assert "chunk_bytes" in e["opt"][1] and "'flat'" in e["opt"][1]
        assert "torch.int32" in e["avg_int"][1]
        assert "chunk_bytes=0" in e["chunk"][1]
        assert "composition='tree'" in e["comp"][1] and "leader" in e["comp"][1]


def _fake_world(node_of: tuple[int, ...]) -> World:
    spec = WorldSpec(
        0, 0, 0, len(set(node_of)), node_of.count(0), len(node_of), "127.0.0.1", 1, "test"
    )
    return World(spec, torch.device("cpu"), "gloo", node_of)


@pytest.mark.parametrize("algorithm", ["hierarchical", "torus2d"])
def test_unequal_ranks_per_node_is_a_clear_error(algorithm: str) -> None:
    """Raised while resolving the groups, before any process group exists (so no processes
    needed)."""
    world = _fake_world((0, 0, 1))
    with pytest.raises(TopologyError, match=r"ranks per node \[2, 1\]"):
        all_reduce(torch.ones(4), world, algorithm)


def _nccl_equality(world):
    out = []
    for alg in ("hierarchical", "torus2d"):
        for n in (1, 7, 1_000_003):
            for dtype in DTYPES:
                x = (
                    torch.randint(-3, 4, (n,), generator=torch.Generator().manual_seed(world.rank))
                    .to(dtype)
                    .to(world.device)
                )
                ref, got = x.clone(), x.clone()
                all_reduce(ref, world, "flat")
                all_reduce(got, world, alg)
                out.append(bool(torch.equal(ref, got)))
    return world.backend, all(out)


@pytest.mark.gpu(devices=2, reason="NCCL refuses two ranks on one GPU")
@pytest.mark.parametrize(("nnodes", "nproc"), [(1, 2), (2, 1)])
def test_nccl_composition_equals_flat(nnodes: int, nproc: int) -> None:
    """The NCCL path (reduce_scatter_tensor -> all_reduce -> all_gather_into_tensor with
    padding)."""
    for backend, ok in run_dist(_nccl_equality, nnodes, nproc, timeout=300):
        assert backend == "nccl" and ok
