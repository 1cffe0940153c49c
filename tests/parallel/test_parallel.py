"""scaleout.parallel: overlapped bucketed gradient all-reduce (DataParallel), its DDP comm hook and
timeline. Every check runs on 4 real gloo processes as 2 emulated nodes x 2 ranks (tests.distutil),
many configurations per run_dist call; the single-process reference (gradients of the concatenated
global batch) is computed inside each rank process from the same seed.
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch

from tests.distutil import run_dist

P_NODES, P_LOCAL = 2, 2
D = 12


class Net(torch.nn.Module):
    """Small BERT-ish stack: several layers so tiny buckets give many buckets; ``branch`` is used
    only when asked (unused-parameter cases); ``never`` is used only when ``use_never``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(D, D)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.LayerNorm(D),
                torch.nn.Linear(D, 2 * D),
                torch.nn.GELU(),
                torch.nn.Linear(2 * D, D),
            )
            for _ in range(3)
        )
        self.branch = torch.nn.Linear(D, D)
        self.never = torch.nn.Linear(D, D)
        self.head = torch.nn.Linear(D, 3)

    def forward(
        self, x: torch.Tensor, use_branch: bool = True, use_never: bool = False
    ) -> torch.Tensor:
        h = self.inp(x)
        for blk in self.blocks:
            h = h + blk(h)
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        if use_never:
            h = h + self.never(h)
        return self.head(h)


