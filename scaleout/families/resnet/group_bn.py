"""Group batch norm: BatchNorm2d whose batch statistics cover a group of k ranks.

Record ResNet-50 runs keep only tens of images per GPU (35 in NVIDIA's 128x8 MLPerf v1.0 config),
and BN over so few samples hurts accuracy, so statistics are computed over k ranks (k = 2, 4, 8;
e.g. NVIDIA's MLPerf MXNet ResNet "bn group" option; Goyal et al. 2017, arXiv 1706.02677, sec. 5.2,
discuss the per-worker BN batch size). Groups are formed within a node first (k consecutive local
ranks, which share the fast intra-node link) and span consecutive whole nodes only when k is a
multiple of the ranks per node.

Forward all-gathers each rank's fp32 [mean, biased var, count] per channel in the group (on CUDA
from torch's fused Welford kernel ``torch.batch_norm_stats``, as SyncBatchNorm does; no fp64 and
no full-size copy) and combines them with Chan's parallel formula; the output is written in the
activation's dtype (bf16 under autocast: ``torch.batch_norm_elemt`` on CUDA, per-channel scale and
shift elsewhere). Only x is saved for backward (no normalised copy). Backward all-reduces
[sum dy, sum dy*(x - mean)]. With xhat = (x - mean) invstd, y = w xhat + b and N = group count the
input gradient is

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
import torch.nn.functional as F
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


# torch >= 2.13 names it all_gather_single (all_gather_into_tensor is deprecated there)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _fused(x: torch.Tensor) -> bool:
    """Use torch's CUDA batch-norm kernels: x's memory is on a GPU. The storage's device, not
    ``x.is_cuda``: an emulated device (tests/fakecuda.py) answers is_cuda for CPU memory, where
    those kernels do not exist."""
    return x.is_cuda and x.untyped_storage().device.type == "cuda"


def _local_stats(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's per-channel (mean, biased variance) in fp32, whatever x's dtype. CUDA: torch's
    fused Welford kernel (``torch.batch_norm_stats``, as SyncBatchNorm uses), which reads x once
    and materialises nothing. Elsewhere (CPU, tests): a two-pass fp32 mean/variance (the kernel
    exists only for CUDA)."""
    if _fused(x):
        mean, invstd = torch.batch_norm_stats(x, eps)
        return mean, invstd.pow(-2) - eps
    dims = [0] + list(range(2, x.dim()))
    var, mean = torch.var_mean(x.float(), dims, correction=0)
    return mean, var


