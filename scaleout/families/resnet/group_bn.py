"""Group batch norm: BatchNorm2d whose batch statistics cover a group of k ranks.

Record ResNet-50 runs keep only tens of images per GPU (35 in NVIDIA's 128x8 MLPerf v1.0 config),
and BN over so few samples hurts accuracy, so statistics are computed over k ranks (k = 2, 4, 8;
e.g. NVIDIA's MLPerf MXNet ResNet "bn group" option; Goyal et al. 2017, arXiv 1706.02677, sec. 5.2,
discuss the per-worker BN batch size). Groups are formed within a node first (k consecutive local
ranks, which share the fast intra-node link) and span consecutive whole nodes only when k is a
multiple of the ranks per node.

Forward all-reduces one vector [sum x, sum x^2, count] per channel in the group; backward
all-reduces [sum dy, sum dy*xhat]. With y = w xhat + b and N = group count the input gradient is

dx = w * invstd / N * (N dy - sum_g dy - xhat * sum_g dy*xhat)

which is exactly plain BN's gradient over the concatenated group batch. Weight and bias gradients
stay local sums: summed over the group (as data-parallel gradient averaging does) they equal plain
BN's. Every rank of a group sees the same all-reduced statistics, so running mean/var stay
identical. k = 1 (or eval mode) takes PyTorch's own BatchNorm path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from scaleout.errors import TopologyError

if TYPE_CHECKING:
    from scaleout.world import World


def bn_group_ranks(ranks_per_node: list[list[int]], k: int) -> list[list[int]]:
    """Partition all ranks into groups of k: within a node first, else k/local consecutive whole
    nodes."""
    world = sum(len(n) for n in ranks_per_node)
    local = len(ranks_per_node[0])
    if k < 1 or world % k:
        raise TopologyError(f"model.resnet.bn_group={k} must divide the world size {world}")
    if any(len(n) != local for n in ranks_per_node):
        raise TopologyError(
            f"group BN needs the same ranks on every node, got {[len(n) for n in ranks_per_node]}"
        )
    if local % k == 0:
        return [node[i : i + k] for node in ranks_per_node for i in range(0, local, k)]
    if k % local == 0:
        per = k // local
        return [sum(ranks_per_node[i : i + per], []) for i in range(0, len(ranks_per_node), per)]
    raise TopologyError(
        f"model.resnet.bn_group={k} must divide the ranks per node ({local}) or be a multiple of it"
    )


def bn_process_group(world: World, k: int) -> Any:
    """This rank's group-BN process group (created once, in the same order on every rank)."""
    if k == 1:
        return None
    parts = bn_group_ranks(world.ranks_per_node, k)
    # World.partition creates every part's group in one fixed order on all ranks and caches it. Its
    # own communicator (shared=False), never world.intra's: BN's all-reduces and the reducer's
    # hierarchical/torus phases interleave on the same ranks, and NCCL matches a communicator's
    # collectives only by issue order. On a GPU both are issued by this rank's autograd thread (BN's
    # backward and the reducer's hooks), the bucket phases on the comm stream, never from the comm
    # thread (scaleout.comm.handles, the stream/thread rule), so every rank enqueues them in one
    # order and the two communicators cannot deadlock each other.
    return world.partition(f"bn_group{k}", parts, shared=False)