def make(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def global_batch(
    step: int, p: int, b: int = 4, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(p * b, D, generator=g), scale * torch.randn(p * b, 3, generator=g)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
    }


def max_rel(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Worst over parameters of max|got - ref| / max|ref| (parameters with a zero reference:
    absolute)."""
    worst = 0.0
    for n, r in ref.items():
        scale = r.abs().max().item() or 1.0
        worst = max(worst, (got[n] - r).abs().max().item() / scale)
    return worst


def ref_grads(
    model: Net, batches: list[tuple[torch.Tensor, torch.Tensor]], flags: list[list[bool]], p: int
) -> dict:
    """Single-process reference: sum over micro-steps of the mean over ranks of each rank's mean
    loss (with every rank's branch flag), which for equal flags is the loss of the concatenated
    batch."""
    model.zero_grad(set_to_none=True)
    for (x, y), fl in zip(batches, flags, strict=True):
        if all(f == fl[0] for f in fl):
            loss_fn(model(x, fl[0]), y).backward()  # literally the concatenated global batch
        else:
            xs, ys = x.chunk(p), y.chunk(p)
            sum(loss_fn(model(xs[r], fl[r]), ys[r]) for r in range(p)).div(p).backward()
    return grads(model)


# -- rank functions (module level: pickled by reference into the pool)
# -------------------------------


def _gradient_equality(world, configs):
    """For each config: two optimizer steps; after each, every rank's grads vs the global-batch
    reference."""
    import scaleout

    p, r = world.world_size, world.rank
    out = []
    for algorithm, bucket_mb, overlap in configs:
        model = make(seed=7 + r)  # different init per rank: DataParallel must broadcast rank 0's
        ref = make(seed=7)
        dp = scaleout.DataParallel(
            model,
            world,
            algorithm=algorithm,
            bucket_mb=bucket_mb,
            overlap=overlap,
            allow_unused=True,
        )
        same_init = max_rel(
            {n: q.detach() for n, q in model.named_parameters()},
            {n: q.detach() for n, q in ref.named_parameters()},
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        errs = []
        for step in range(2):
            x, y = global_batch(step, p)
            opt.zero_grad(set_to_none=step == 1)  # step 1: .grad None -> re-adopted into the bucket
            loss_fn(dp(x.chunk(p)[r]), y.chunk(p)[r]).backward()
            want = ref_grads(ref, [(x, y)], [[True] * p], p)
            want["never.weight"] = torch.zeros_like(want["never.weight"])
            want["never.bias"] = torch.zeros_like(want["never.bias"])
            errs.append(max_rel(grads(model), want))
            views = all(
                q.grad.data_ptr() == s.view.data_ptr() for s in dp.reducer.slots for q in [s.param]
            )
            opt.step()
            ref_opt.step()
        out.append(
            {
                "cfg": (algorithm, bucket_mb, overlap),
                "same_init": same_init,
                "errs": errs,
                "buckets": len(dp.buckets),
                "order": dp.last_stats["launch_order"],
                "views": views,
                "unused": dp.last_stats["unused"],
                "launch_s": dp.last_stats["launch_s"],
                "layout": dp.buckets,
                "backward_s": dp.last_stats["backward_s"],
            }
        )
        dp.reducer.remove_hooks()
    return out


@pytest.fixture(scope="module")
def equality_results():
    configs = [(a, mb, True) for a in ("flat", "hierarchical", "torus2d") for mb in (1e-6, 1000.0)]
    configs += [("flat", 1e-3, False), ("hierarchical", 2e-3, True)]
    return configs, run_dist(_gradient_equality, P_NODES, P_LOCAL, args=(configs,), timeout=180)


@pytest.mark.multi_process
def test_gradients_equal_global_batch(equality_results):
    configs, results = equality_results
    for rank, res in enumerate(results):
        for item in res:
            assert item["same_init"] == 0.0, (rank, item["cfg"])
            assert max(item["errs"]) <= 1e-6, (rank, item)
            assert item["views"], "param.grad must stay a view into its bucket"


@pytest.mark.multi_process
def test_bucket_counts_and_launch_order(equality_results):
    configs, results = equality_results
    n_params = len(list(make().parameters()))
    for i, cfg in enumerate(configs):
        per_rank = [res[i] for res in results]
        nb = per_rank[0]["buckets"]
        if cfg[1] == 1e-6:
            assert nb == n_params  # tiny cap: one parameter per bucket
        if cfg[1] == 1000.0:
            assert nb == 1  # one bucket holds everything
        for item in per_rank:
            assert item["layout"] == per_rank[0]["layout"], (
                cfg
            )  # rebuilt buckets identical on every rank
            assert item["order"] == list(range(nb)), (cfg, item["order"])
            assert item["unused"] == ["never.weight", "never.bias"]


@pytest.mark.multi_process
def test_overlap_launches_during_backward(equality_results):
    """With overlap the first bucket goes out before backward ends; without, only after it."""
    configs, results = equality_results
    for i, cfg in enumerate(configs):
        if cfg[1] >= 1000.0:
            continue
        item = results[0][i]
        if cfg[2]:
            # (buckets after the one holding the never-used parameter wait for the end of backward)
            assert min(item["launch_s"]) < item["backward_s"], (
                cfg,
                item["launch_s"],
                item["backward_s"],
            )
        else:
            assert min(item["launch_s"]) >= item["backward_s"], cfg


def _accumulation_and_unused(world):
    """no_sync accumulation (branch used in some micro-steps and on some ranks only), rank-dependent
    readiness vs launch order, never-used parameters (error and allow_unused)."""
    import scaleout
    from scaleout.errors import UserError

    p, r = world.world_size, world.rank
    out = {}
    # micro-step flags per rank: step 0 all use the branch, step 1 nobody, step 2 (the synced one)
    # only rank 1
    flags = [[True] * p, [False] * p, [q == 1 for q in range(p)]]
    for algorithm in ("flat", "hierarchical"):
        model, ref = make(3), make(3)
        dp = scaleout.DataParallel(
            model, world, algorithm=algorithm, bucket_mb=2e-3, allow_unused=True
        )
        batches = [global_batch(10 + m, p) for m in range(3)]
        for m, (x, y) in enumerate(batches):
            ctx = dp.no_sync() if m < 2 else _null()
            with ctx:
                loss_fn(dp(x.chunk(p)[r], flags[m][r]), y.chunk(p)[r]).backward()
        want = ref_grads(ref, batches, flags, p)
        out[algorithm] = {
            "err": max_rel(grads(model), want),
            "order": dp.last_stats["launch_order"],
            "nb": len(dp.buckets),
            "unused": dp.last_stats["unused"],
        }
        dp.reducer.remove_hooks()

    # never used on any rank: every rank raises the same one-line error naming the parameters
    model = make(4)
    dp = scaleout.DataParallel(model, world, bucket_mb=1e-3)
    x, y = global_batch(20, p)
    try:
        loss_fn(dp(x.chunk(p)[r]), y.chunk(p)[r]).backward()
        out["error"] = None
    except UserError as e:
        out["error"] = str(e)
    # the next step (never used on rank 0 only) works: the reducer reset its state after the error
    loss_fn(dp(x.chunk(p)[r], True, r == 0), y.chunk(p)[r]).backward()
    out["after_error_unused"] = dp.last_stats["unused"]
    dp.reducer.remove_hooks()

    # bad input: one-line UserErrors naming the value
    errors = {}
    for kwargs in ({"compression": "int8"}, {"algorithm": "ring9"}, {"bucket_mb": 0}):
        try:
            scaleout.DataParallel(make(), world, **kwargs)
        except UserError as e:
            errors[str(kwargs)] = str(e)
    out["bad_input"] = errors
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.multi_process
def test_no_sync_accumulation_and_unused():
    results = run_dist(_accumulation_and_unused, P_NODES, P_LOCAL, timeout=120)
    for rank, res in enumerate(results):
        for algorithm in ("flat", "hierarchical"):
            item = res[algorithm]
            assert item["err"] <= 1e-6, (rank, algorithm, item)
            assert item["order"] == list(range(item["nb"])), (rank, algorithm, item["order"])
            assert item["unused"] == ["never.weight", "never.bias"]
        assert (
            res["error"] is not None
            and "never.weight" in res["error"]
            and "allow_unused" in res["error"]
        )
        assert "\n" not in res["error"]
        assert res["after_error_unused"] == []
        bad = res["bad_input"]
        assert len(bad) == 3, bad
        assert "'int8'" in bad["{'compression': 'int8'}"]
        assert "'ring9'" in bad["{'algorithm': 'ring9'}"]
        assert "bucket_mb=0" in bad["{'bucket_mb': 0}"]


def _compression(world):
    """bf16/fp16 buckets vs the fp32 reference, per element within the dtype's rounding bound;
    fp16 with gradients whose un-divided sum overflows fp16 stays finite; DDP + our hook gives
    the same numbers."""
    from torch.nn.parallel import DistributedDataParallel

    import scaleout
    from scaleout.parallel import ddp_comm_hook

    p, r = world.world_size, world.rank
    eps = {"bf16": 2.0**-8, "fp16": 2.0**-11}  # unit roundoff x 2 (round to nearest: 2^-9, 2^-12)
    out = {}
    for comp, scale in (("bf16", 1.0), ("fp16", 1.0), ("fp16", 1e5)):
        for algorithm in ("flat", "hierarchical"):
            for impl in ("dp", "ddp"):
                model, ref = make(5), make(5)
                x, y = global_batch(30, p, scale=scale)
                xs, ys = x.chunk(p), y.chunk(p)
                # per-rank reference gradients: the bound is in terms of sum_r |g_r| / p
                partial = []
                for q in range(p):
                    ref.zero_grad()
                    loss_fn(ref(xs[q]), ys[q]).backward()
                    partial.append(grads(ref))
                if impl == "dp":
                    dp = scaleout.DataParallel(
                        model,
                        world,
                        algorithm=algorithm,
                        bucket_mb=2e-3,
                        compression=comp,
                        allow_unused=True,
                    )
                    loss_fn(dp(xs[r]), ys[r]).backward()
                    got = grads(model)
                    dp.reducer.remove_hooks()
                else:
                    ddp = DistributedDataParallel(
                        model, bucket_cap_mb=2e-3, find_unused_parameters=True
                    )
                    ddp.register_comm_hook(None, ddp_comm_hook(algorithm, world, compression=comp))
                    loss_fn(ddp(xs[r]), ys[r]).backward()
                    got = grads(model)
                worst, finite, fp32_err, undivided = 0.0, True, 0.0, 0.0
                for n in got:
                    mean = sum(g[n] for g in partial) / p
                    absum = sum(g[n].abs() for g in partial) / p
                    # each of the p terms rounded once on the cast, each of the p-1 additions once
                    # more, the result once on the way back: (2p) roundings of at most eps *
                    # sum|g_r|/p
                    bound = 2 * p * eps[comp] * absum + 1e-30
                    worst = max(worst, ((got[n] - mean).abs() / bound).max().item())
                    finite &= bool(torch.isfinite(got[n]).all())
                    fp32_err = max(fp32_err, (got[n] - mean).abs().max().item())
                    undivided = max(
                        undivided, p * mean.abs().max().item()
                    )  # |sum_r g_r| without pre-division
                out[(comp, scale, algorithm, impl)] = {
                    "worst": worst,
                    "finite": finite,
                    "fp32_err": fp32_err,
                    "undivided": undivided,
                }
    return out


@pytest.mark.multi_process
def test_compression_error_within_dtype_bound():
    results = run_dist(_compression, P_NODES, P_LOCAL, timeout=120)
    for rank, res in enumerate(results):
        for key, item in res.items():
            assert item["finite"], (rank, key, item)
            assert item["worst"] <= 1.0, (rank, key, item)
        # the overflow case really would overflow without the pre-division (sum over 4 ranks >
        # 65504)
        big = res[("fp16", 1e5, "flat", "dp")]
        assert big["undivided"] > 65504, big
        # compression changes the numbers (we did not silently run in fp32)
        assert res[("bf16", 1.0, "flat", "dp")]["fp32_err"] > 0


def _ddp_and_timeline(world, trace_path):
    """torch DDP + ddp_comm_hook (no compression) equals the reference; the timeline trace holds
    every rank's backward and per-bucket communication spans."""
    from torch.nn.parallel import DistributedDataParallel

    import scaleout
    from scaleout.parallel import ddp_comm_hook

    p, r = world.world_size, world.rank
    out = {}
    for algorithm in ("hierarchical", "torus2d"):
        model, ref = make(9), make(9)
        ddp = DistributedDataParallel(model, bucket_cap_mb=2e-3, find_unused_parameters=True)
        ddp.register_comm_hook(None, ddp_comm_hook(algorithm, world))
        x, y = global_batch(40, p)
        loss_fn(ddp(x.chunk(p)[r]), y.chunk(p)[r]).backward()
        want = ref_grads(ref, [(x, y)], [[True] * p], p)
        got = grads(model)
        (
            got.pop("never.weight"),
            got.pop("never.bias"),
            want.pop("never.weight"),
            want.pop("never.bias"),
        )
        out[algorithm] = max_rel(got, want)

    model = make(11)
    dp = scaleout.DataParallel(
        copy.deepcopy(model),
        world,
        algorithm="hierarchical",
        bucket_mb=2e-3,
        allow_unused=True,
        timeline=trace_path,
    )
    for step in range(2):
        x, y = global_batch(50 + step, p)
        loss_fn(dp(x.chunk(p)[r]), y.chunk(p)[r]).backward()
    out["nb"] = len(dp.buckets)
    out["written"] = str(dp.write_timeline())
    dp.reducer.remove_hooks()
    return out


@pytest.mark.multi_process
def test_ddp_hook_and_timeline():
    from scaleout.parallel import load_trace

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        results = run_dist(_ddp_and_timeline, P_NODES, P_LOCAL, args=(path,), timeout=120)
        for rank, res in enumerate(results):
            assert res["hierarchical"] <= 1e-6 and res["torus2d"] <= 1e-6, (rank, res)
        assert results[0]["written"] == path and results[1]["written"] == "None"
        events = load_trace(path)
    nb = results[0]["nb"]
    for rank in range(P_NODES * P_LOCAL):
        mine = [e for e in events if e["pid"] == rank]
        bwd = sorted((e for e in mine if e["cat"] == "backward"), key=lambda e: e["ts"])
        comm = [e for e in mine if e["cat"] == "comm"]
        assert len(bwd) == 2 and len(comm) == 2 * nb, (rank, len(bwd), len(comm))
        for e in comm:
            step = e["args"]["step"]
            b0 = bwd[step - 1]
            assert e["ts"] >= b0["ts"]  # launched after its backward started
            assert e["dur"] > 0  # completion recorded for this step's launch (not a stale one)
        # at least one bucket went out while backward was still running (overlap)
        assert any(
            e["ts"] < bwd[e["args"]["step"] - 1]["ts"] + bwd[e["args"]["step"] - 1]["dur"]
            for e in comm
        )


@pytest.mark.unit
def test_bucket_assignment():
    """Reverse order, >= cap closes a bucket, a separate first cap, dtypes never mixed (no
    processes)."""
    from scaleout.errors import UserError
    from scaleout.parallel.buckets import MiB, assign, build_buckets

    assert assign([4, 4, 4, 4, 4], ["f"] * 5, 8) == [[0, 1], [2, 3], [4]]
    assert assign([4, 4, 4, 4, 4], ["f"] * 5, 8, first_cap_bytes=4) == [[0], [1, 2], [3, 4]]
    assert assign([4, 4, 4, 4], ["f", "h", "f", "h"], 8) == [[0, 2], [1, 3]]
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.Linear(256, 256).to(torch.bfloat16)
    )
    buckets, slots = build_buckets(list(model.named_parameters()), bucket_mb=1000.0, usage=4)
    assert [[s.name for s in b.slots] for b in buckets] == [
        ["1.bias", "1.weight"],
        ["0.bias", "0.weight"],
    ]
    assert (
        buckets[1].extra == 4
        and buckets[0].extra == 0
        and buckets[0].buffer.dtype == torch.bfloat16
    )
    buckets, _ = build_buckets(
        list(model.float().named_parameters()), bucket_mb=0.25, first_bucket_mb=1 / MiB
    )
    assert [len(b.slots) for b in buckets] == [
        1,
        1,
        2,
    ]  # 1.bias alone, 1.weight (256 KiB) closes, then layer 0
    for bad in ({"bucket_mb": 0}, {"bucket_mb": 1.0, "first_bucket_mb": -1}):
        with pytest.raises(UserError, match="bucket_mb"):
            build_buckets(list(model.named_parameters()), **bad)


@pytest.mark.unit
def test_channels_last_grads_are_channels_last_bucket_views():
    """A channels_last parameter's gradient slot has the parameter's strides (torch DDP's bucket
    views do the same), so backward accumulates into it in place in the parameter's layout, and
    the bucket holds exactly the gradient (no processes)."""
    from scaleout.parallel.buckets import build_buckets

    torch.manual_seed(0)
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Conv2d(8, 4, 1))
    conv = conv.to(memory_format=torch.channels_last)
    ref = copy.deepcopy(conv)
    buckets, slots = build_buckets(list(conv.named_parameters()), bucket_mb=1000.0)
    for s in slots:  # same memory layout (a size-1 dimension's stride is arbitrary)
        layout = [(n, st) for n, st in zip(s.param.shape, s.view.stride(), strict=True) if n > 1]
        want = [(n, st) for n, st in zip(s.param.shape, s.param.stride(), strict=True) if n > 1]
        assert layout == want, (s.name, s.view.stride(), s.param.stride())
        s.param.grad = s.view
    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    conv(x).square().sum().backward()
    ref(x).square().sum().backward()
    for s, r in zip(sorted(slots, key=lambda s: s.index), ref.parameters(), strict=True):
        assert s.param.grad.data_ptr() == s.view.data_ptr()  # still the bucket view
        assert torch.allclose(s.param.grad, r.grad, atol=1e-6)
    total = sum(r.grad.square().sum() for r in ref.parameters())
    assert torch.allclose(buckets[0].buffer.square().sum(), total)


def _gpu_compressed_step(world):
    """On CUDA (NCCL): bf16-compressed buckets vs the fp32 global-batch reference."""
    import scaleout

    p, r = world.world_size, world.rank
    model, ref = make(13).to(world.device), make(13)
    dp = scaleout.DataParallel(model, world, bucket_mb=2e-3, compression="bf16", allow_unused=True)
    x, y = global_batch(60, p)
    loss_fn(dp(x.chunk(p)[r].to(world.device)), y.chunk(p)[r].to(world.device)).backward()
    want = ref_grads(ref, [(x, y)], [[True] * p], p)
    return max_rel({n: g.cpu() for n, g in grads(model).items()}, want)


@pytest.mark.multi_process
@pytest.mark.gpu(reason="NCCL path of DataParallel")
def test_gpu_compressed_step():
    n = torch.cuda.device_count()
    for err in run_dist(_gpu_compressed_step, 1, n, timeout=120):
        assert err <= 0.05  # bf16 keeps 8 bits; a missing or wrong reduction is an O(1) error


def _rebuild_order(world):
    """After the first step the buckets follow the order gradients became ready: in a
    post-LayerNorm Transformer layer norm1's gradients arrive after linear1's although norm1 is
    registered first."""
    import scaleout

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    dp = scaleout.DataParallel(layer, world, bucket_mb=1e-6)
    before = [names[0] for names in dp.buckets]
    for _ in range(2):
        dp(torch.randn(2, 3, 16)).sum().backward()
    return before, [names[0] for names in dp.buckets], dp.last_stats["launch_order"]


@pytest.mark.multi_process
def test_buckets_rebuilt_in_ready_order():
    results = run_dist(_rebuild_order, P_NODES, P_LOCAL, timeout=120)
    before, after, order = results[0]
    assert before.index("norm1.weight") < before.index("linear1.weight")  # registration guess
    assert after.index("norm1.weight") > after.index("linear1.weight")  # observed readiness
    assert sorted(after) == sorted(before)
    for res in results:
        assert res[1] == after and res[2] == list(range(len(after)))


def _prioritized(world):
    import threading

    from scaleout.comm import all_reduce
    from scaleout.comm.handles import comm_thread, prioritize_communication

    me = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, me)
    applied = prioritize_communication(world, 5)
    comm_tid = comm_thread(world)._thread.native_id
    t = torch.full((1000,), float(world.rank + 1))
    all_reduce(
        t, world, "hierarchical", op="sum"
    )  # still correct through the comm thread and gloo groups
    return (
        applied,
        before,
        os.getpriority(os.PRIO_PROCESS, me),
        os.getpriority(os.PRIO_PROCESS, comm_tid),
        float(t[0]),
    )