def _combine(stats: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chan et al.'s parallel combination of the group's per-rank rows [mean (c), var (c), count]:
    (mean, biased var, total count), fp32, stable (no E[x^2] - E[x]^2 cancellation)."""
    means, vars_, counts = stats[:, :c], stats[:, c : 2 * c], stats[:, 2 * c :]
    n = counts.sum()
    mean = (means * counts).sum(0) / n
    var = ((vars_ + (means - mean).square()) * counts).sum(0) / n
    return mean, var, n


class _GroupBNFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, eps):  # type: ignore[override]
        c = x.shape[1]
        group_size = dist.get_world_size(group)  # the group's own size (a host-side lookup)
        local_mean, local_var = _local_stats(x, eps)
        count = torch.full((1,), x.numel() // c, dtype=torch.float32, device=x.device)
        mine = torch.cat([local_mean, local_var, count])
        rows = torch.empty(group_size * mine.numel(), dtype=mine.dtype, device=mine.device)
        _all_gather_single(rows, mine, group=group)
        rows = rows.view(group_size, mine.numel())
        mean, var, n = _combine(rows, c)
        invstd = torch.rsqrt(var + eps)
        w = weight.float()
        if _fused(x):  # fused: fp32 maths, output in x's dtype (bf16 under autocast)
            y = torch.batch_norm_elemt(x, weight, bias, mean, invstd, eps)
        else:  # y = x * scale + shift with per-channel fp32 coefficients, cast to x's dtype
            shape = [1, c] + [1] * (x.dim() - 2)
            scale = w * invstd
            shift = bias.float() - mean * scale
            y = torch.addcmul(shift.to(x.dtype).view(shape), x, scale.to(x.dtype).view(shape))
        # x itself is saved (no normalised copy): backward recomputes (x - mean) * invstd
        ctx.save_for_backward(x, weight, mean, invstd, n, rows[:, 2 * c])
        ctx.group = group  # n stays a device tensor: reading it would stall the host per layer
        ctx.mark_non_differentiable(mean, var, n)
        return y, mean, var, n

    @staticmethod
    def backward(ctx, dy, _dmean, _dvar, _dn):  # type: ignore[override]
        x, weight, mean, invstd, n, counts = ctx.saved_tensors
        c = dy.shape[1]
        dy = dy.contiguous(memory_format=_memory_format(x))
        if _fused(dy):
            sum_dy, sum_dy_xmu, grad_weight, grad_bias = torch.batch_norm_backward_reduce(
                dy, x, mean, invstd, weight, True, True, True
            )
        else:
            dims = [0] + list(range(2, dy.dim()))
            shape = [1, c] + [1] * (dy.dim() - 2)
            sum_dy = dy.sum(dims, dtype=torch.float32)
            sum_dy_xmu = (dy.float() * (x.float() - mean.view(shape))).sum(dims)
            grad_weight, grad_bias = sum_dy_xmu * invstd, sum_dy.clone()
        # weight/bias gradients stay this rank's local sums (see the module doc)
        both = torch.cat([sum_dy, sum_dy_xmu])
        dist.all_reduce(both, group=ctx.group)
        sum_dy, sum_dy_xmu = both[:c], both[c:]
        if _fused(dy):
            dx = torch.batch_norm_backward_elemt(
                dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, counts.to(torch.int32)
            )
        else:
            # dx = w invstd (dy - sum_dy / N - (x - mean) invstd^2 sum_dy_xmu / N)
            #    = a dy + b x + d, per-channel fp32 coefficients cast to dy's dtype
            shape = [1, c] + [1] * (dy.dim() - 2)
            a = weight.float() * invstd
            b = -a * invstd * invstd * sum_dy_xmu / n
            d = -a * sum_dy / n - b * mean
            dx = torch.addcmul(
                torch.addcmul(d.to(dy.dtype).view(shape), x, b.to(dy.dtype).view(shape)),
                dy,
                a.to(dy.dtype).view(shape),
            )
        return dx, grad_weight.to(weight.dtype), grad_bias.to(weight.dtype), None, None


def _memory_format(x: torch.Tensor) -> torch.memory_format:
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


class GroupBatchNorm2d(nn.BatchNorm2d):
    """Drop-in BatchNorm2d with statistics over ``group`` (a process group; None = plain BN).

    ``eval_bn="batch"`` (HPC-AI500's "no moving average" variant): in eval mode every batch is
    normalised with its own statistics (this rank's), the running buffers are neither read nor
    updated, and :func:`sync_batchnorm_stats` leaves the layer out."""

    def __init__(
        self,
        num_features: int,
        group: Any = None,
        group_size: int = 1,
        eval_bn: str = "running",
        **kwargs: Any,
    ):
        super().__init__(num_features, **kwargs)
        if eval_bn not in ("running", "batch"):
            raise TopologyError(f"model.resnet.eval_bn={eval_bn!r}: expected running or batch")
        self.group = group
        self.group_size = group_size
        self.eval_bn = eval_bn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training and self.eval_bn == "batch":
            return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)
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
                unbiased = var * (n / (n - 1).clamp_min(1))  # n = 1: factor 1, no host read
                self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)
        return y

    def extra_repr(self) -> str:
        return super().extra_repr() + f", group_size={self.group_size}, eval_bn={self.eval_bn}"


def norm_factory(world: World | None = None, k: int = 1, eval_bn: str = "running") -> Any:
    """A ``num_features -> BatchNorm`` callable for model builders: plain BN for k = 1 (with
    ``eval_bn="batch"``: a GroupBatchNorm2d without a group, for its evaluation mode)."""
    if k == 1 or world is None or world.world_size == 1:
        if k > 1 and world is None:
            raise TopologyError(
                f"model.resnet.bn_group={k} needs a World (distributed run), got none"
            )
        if eval_bn == "running":
            return nn.BatchNorm2d
        return lambda c: GroupBatchNorm2d(c, eval_bn=eval_bn)
    group = bn_process_group(world, k)
    return lambda c: GroupBatchNorm2d(c, group=group, group_size=k, eval_bn=eval_bn)


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
        and getattr(m, "eval_bn", "running") == "running"  # batch-statistics eval: nothing to sync
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
