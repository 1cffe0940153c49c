"""scaleout bench sharded-overlap: step time of the sharded LAMB with and without communication overlap.

Runs inside the ranks (under any launcher), or one-shot: ``--nnodes/--nproc-per-node [--netns]`` starts
the ranks itself via ``scaleout launch``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from typing import Any

from scaleout.bench.common import add_one_shot_arguments, one_shot

NAME = "sharded-overlap"
HELP = "sharded LAMB step (backward + reduce-scatter + update + all-gather): overlapped vs not, BERT-like layers"
DESCRIPTION = """\
BERT-base-shaped encoder layers (hidden 768, 12 heads, FFN 3072; --layers of them) train on random data
with the ZeRO-1 sharded LAMB. In one run, interleaved step by step so noise hits all alike, it times a
full step (forward + backward + optimizer step with its communication; the slowest rank) of:

  compute only       forward + backward, no optimizer (the floor)
  sharded            ShardedLAMB: one bucket; reduce-scatter, update, all-gather after backward   <- baseline
  sharded overlap    ShardedLAMB(overlap=True): per-bucket reduce-scatter during backward, per-bucket
                     all-gather as soon as the bucket's shard is updated (apex DistributedFusedLAMB)

Both use --algorithm's reduce-scatter / all-gather (scaleout.comm: flat, hierarchical, torus2d).

examples:
  scaleout bench sharded-overlap --nnodes 2 --nproc-per-node 2 --netns --rate 1gbit     # one-shot
  scaleout launch --nnodes 2 --nproc-per-node 2 --netns --rate 1gbit -- scaleout bench sharded-overlap
"""

VARIANTS = ("compute only", "sharded", "sharded overlap")
BASELINE = "sharded"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=2, help="BERT-base-shaped encoder layers (default 2: 14.2M params, 57 MB)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default 128, BERT phase 1)")
    p.add_argument("--batch", type=int, default=2, help="per-rank batch size (default 2)")
    p.add_argument("--bucket-mb", type=float, default=8.0, help="overlap bucket size in MiB (default 8: ~7 buckets at 2 layers)")
    p.add_argument("--algorithm", default="flat", help="reduce-scatter / all-gather algorithm (flat, hierarchical, torus2d)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per variant; median reported (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    p.add_argument("--out", default="bench-results/sharded-overlap.json", help="JSON output (rank 0)")
    add_one_shot_arguments(p)


def run(args: argparse.Namespace) -> int:
    if args.nnodes is not None:
        return one_shot(args)
    return _in_rank(args)


def _in_rank(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    import scaleout
    from scaleout.bench.common import format_table, write_json
    from scaleout.bench.overlap import bert_like
    from scaleout.comm import get_algorithm
    from scaleout.errors import UserError
    from scaleout.optim import ShardedLAMB

    if min(args.layers, args.seq, args.batch, args.repeats) < 1 or args.warmup < 0 or args.bucket_mb <= 0:
        raise UserError(f"--layers={args.layers} --seq={args.seq} --batch={args.batch} --repeats={args.repeats} "
                        f"--warmup={args.warmup} --bucket-mb={args.bucket_mb}: expected positive numbers")
    get_algorithm(args.algorithm)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world = scaleout.init()
    if world.world_size < 2:
        raise UserError("scaleout bench sharded-overlap needs >= 2 ranks (e.g. --nnodes 2 --nproc-per-node 2 --netns)")
    say = (lambda *a: print(*a, flush=True)) if world.is_main else (lambda *a: None)
    torch.manual_seed(0)
    base = bert_like(args.layers)
    n_params = sum(q.numel() for q in base.parameters())
    models = {v: copy.deepcopy(base) for v in VARIANTS}
    opts: dict[str, Any] = {
        v: ShardedLAMB(models[v].parameters(), world, lr=1e-4, overlap=v == "sharded overlap", bucket_mb=args.bucket_mb,
                       algorithm=args.algorithm, param_order=models[v].parameters())
        for v in ("sharded", "sharded overlap")
    }
    nb = len(opts["sharded overlap"].buckets)
    say(f"sharded-overlap bench: {world.world_size} ranks = {world.num_nodes} nodes x {world.local_size}, {args.layers} "
        f"BERT-base layers ({n_params / 1e6:.1f}M params, {n_params * 4 / 2**20:.0f} MiB fp32), seq {args.seq}, "
        f"batch/rank {args.batch}, {nb} buckets of ~{args.bucket_mb:g} MiB, {args.algorithm}, median of {args.repeats}")
    g = torch.Generator().manual_seed(world.rank)
    x = torch.randn(args.batch, args.seq, 768, generator=g)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    phases: dict[str, list[dict[str, float]]] = {v: [] for v in opts}
    total = args.warmup + args.repeats
    for it in range(total):
        for v in VARIANTS:  # interleaved: every variant sees the same background load
            m = models[v]
            world.barrier()
            t0 = time.perf_counter()
            m(x).square().mean().backward()
            if v in opts:
                opts[v].step()
                opts[v].zero_grad(set_to_none=True)
            else:
                m.zero_grad(set_to_none=True)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # a step ends when the slowest rank does
            if it >= args.warmup:
                times[v].append(float(dt))
                if v in opts:
                    phases[v].append(dict(opts[v].timings))
        say(f"  step {it + 1}/{total}" + (" (warmup)" if it < args.warmup else "") + ": "
            + ", ".join(f"{v} {times[v][-1]:.3f}s" for v in VARIANTS if times[v] and it >= args.warmup))
    med = {v: statistics.median(times[v]) for v in VARIANTS}
    floor = med["compute only"]
    rows, out_rows = [], []
    for v in VARIANTS:
        ph = {k: statistics.median(p.get(k, 0.0) for p in phases[v]) for k in sorted({k for p in phases.get(v, []) for k in p})}
        after = med[v] - floor  # what the optimizer and its communication add to backward
        rows.append([v, med[v] * 1e3, after * 1e3, med[BASELINE] / med[v], min(times[v]) * 1e3, max(times[v]) * 1e3])
        out_rows.append({"variant": v, "median_s": med[v], "added_over_compute_s": after, "speedup_vs_sharded": med[BASELINE] / med[v],
                         "times_s": times[v], "phases_median_s": ph})
    say(format_table(["variant", "step ms (median)", "over compute ms", "speed-up vs sharded", "min ms", "max ms"], rows))
    ratio = med[BASELINE] / med["sharded overlap"]
    say(f"overlapped / non-overlapped sharded LAMB step: {ratio:.2f}x faster "
        f"(added over compute: {(med['sharded'] - floor) * 1e3:.0f} -> {(med['sharded overlap'] - floor) * 1e3:.0f} ms)")
    if world.is_main:
        path = write_json(args.out, {
            "bench": NAME, "world_size": world.world_size, "nodes": world.num_nodes, "layers": args.layers, "seq": args.seq,
            "batch": args.batch, "bucket_mb": args.bucket_mb, "buckets": nb, "algorithm": args.algorithm, "params": n_params, "repeats": args.repeats,
            "baseline": BASELINE, "ratio_overlap_vs_sharded": ratio, "rows": out_rows,
        })
        if path:
            say(f"wrote {path}")
    return 0
