"""scaleout bench sharded-overlap: step time of the sharded LAMB with and without communication
overlap.

Runs inside the ranks (under any launcher), or one-shot: ``--nnodes/--nproc-per-node [--netns]``
starts the ranks itself via ``scaleout launch``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from scaleout.bench import _harness as h

if TYPE_CHECKING:
    from scaleout.world import World

NAME = "sharded-overlap"
HELP = (
    "sharded LAMB step (backward + reduce-scatter + update + all-gather): overlapped vs not, "
    "BERT-like layers"
)
DESCRIPTION = """\
BERT-base-shaped encoder layers (hidden 768, 12 heads, FFN 3072; --layers of them) train on random
data with the ZeRO-1 sharded LAMB. In one run, interleaved step by step so noise hits all alike, it
times a full step (forward + backward + optimizer step with its communication; the slowest rank) of:

  compute only       forward + backward, no optimizer (the floor)
  sharded            ShardedLAMB: one bucket; reduce-scatter, update, all-gather after backward   <-
  baseline
  sharded overlap    ShardedLAMB(overlap=True): per-bucket reduce-scatter during backward,
  per-bucket
                     all-gather as soon as the bucket's shard is updated (apex DistributedFusedLAMB)
  gather in forward  the same, step() does not wait for the all-gathers: the next forward's
                     pre-hooks wait bucket by bucket (the trainer's way: module=model)
  node               the same sharded within the node (optim.shard=node): reduce-scatter in the
                     node, all-reduce of the slice across nodes, all-gather in the node
  node bf16          node with comm.compression=bf16: the gradients' wire dtype, fp32 sums

The first three use --algorithm's reduce-scatter / all-gather (scaleout.comm: flat, hierarchical,
torus2d).

examples:
  scaleout bench sharded-overlap --nnodes 2 --nproc-per-node 2 --netns --rate 1gbit     # one-shot
  scaleout launch --nnodes 2 --nproc-per-node 2 --netns --rate 1gbit -- scaleout bench
  sharded-overlap