@pytest.mark.multi_process
def test_prioritize_communication_renices_only_the_compute_thread():
    """Real 2x2 gloo world (fresh processes: the renice must not leak into the shared pool)."""
    for applied, before, after, comm, total in run_dist(
        _prioritized, nnodes=2, nproc_per_node=2, fresh=True
    ):
        assert applied is True
        assert after == min(19, before + 5)  # the calling thread is nicer now ...
        assert comm == before  # ... the comm thread (created first) kept its priority
        assert total == 1 + 2 + 3 + 4


def _rider(world):
    """A rider of 3 values on the last bucket: written after the pre-divide, summed exactly with
    the gradients in the same collectives (the count of issued all-reduces does not change); on a
    bf16 wire it does not ride (a rounded, pre-divided sum would be wrong) and says so."""
    import scaleout

    out = {}
    for compression in (None, "bf16"):
        model = make()
        kw = {"bucket_mb": 1e-4, "compression": compression, "allow_unused": True}
        dp = scaleout.DataParallel(model, world, rider=3, **kw)
        plain = scaleout.DataParallel(make(), world, **kw)
        calls = []

        def fill(view, calls=calls):
            calls.append(view.numel())
            view.copy_(torch.tensor([1.0, float(world.rank), 0.1 * (world.rank + 1)]))

        x, y = global_batch(0, world.world_size)
        b = x.shape[0] // world.world_size
        mine = slice(world.rank * b, (world.rank + 1) * b)
        for net in (dp, plain):
            if net is dp:
                offered = dp.ride(fill)
            loss_fn(net(x[mine]), y[mine]).backward()
        result = dp.ride_result()
        assert offered == bool(calls), (offered, calls)  # offered: it rode; else not kept
        out[str(compression)] = {
            "calls": calls,
            "result": None if result is None else result.tolist(),
            "issued": (dp.reducer.issued, plain.reducer.issued),
            "same_grads": max_rel(grads(model), grads(plain.module)),
        }
    return out


