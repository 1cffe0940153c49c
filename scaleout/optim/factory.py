"""What a trainer calls: ``build_optimizer(model, cfg.optim, world)`` and ``build_schedule(opt,
cfg.optim)``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from scaleout.comm.collective import Collective
from scaleout.config.schema import CommConfig, OptimConfig
from scaleout.errors import ConfigError
from scaleout.optim.adamw import clip_before_step
from scaleout.optim.groups import GENERIC_NO_DECAY, param_groups
from scaleout.optim.lamb import LAMB
from scaleout.optim.lars import LARS
from scaleout.optim.lazy_dynamo import import_before_the_clock
from scaleout.optim.schedule import warmup_cosine, warmup_poly
from scaleout.optim.sharded import ShardedLAMB

if TYPE_CHECKING:
    from scaleout.world import World


def build_optimizer(
    model: torch.nn.Module,
    cfg: OptimConfig,
    world: World | None = None,
    comm: CommConfig | None = None,
    no_decay: Sequence[str] = GENERIC_NO_DECAY,
) -> torch.optim.Optimizer:
    """The optimizer named by ``optim.name`` over the model's parameters, with the reference's
    groups.

    ``no_decay``: the name patterns of the model family (``Family.no_decay``: NVIDIA BERT's
    bias/gamma/beta/LayerNorm, MLPerf ResNet's bias and batch norm) get no weight decay and no trust
    ratio, and neither do normalisation layers (scaleout/optim/groups.py). ``optim.sharded`` selects
    :class:`ShardedLAMB` over ``world`` (lamb, or adamw: its mode without the trust ratio), with
    ``comm``'s algorithm (and torus grid) for its reduce-scatter / all-gather:
    ``optim.overlap_comm`` buckets of ``comm.bucket_mb`` reduce-scattered during backward,
    otherwise one bucket sent in ``step()``; ``optim.shard`` (world / node) and
    ``comm.compression`` (the gradients' wire dtype) as ShardedLAMB says.
    """
    groups = param_groups(model, cfg.weight_decay, no_decay)
    on_cpu = next(model.parameters()).device.type == "cpu"
    # the rules between optim.* keys (overlap_comm / shard need sharded, sharded needs lamb) are
    # the schema's (OptimConfig): ``cfg`` is a validated section
    if cfg.name == "adamw" and cfg.sharded:
        # AdamW is LAMB with the trust ratio fixed at 1: u = m^/(sqrt(v^)+eps) + wd w, w -= lr u is
        # torch's decoupled-decay AdamW step (w(1 - lr wd) - lr m^/(sqrt(v^)+eps)), so the sharded
        # LAMB's reduce-scatter / update / all-gather runs it unchanged (one implementation, a mode)
        for g in groups:
            g["trust_ratio"] = False
    if cfg.name == "lamb" or cfg.sharded:
        kw = dict(
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.eps,
            bias_correction=cfg.bias_correction,
            trust_clamp=cfg.trust_clamp,
            clip_grad_norm=cfg.clip_grad_norm,
        )
        if cfg.sharded:
            if world is None:
                raise ConfigError(
                    "optim.sharded=true needs the World of a distributed run (build_optimizer(..., "
                    "world=world))"
                )
            comm = comm or CommConfig()
            # resolved once here (shard=node reduces over the node's own groups instead)
            collective = Collective.from_config(comm, world) if cfg.shard == "world" else None
            return ShardedLAMB(
                groups,
                world,
                overlap=cfg.overlap_comm,
                bucket_mb=comm.bucket_mb,
                algorithm=collective or comm.algorithm,
                param_order=model.parameters(),
                shard=cfg.shard,
                compression=comm.wire_compression,
                module=model,  # the next forward waits for the all-gathers, bucket by bucket
                **kw,
            )
        return LAMB(groups, **kw)
    if cfg.name == "lars":
        return LARS(
            groups, lr=cfg.lr, momentum=cfg.momentum, eta=cfg.eta, trust_clamp=cfg.trust_clamp
        )
    for g in groups:  # torch optimizers do not know these keys
        g.pop("trust_ratio", None)
    if cfg.name == "adamw":
        # CPU: torch's fused kernel (one pass per tensor; torch >= 2.4), as a plain torch loop
        # uses it (scaleout/bench/_ttt_baseline.py): 2.5x faster than foreach here, which cost
        # scaleout's trainer ~5 % of the step against that loop (docs/ttt.md). Elsewhere torch's
        # default (foreach on CUDA).
        kw = {"fused": True} if on_cpu else {}
        try:
            opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, **kw)
        except (RuntimeError, TypeError):  # a torch without the CPU kernel
            opt = torch.optim.AdamW(
                groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=True if on_cpu else None
            )
        return import_before_the_clock(clip_before_step(opt, cfg.clip_grad_norm))
    return import_before_the_clock(
        torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, foreach=True if on_cpu else None)
    )


def build_schedule(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``optim.warmup_steps`` then, by ``optim.schedule``, polynomial decay
    (``power``) or a half cosine to ``end_lr`` at ``total_steps``; call ``.step()`` once per
    optimizer step."""
    if cfg.schedule == "cosine":
        return warmup_cosine(optimizer, cfg.warmup_steps, cfg.total_steps, cfg.end_lr)
    return warmup_poly(
        optimizer,
        cfg.warmup_steps,
        cfg.total_steps,
        cfg.power,
        cfg.end_lr,
        cfg.decay_from,
        cfg.start_warmup_step,
    )
