"""Group batch norm on real gloo processes (2 emulated nodes x 2 ranks): exact equivalence with
plain BN over the concatenated group batch (outputs, input/weight/bias gradients, running
statistics), for k = 1, 2 (within a node) and 4 (across both nodes), plus a whole ResNet with
bn_group = 2."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from scaleout.errors import TopologyError
from scaleout.families.resnet.group_bn import GroupBatchNorm2d, bn_group_ranks, bn_process_group


def _layer_case(world, k: int) -> dict:
    torch.manual_seed(0)
    per, c = 3, 5
    x_all = torch.randn(per * world.world_size, c, 4, 4) * 3 + 1.5
    dy_all = torch.randn_like(x_all)
    w, b = torch.rand(c) + 0.5, torch.randn(c)
    groups = bn_group_ranks(world.ranks_per_node, k)
    mine = next(g for g in groups if world.rank in g)
    pos = mine.index(world.rank)
    rows = torch.cat([torch.arange(r * per, (r + 1) * per) for r in mine])  # the group's batch

    gbn = GroupBatchNorm2d(c, group=bn_process_group(world, k), group_size=k)
    ref = nn.BatchNorm2d(c)
    for m in (gbn, ref):
        m.weight.data.copy_(w)
        m.bias.data.copy_(b)
    out = {}
    for it in range(2):  # two steps: running stats accumulate identically
        x = x_all[world.rank * per : (world.rank + 1) * per].clone().requires_grad_(True) * (1 + it)
        x.retain_grad()
        y = gbn(x)
        y.backward(dy_all[world.rank * per : (world.rank + 1) * per])
        xr = (x_all[rows].clone() * (1 + it)).requires_grad_(True)
        yr = ref(xr)
        yr.backward(dy_all[rows])
        sl = slice(pos * per, (pos + 1) * per)
        gw, gb = gbn.weight.grad.clone(), gbn.bias.grad.clone()
        # weight/bias grads are local sums: summed over the group they are plain BN's
        group = bn_process_group(world, k)
        if group is not None:
            dist.all_reduce(gw, group=group)
            dist.all_reduce(gb, group=group)
        out[it] = {
            "y": (y - yr[sl]).abs().max().item(),
            "dx": (x.grad - xr.grad[sl]).abs().max().item(),
            # weight/bias grads are sums over the whole group batch (|dw| ~ 20 here): compared
            # relative to their magnitude, since fp32 summation order differs between the two paths
            "dw": (
                (gw - ref.weight.grad).abs().max() / ref.weight.grad.abs().max().clamp_min(1)
            ).item(),
            "db": (
                (gb - ref.bias.grad).abs().max() / ref.bias.grad.abs().max().clamp_min(1)
            ).item(),
        }
        for m in (gbn, ref):
            m.weight.grad = m.bias.grad = None
    out["rm"] = (gbn.running_mean - ref.running_mean).abs().max().item()
    out["rv"] = (gbn.running_var - ref.running_var).abs().max().item()
    out["running"] = (gbn.running_mean.clone(), gbn.running_var.clone())
    out["group"] = mine
    gbn.eval()
    ref.eval()
    out["eval"] = (gbn(x_all[:2]) - ref(x_all[:2])).abs().max().item()
    return out


def _resnet_case(world, k: int) -> dict:
    from scaleout.families.resnet.config import ResNetConfig
    from scaleout.families.resnet.model import build_resnet

    cfg = ResNetConfig(
        depth=18, width=4, num_classes=7, image_size=16, bn_group=k, zero_init_residual=False
    )
    torch.manual_seed(1)
    model = build_resnet(cfg, world)
    torch.manual_seed(1)
    plain_cfg = cfg.model_copy(update={"bn_group": 1})
    plain = build_resnet(plain_cfg, None)
    torch.manual_seed(2)
    x_all = torch.randn(2 * world.world_size, 3, 16, 16)
    groups = bn_group_ranks(world.ranks_per_node, k)
    mine = next(g for g in groups if world.rank in g)
    rows = torch.cat([torch.arange(r * 2, r * 2 + 2) for r in mine])
    y = model(x_all[world.rank * 2 : world.rank * 2 + 2])
    y.square().sum().backward()
    yr = plain(x_all[rows])
    yr.square().sum().backward()
    pos = mine.index(world.rank)
    err_grad = 0.0
    group = bn_process_group(world, k)
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        err_grad = max(err_grad, ((g - q.grad).abs().max() / (q.grad.abs().max() + 1e-12)).item())
    from scaleout.families.resnet.flops import forward_macs
    from scaleout.families.resnet.model import count_macs

    return {
        "y": (y - yr[pos * 2 : pos * 2 + 2]).abs().max().item(),
        "grad_rel": err_grad,
        # multiply-adds counted on the real bn_group = 2 model: the formula's, as for bn_group = 1
        "macs": (count_macs(model, (1, 3, 16, 16)), forward_macs(cfg), forward_macs(plain_cfg)),
    }


class _DtypeLog(TorchDispatchMode):
    """Every dtype an op produced (the forward and backward of one group-BN layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.dtypes.add(t.dtype)
        return out


def _bf16_case(world) -> dict:
    """bf16 activations (what autocast hands a BN layer after a bf16 convolution): the output and
    the input gradient come back in bf16, no op makes an fp64 tensor, and both stay within bf16
    rounding of plain fp32 BN over the group batch."""
    torch.manual_seed(0)
    per, c, k = 4, 6, 2
    x_all = torch.randn(per * world.world_size, c, 5, 5) * 2 + 3
    dy_all = torch.randn_like(x_all)
    groups = bn_group_ranks(world.ranks_per_node, k)
    mine = next(g for g in groups if world.rank in g)
    pos = mine.index(world.rank)
    rows = torch.cat([torch.arange(r * per, (r + 1) * per) for r in mine])
    gbn = GroupBatchNorm2d(c, group=bn_process_group(world, k), group_size=k)
    ref = nn.BatchNorm2d(c)
    x = x_all[world.rank * per : (world.rank + 1) * per].to(torch.bfloat16).requires_grad_(True)
    log = _DtypeLog()
    with torch.autocast("cpu", dtype=torch.bfloat16), log:
        y = gbn(x)
        y.backward(dy_all[world.rank * per : (world.rank + 1) * per].to(torch.bfloat16))
    xr = x_all[rows].to(torch.bfloat16).float().requires_grad_(True)
    yr = ref(xr)
    yr.backward(dy_all[rows].to(torch.bfloat16).float())
    sl = slice(pos * per, (pos + 1) * per)
    return {
        "y_dtype": y.dtype,
        "dx_dtype": x.grad.dtype,
        "fp64": torch.float64 in log.dtypes,
        "y": ((y.float() - yr[sl]).abs().max() / yr.abs().max()).item(),
        "dx": ((x.grad.float() - xr.grad[sl]).abs().max() / xr.grad.abs().max()).item(),
        "rm": (gbn.running_mean - ref.running_mean).abs().max().item(),
    }


def _all_cases(world) -> dict:
    return {
        "layer": {k: _layer_case(world, k) for k in (1, 2, 4)},
        "resnet": _resnet_case(world, 2),
        "bf16": _bf16_case(world),
    }


@pytest.mark.multi_process
def test_group_bn_matches_plain_bn_over_group_batch():
    from tests.distutil import run_dist

    results = run_dist(_all_cases, nnodes=2, nproc_per_node=2)
    for rank, res in enumerate(results):
        for k, case in res["layer"].items():
            for it in (0, 1):
                for name, err in case[it].items():
                    assert err < 1e-5, (rank, k, it, name, err)
            assert case["rm"] < 1e-5 and case["rv"] < 1e-5, (rank, k)
            assert case["eval"] < 1e-5
        assert res["resnet"]["y"] < 1e-4, res["resnet"]
        assert res["resnet"]["grad_rel"] < 1e-4, res["resnet"]
        macs = res["resnet"]["macs"]
        assert macs[0] == macs[1] == macs[2] > 0, macs
        bf = res["bf16"]  # activation dtype in and out, fp32 statistics, no fp64 anywhere
        assert bf["y_dtype"] == bf["dx_dtype"] == torch.bfloat16 and not bf["fp64"], bf
        assert bf["y"] < 2e-2 and bf["dx"] < 2e-2 and bf["rm"] < 1e-4, bf
    # groups within a node first, then across nodes; running stats identical inside each group
    assert results[0]["layer"][2]["group"] == [0, 1] and results[2]["layer"][2]["group"] == [2, 3]
    assert results[0]["layer"][4]["group"] == [0, 1, 2, 3]
    for k in (2, 4):
        for r in range(4):
            g0 = results[r]["layer"][k]["group"][0]
            for a, b in zip(
                results[r]["layer"][k]["running"], results[g0]["layer"][k]["running"], strict=True
            ):
                assert torch.equal(a, b), (k, r)
    # and different groups see different data, so k = 2 statistics differ between groups
    assert not torch.equal(
        results[0]["layer"][2]["running"][0], results[2]["layer"][2]["running"][0]
    )


@pytest.mark.unit
def test_bn_group_partition_rules():
    nodes = [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert bn_group_ranks(nodes, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert bn_group_ranks(nodes, 8) == [list(range(8))]
    assert bn_group_ranks([[0, 1], [2, 3], [4, 5], [6, 7]], 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(TopologyError, match="bn_group=3"):
        bn_group_ranks(nodes, 3)
    with pytest.raises(TopologyError, match="bn_group=6"):
        bn_group_ranks([[0, 1, 2, 3]] * 3, 6)


def _cuda_case(world) -> dict:
    """One rank on one GPU (NCCL): the custom autograd path against cuDNN BatchNorm on the same
    data."""
    torch.manual_seed(0)
    x = (torch.randn(8, 16, 8, 8, device=world.device) * 2 + 1).requires_grad_(True)
    dy = torch.randn_like(x)
    gbn = GroupBatchNorm2d(16, group=dist.group.WORLD, group_size=2).to(
        world.device
    )  # forces the group path
    ref = nn.BatchNorm2d(16).to(world.device)
    y = gbn(x)
    y.backward(dy)
    dx, x.grad = x.grad.clone(), None
    yr = ref(x)
    yr.backward(dy)
    return {
        "y": (y - yr).abs().max().item(),
        "dx": (dx - x.grad).abs().max().item(),
        "dw": (gbn.weight.grad - ref.weight.grad).abs().max().item(),
        "rv": (gbn.running_var - ref.running_var).abs().max().item(),
        "backend": world.backend,
    }


@pytest.mark.multi_process
@pytest.mark.gpu
def test_group_bn_cuda_nccl():
    from tests.distutil import run_dist

    (res,) = run_dist(_cuda_case, nnodes=1, nproc_per_node=1)
    assert res["backend"] == "nccl"
    assert res["y"] < 1e-4 and res["dx"] < 1e-4 and res["dw"] < 1e-3 and res["rv"] < 1e-5, res


def _own_communicator(world) -> dict:
    bn = bn_process_group(world, world.local_size)
    intra = world.intra
    ones = torch.ones(1)
    dist.all_reduce(ones, group=bn)
    return {
        "same_ranks": dist.get_process_group_ranks(bn) == dist.get_process_group_ranks(intra),
        "distinct": bn is not intra,
        "sum": ones.item(),
        "cached": bn is bn_process_group(world, world.local_size),
    }


@pytest.mark.multi_process
def test_bn_group_has_its_own_communicator() -> None:
    """bn_group = ranks per node: same ranks as world.intra, but not the same group (on NCCL one
    communicator driven from two threads, autograd for BN and the comm thread for the reducer,
    hangs or mixes data)."""
    from tests.distutil import run_dist

    for r in run_dist(_own_communicator, nnodes=2, nproc_per_node=2):
        assert r == {"same_ranks": True, "distinct": True, "sum": 2.0, "cached": True}


def _bn_sync(world) -> dict:
    from scaleout.families.resnet.config import ResNetConfig
    from scaleout.families.resnet.group_bn import sync_batchnorm_stats
    from scaleout.families.resnet.model import build_resnet

    torch.manual_seed(0)
    model = build_resnet(
        ResNetConfig(depth=18, width=4, num_classes=5, image_size=16), world
    ).train()
    torch.manual_seed(100 + world.rank)  # every rank sees different data
    with torch.no_grad():
        model(torch.randn(4, 3, 16, 16) * (1 + world.rank))
    bn = model.stem[1]
    before = torch.stack([bn.running_mean, bn.running_var]).clone()
    gathered = [torch.zeros_like(before) for _ in range(world.world_size)]
    dist.all_gather(gathered, before)
    n = sync_batchnorm_stats(model, world)
    means, vars_ = (
        torch.stack([g[0] for g in gathered]).double(),
        torch.stack([g[1] for g in gathered]).double(),
    )
    pooled_var = (vars_ + means**2).mean(0) - means.mean(0) ** 2
    buffers = torch.cat([b.reshape(-1) for name, b in model.named_buffers() if "running" in name])
    everyone = [torch.zeros_like(buffers) for _ in range(world.world_size)]
    dist.all_gather(everyone, buffers)
    return {
        "layers": n,
        "differed": not torch.equal(gathered[0], gathered[1]),
        "equal": all(torch.equal(e, everyone[0]) for e in everyone),
        "mean_err": (bn.running_mean.double() - means.mean(0)).abs().max().item(),
        "var_err": (bn.running_var.double() - pooled_var).abs().max().item(),
    }


@pytest.mark.multi_process
def test_running_stats_are_pooled_over_ranks() -> None:
    """bn_group = 1 (the 1024-GPU config): each rank's running statistics follow its own data;
    after sync_batchnorm_stats (the trainer calls it before evaluation and before a checkpoint)
    every rank holds the same buffers: the mean of the means, the pooled variance."""
    from tests.distutil import run_dist

    for r in run_dist(_bn_sync, nnodes=1, nproc_per_node=2):
        assert r["layers"] == 20 and r["differed"] and r["equal"], r
        assert r["mean_err"] < 1e-6 and r["var_err"] < 1e-5, r


@pytest.mark.unit
def test_eval_bn_batch_uses_batch_statistics_and_skips_the_sync():
    """model.resnet.eval_bn=batch (HPC-AI500's variant without the moving average): in eval mode
    every BN layer normalises with the batch's own statistics, leaves its running buffers alone,
    and sync_batchnorm_stats has nothing to pool; eval_bn=running keeps torch's BatchNorm2d."""
    from scaleout.families.resnet.config import ResNetConfig
    from scaleout.families.resnet.group_bn import sync_batchnorm_stats
    from scaleout.families.resnet.model import build_resnet

    cfg = ResNetConfig(depth=18, width=4, num_classes=5, image_size=16, eval_bn="batch")
    torch.manual_seed(0)
    model = build_resnet(cfg)
    torch.manual_seed(0)
    plain = build_resnet(cfg.model_copy(update={"eval_bn": "running"}))
    assert type(next(m for m in plain.modules() if isinstance(m, nn.BatchNorm2d))) is nn.BatchNorm2d
    x = torch.randn(6, 3, 16, 16) * 2 + 1
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    model.eval()
    with torch.no_grad():
        y_eval = model(x)
        plain.train()  # batch statistics: what training mode computes (without its EMA update)
        y_train_mode = plain(x)
        plain.eval()
        y_running = plain(x)
    assert torch.allclose(y_eval, y_train_mode, atol=1e-5)
    assert not torch.allclose(y_eval, y_running, atol=1e-3)  # the running stats are not used
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    world = type("W", (), {"world_size": 2})()
    assert sync_batchnorm_stats(model, world) == 0  # nothing to pool: no collective at all