"""

VARIANTS = ("compute only", "sharded", "sharded overlap", "gather in forward", "node", "node bf16")
DEFERRED = VARIANTS[3:]  # ShardedLAMB(module=...): the next forward waits for the all-gathers
BASELINE = "sharded"


SMOKE_ARGS = h.BERT_LAYER_SMOKE_ARGS


def add_arguments(p: argparse.ArgumentParser) -> None:
    h.add_bert_layer_arguments(p)
    p.add_argument("--batch", type=int, default=2, help="per-rank batch size (default 2)")
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=8.0,
        help="overlap bucket size in MiB (default 8: ~7 buckets at 2 layers)",
    )
    p.add_argument(
        "--algorithm",
        default="flat",
        help="reduce-scatter / all-gather algorithm (flat, hierarchical, torus2d)",
    )
    h.add_rank_arguments(p, NAME, repeats=5, warmup=1)


def run(args: argparse.Namespace) -> int:
    return h.in_ranks(args, _in_rank)


def _steps(
    args: argparse.Namespace, world: World
) -> tuple[dict[str, Callable[[], Any]], int, int, list[Callable[[], None]]]:
    """(variant -> one full step, parameters, buckets of the overlapped optimizer, the waits for
    the deferred variants' last all-gathers)."""

    import torch

    from scaleout.bench.overlap import bert_like
    from scaleout.optim import ShardedLAMB

    torch.manual_seed(0)
    base = bert_like(args.layers)
    x = torch.randn(args.batch, args.seq, 768, generator=torch.Generator().manual_seed(world.rank))

    models = {v: copy.deepcopy(base) for v in VARIANTS}
    opts = {
        v: ShardedLAMB(
            models[v].parameters(),
            world,
            lr=1e-4,
            overlap=v != "sharded",
            bucket_mb=args.bucket_mb,
            algorithm=args.algorithm,
            param_order=models[v].parameters(),
            shard="node" if v.startswith("node") else "world",
            compression="bf16" if v == "node bf16" else None,
            module=models[v] if v in DEFERRED else None,
        )
        for v in VARIANTS[1:]
    }

    def step(v: str) -> Callable[[], Any]:
        m, opt = models[v], opts.get(v)

        def run() -> dict[str, float] | None:
            m(x).square().mean().backward()
            if opt is None:
                m.zero_grad(set_to_none=True)
                return None
            opt.step()
            opt.zero_grad(set_to_none=True)
            return dict(opt.timings)

        return run

    return (
        {v: step(v) for v in VARIANTS},
        sum(q.numel() for q in base.parameters()),
        len(opts["sharded overlap"].buckets),
        [opts[v].wait_params for v in DEFERRED],
    )


def _in_rank(args: argparse.Namespace) -> int:
    from scaleout.comm import get_algorithm
    from scaleout.errors import UserError

    h.check_counts(args, layers=1, seq=1, batch=1, repeats=1, warmup=0)
    if args.bucket_mb <= 0:
        raise UserError(f"--bucket-mb={args.bucket_mb}: expected a positive number of MiB")
    get_algorithm(args.algorithm)
    world = h.init_ranks(2, NAME)
    steps, n_params, nb, finish = _steps(args, world)
    h.say0(world)(
        f"sharded-overlap bench: {world.world_size} ranks = {world.num_nodes} nodes x "
        f"{world.local_size}, "
        f"{args.layers} BERT-base layers ({n_params / 1e6:.1f}M params, {n_params * 4 / 2**20:.0f} "
        "MiB fp32), seq "
        f"{args.seq}, batch/rank {args.batch}, {nb} buckets of ~{args.bucket_mb:g} MiB, "
        f"{args.algorithm}, "
        f"median of {args.repeats}"
    )
    samples = h.interleave(steps, args.repeats, args.warmup, world=world, say=h.say0(world))
    for wait in finish:  # the last step's all-gathers of the deferred variants
        wait()
    rows = h.compare(samples, baseline=BASELINE)
    floor = next(r.median_s for r in rows if r.name == "compute only")
    by = {r.name: r for r in rows}
    ratio = by["sharded overlap"].speedup
    out_rows = [
        {
            "variant": r.name,
            "median_s": r.median_s,
            "added_over_compute_s": r.median_s - floor,
            "speedup_vs_sharded": r.speedup,
            "times_s": r.times_s,
            "phases_median_s": _phases(samples[r.name]),
        }
        for r in rows
    ]
    h.emit(
        args,
        NAME,
        [
            "variant",
            "step ms (median)",
            "over compute ms",
            "speed-up vs sharded",
            "min ms",
            "max ms",
        ],
        [
            [
                r.name,
                r.median_s * 1e3,
                (r.median_s - floor) * 1e3,
                r.speedup,
                r.min_s * 1e3,
                r.max_s * 1e3,
            ]
            for r in rows
        ],
        {
            "world_size": world.world_size,
            "nodes": world.num_nodes,
            "layers": args.layers,
            "seq": args.seq,
            "batch": args.batch,
            "bucket_mb": args.bucket_mb,
            "buckets": nb,
            "algorithm": args.algorithm,
            "params": n_params,
            "repeats": args.repeats,
            "baseline": BASELINE,
            "ratio_overlap_vs_sharded": ratio,
            "rows": out_rows,
        },
        notes=[
            f"overlapped / non-overlapped sharded LAMB step: {ratio:.2f}x faster (added over "
            "compute: "
            f"{(by['sharded'].median_s - floor) * 1e3:.0f} -> "
            f"{(by['sharded overlap'].median_s - floor) * 1e3:.0f} ms)"
        ],
        world=world,
    )
    world.close()
    return 0


def _phases(timings: list[Any]) -> dict[str, float]:
    """Median seconds of each optimizer phase (pack, reduce_scatter, update, all_gather, ...)
    over the steps."""
    phases = [t.value for t in timings if t.value]
    return {
        k: statistics.median(p.get(k, 0.0) for p in phases)
        for k in sorted({k for p in phases for k in p})
    }