@pytest.mark.multi_process
def test_rider_values_are_summed_with_the_last_bucket_and_leave_gradients_alone():
    results = run_dist(_rider, P_NODES, P_LOCAL, timeout=120)
    p = len(results)
    for res in results:
        fp32, bf16 = res["None"], res["bf16"]
        assert fp32["calls"] == [3] and fp32["issued"][0] == fp32["issued"][1] > 1, fp32
        one, ranks, tenths = fp32["result"]
        assert one == p and ranks == sum(range(p)), fp32  # exact sums, not averages
        assert abs(tenths - 0.1 * p * (p + 1) / 2) < 1e-6, fp32
        assert fp32["same_grads"] < 1e-6, fp32
        assert bf16["calls"] == [] and bf16["result"] is None, bf16
        assert bf16["same_grads"] < 1e-6, bf16  # the same recipe with and without the rider


def _averaged_after_the_sum(world):
    """fp32 buckets on an fp32 wire go out undivided and are averaged after their wait, in the
    pass that flags non-finite values; the reducer starts each flat bucket's work itself (no
    layer of scaleout.comm, no Python callback per bucket)."""
    import torch.distributed as dist

    import scaleout

    p = world.world_size
    x, y = global_batch(0, p)
    b = x.shape[0] // p
    mine = slice(world.rank * b, (world.rank + 1) * b)
    post = scaleout.DataParallel(make(), world, bucket_mb=1e-4, allow_unused=True)
    pre = scaleout.DataParallel(make(), world, bucket_mb=1e-4, allow_unused=True)
    pre.reducer._divides_after = lambda buf: False  # the same buckets, divided before the sum
    works: list = []
    start = post.reducer._start

    def recording(buf, start=start):
        work = start(buf)
        works.append(type(work).__name__ if isinstance(work, dist.Work) else repr(work))
        return work

    def refused(buf, async_op=True):
        raise AssertionError("scaleout.comm.all_reduce called for a flat bucket")

    post.reducer._start = recording
    post.reducer._all_reduce = refused
    out = {}
    for step in range(2):  # the second after the bucket rebuild
        for net in (post, pre):
            loss = loss_fn(net(x[mine]), y[mine])
            if step == 1 and world.rank == 1 and net is post:
                loss = loss * float("nan")  # one rank's gradients NaN: the sums are NaN everywhere
            loss.backward()
        st = post.last_stats
        out[step] = {
            "nonfinite": None if post.reducer.nonfinite is None else post.reducer.nonfinite.item(),
            "pre_flag": pre.reducer.nonfinite,
            "bitwise": all(
                torch.equal(a.grad, b.grad)
                for a, b in zip(post.module.parameters(), pre.module.parameters(), strict=True)
            ),
            "done_after_launch": all(
                d > 0 and d >= s for d, s in zip(st["done_s"], st["launch_s"], strict=True)
            ),
            "buckets": st["buckets"],
        }
        for net in (post, pre):
            net.zero_grad()
    out["works"] = works
    return out


@pytest.mark.multi_process
def test_fp32_buckets_are_averaged_after_the_sum_with_the_nonfinite_flag():
    """4 real gloo ranks, many small buckets: dividing after the sum gives the gradients of
    dividing before it bit for bit (p = 4, a power of two), the reducer's non-finite flag is 0
    for finite gradients and 1 on every rank when one rank's gradients are NaN, every bucket's
    completion is stamped after its launch, and every bucket went out as a native gloo work
    started by the reducer itself."""
    results = run_dist(_averaged_after_the_sum, P_NODES, P_LOCAL, timeout=120)
    for res in results:
        first, nan = res[0], res[1]
        assert first["buckets"] > 2, first
        assert first["nonfinite"] == 0.0 and first["bitwise"], first
        assert first["pre_flag"] is None, first  # a pre-divided backward has no flag
        assert nan["nonfinite"] == 1.0, nan
        assert first["done_after_launch"] and nan["done_after_launch"], res
        assert len(res["works"]) == first["buckets"] + nan["buckets"], res
        assert all(w != "None" and "Work" in w for w in res["works"]), res["works"]