class _GroupBNFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, eps):  # type: ignore[override]
        dims = [0] + list(range(2, x.dim()))
        c = x.shape[1]
        count = torch.full((1,), x.numel() // c, dtype=torch.float64, device=x.device)
        # fp64 for the reduced sums: E[x^2] - E[x]^2 cancels badly in fp32 over large groups.
        stats = torch.cat(
            [x.sum(dims, dtype=torch.float64), (x.double() * x.double()).sum(dims), count]
        )
        dist.all_reduce(stats, group=group)
        n = stats[-1]
        mean = stats[:c] / n
        var = (stats[c : 2 * c] / n - mean * mean).clamp_min(0.0)
        invstd = torch.rsqrt(var + eps)
        shape = [1, c] + [1] * (x.dim() - 2)
        xhat = (x - mean.to(x.dtype).view(shape)) * invstd.to(x.dtype).view(shape)
        y = xhat * weight.view(shape) + bias.view(shape)
        ctx.save_for_backward(xhat, weight, invstd.to(x.dtype), n)
        ctx.group = (
            group  # n stays a device tensor: reading it would stall the host once per BN layer
        )
        mean, var = mean.to(x.dtype), var.to(x.dtype)
        ctx.mark_non_differentiable(mean, var, n)
        return y, mean, var, n

    @staticmethod
    def backward(ctx, dy, _dmean, _dvar, _dn):  # type: ignore[override]
        xhat, weight, invstd, n = ctx.saved_tensors
        dims = [0] + list(range(2, dy.dim()))
        c = dy.shape[1]
        local = torch.cat([dy.sum(dims), (dy * xhat).sum(dims)])
        grad_bias, grad_weight = local[:c].clone(), local[c:].clone()  # local sums (see module doc)
        dist.all_reduce(local, group=ctx.group)
        shape = [1, c] + [1] * (dy.dim() - 2)
        sum_dy, sum_dy_xhat = local[:c].view(shape), local[c:].view(shape)
        n = n.to(dy.dtype)
        dx = (weight * invstd).view(shape) / n * (n * dy - sum_dy - xhat * sum_dy_xhat)
        return dx, grad_weight, grad_bias, None, None


class GroupBatchNorm2d(nn.BatchNorm2d):
    """Drop-in BatchNorm2d with statistics over ``group`` (a process group; None = plain BN)."""

    def __init__(self, num_features: int, group: Any = None, group_size: int = 1, **kwargs: Any):
        super().__init__(num_features, **kwargs)
        self.group = group
        self.group_size = group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.group is None or self.group_size == 1:
            return super().forward(x)
        if self.momentum is None:  # cumulative moving average, as nn.BatchNorm2d does
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked)
        else:
            self.num_batches_tracked.add_(1)
            factor = self.momentum
        y, mean, var, n = _GroupBNFunction.apply(x, self.weight, self.bias, self.group, self.eps)
        if self.track_running_stats:
            with torch.no_grad():
                unbiased = var * (n / (n - 1).clamp_min(1)).to(
                    var.dtype
                )  # n = 1: factor 1, no host read
                self.running_mean.mul_(1 - factor).add_(mean.detach(), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.detach(), alpha=factor)
        return y

    def extra_repr(self) -> str:
        return super().extra_repr() + f", group_size={self.group_size}"


def norm_factory(world: World | None = None, k: int = 1) -> Any:
    """A ``num_features -> BatchNorm`` callable for model builders: plain BN for k = 1."""
    if k == 1 or world is None or world.world_size == 1:
        if k > 1 and world is None:
            raise TopologyError(
                f"model.resnet.bn_group={k} needs a World (distributed run), got none"
            )
        return nn.BatchNorm2d
    group = bn_process_group(world, k)
    return lambda c: GroupBatchNorm2d(c, group=group, group_size=k)


@torch.no_grad()
def sync_batchnorm_stats(model: nn.Module, world: World) -> int:
    """Make every rank's BN running statistics the pooled statistics of all ranks; returns how many
    BN layers were synchronised. Collective: every rank calls it at the same point (before
    evaluation and before a checkpoint), so each rank evaluates with, and a checkpoint stores, the
    same statistics and a resume is exact on every rank (otherwise rank r keeps the EMA of its own
    batches: with ``bn_group`` = 1 each rank evaluates its eval shard with different statistics and
    a checkpoint keeps only rank 0's).

    Means are averaged; variances are pooled as E[var + mean^2] - E[mean]^2 (the variance of the
    union of equal-sized per-rank populations: the between-rank spread of the means included).
    One all-reduce of every layer's [mean, var + mean^2] on the stats' device, in fp64."""
    bns = [
        m
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        and m.track_running_stats
        and m.running_mean is not None
    ]
    if world.world_size == 1 or not bns:
        return len(bns) if world.world_size == 1 else 0
    means = [m.running_mean.double() for m in bns]
    flat = torch.cat(
        [*means, *(m.running_var.double() + mu * mu for m, mu in zip(bns, means, strict=True))]
    )
    dist.all_reduce(flat)
    flat /= world.world_size
    half, off = flat.numel() // 2, 0
    for m in bns:
        n = m.running_mean.numel()
        mean, second = flat[off : off + n], flat[half + off : half + off + n]
        m.running_mean.copy_(mean)
        m.running_var.copy_((second - mean * mean).clamp_min(0.0))
        off += n
    return len(bns)
