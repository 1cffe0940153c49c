"""scaleout bench overlap: step time of gradient communication with and without overlap, per algorithm,
against torch DDP with the same bucket size, and how much communication backward hides.

Runs inside the ranks (under any launcher), or one-shot: ``--nnodes/--nproc-per-node [--netns]``
starts the ranks itself via ``scaleout launch`` (emulated cluster: launchers/netns.py).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Any

from scaleout.bench.common import add_one_shot_arguments, one_shot, pyplot

NAME = "overlap"
HELP = "overlapped bucketed all-reduce vs no overlap vs torch DDP on BERT-like layers: step time, hidden comm"
DESCRIPTION = """\
A model of BERT-base-shaped encoder layers (hidden 768, 12 heads, FFN 3072; --layers of them) trains on
random data; in one run, interleaved step by step so noise hits all alike, it times a full step
(forward + backward + gradient averaging, the slowest rank) of:

  compute only       no communication at all (the floor)
  no overlap         DataParallel(overlap=False): every bucket all-reduced after backward (flat)
  overlap flat       DataParallel(algorithm='flat')
  overlap hier       DataParallel(algorithm='hierarchical')
  torch DDP          DistributedDataParallel(bucket_cap_mb=same)     <- the baseline of the ratios
  DDP + hier hook    DDP with scaleout.parallel.ddp_comm_hook('hierarchical')

and, with the same buckets and no compute, the communication alone. Exposed communication = step -
compute-only step; hidden = 1 - exposed / communication alone (so CPU contention between backward and
communication counts as exposed). DataParallel's own measure (wait after backward) is shown too.
Each --batch value is one regime: small batches are communication-bound (step ~ communication, where
the algorithm matters), large batches compute-bound (where overlap can hide communication).

examples:
  scaleout bench overlap --nnodes 2 --nproc-per-node 2 --netns --rate 1gbit          # one-shot
  scaleout launch --nnodes 2 --nproc-per-node 2 --netns -- scaleout bench overlap --batch 1,8
"""

VARIANTS = ("compute only", "no overlap", "overlap flat", "overlap hier", "torch DDP", "DDP + hier hook")
BASELINE = "torch DDP"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=2, help="BERT-base-shaped encoder layers (default 2: 14.2M params, 57 MB)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default 128, BERT phase 1)")
    p.add_argument("--batch", default="1,6", help="comma list of per-rank batch sizes, one regime each (default 1,6)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size in MiB for all variants (default 25)")
    p.add_argument("--first-bucket-mb", type=float, default=1.0,
                   help="first bucket cap for DataParallel, as torch DDP's 1 MiB default (0 = same as --bucket-mb)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per variant; median reported (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    p.add_argument("--comm-nice", type=int, default=0,
                   help="lower the compute thread's priority by this nice value below the communication threads "
                        "(World.prioritize_communication; applies to every variant alike, DDP included; default 0)")
    p.add_argument("--timeline", default=None, help="also write a Chrome trace of the overlap-hier steps here")
    p.add_argument("--out", default="bench-results/overlap.json", help="JSON output (rank 0)")
    p.add_argument("--png", default="bench-results/overlap.png", help="PNG of step times ('' = none; needs matplotlib)")
    add_one_shot_arguments(p)


def run(args: argparse.Namespace) -> int:
    if args.nnodes is not None:
        return one_shot(args)
    return _in_rank(args)



def bert_like(layers: int) -> Any:
    """BERT-base layer shapes (Devlin et al.: hidden 768, 12 heads, intermediate 3072) and a small head."""
    import torch

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(
                torch.nn.TransformerEncoderLayer(768, 12, 3072, dropout=0.0, activation="gelu", batch_first=True)
                for _ in range(layers)
            )
            self.head = torch.nn.Linear(768, 768)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    return Encoder()


def _reduce_max(world: Any, values: list[float]) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _comm_only(world: Any, dp: Any) -> float:
    """All of ``dp``'s buckets, launched back to back in order, no compute: the communication alone."""
    from scaleout.comm import all_reduce

    bufs = [b.buffer.clone() for b in dp.reducer.buckets]
    world.barrier()
    t, cpu = time.perf_counter(), time.process_time()
    handles = [all_reduce(b, world, dp.algorithm, op="sum", async_op=True) for b in bufs]
    for h in handles:
        h.wait()
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    _COMM_CPU.setdefault(dp.algorithm, []).append(_reduce_max(world, [cpu])[0])
    return _reduce_max(world, [wall])[0]


# CPU seconds (all threads of the rank: gloo IO, comm thread, reductions) that the communication alone
# used, max over ranks, per algorithm: on a CPU-only box this work competes with backward for the cores.
_COMM_CPU: dict[str, list[float]] = {}


def _in_rank(args: argparse.Namespace) -> int:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import scaleout
    from scaleout.errors import UserError
    from scaleout.parallel import ddp_comm_hook

    batches = [int(b) for b in str(args.batch).split(",") if b.strip()]
    if not batches or min(batches) < 1 or args.layers < 1 or args.repeats < 1:
        raise UserError(f"--batch={args.batch!r} --layers={args.layers} --repeats={args.repeats}: expected positive integers")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world = scaleout.init()
    if world.world_size < 2:
        raise UserError("scaleout bench overlap needs >= 2 ranks (e.g. --nnodes 2 --nproc-per-node 2 --netns)")
    say = (lambda *a: print(*a, flush=True)) if world.is_main else (lambda *a: None)
    torch.manual_seed(0)
    base = bert_like(args.layers)
    n_params = sum(q.numel() for q in base.parameters())
    mb = args.bucket_mb
    first = args.first_bucket_mb or None
    models: dict[str, Any] = {"compute only": copy.deepcopy(base)}
    models["no overlap"] = scaleout.DataParallel(copy.deepcopy(base), world, "flat", mb, overlap=False, first_bucket_mb=first)
    models["overlap flat"] = scaleout.DataParallel(copy.deepcopy(base), world, "flat", mb, first_bucket_mb=first)
    models["overlap hier"] = scaleout.DataParallel(copy.deepcopy(base), world, "hierarchical", mb, first_bucket_mb=first,
                                                   timeline=args.timeline)
    models["torch DDP"] = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=mb)
    hooked = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=mb)
    hooked.register_comm_hook(None, ddp_comm_hook("hierarchical", world))
    models["DDP + hier hook"] = hooked
    if args.comm_nice:
        world.prioritize_communication(args.comm_nice)
    say(f"overlap bench: {world.world_size} ranks = {world.num_nodes} nodes x {world.local_size}, {args.layers} BERT-base "
        f"layers ({n_params / 1e6:.1f}M params, {n_params * 4 / 2**20:.0f} MiB fp32), seq {args.seq}, batch/rank {batches}, "
        f"bucket {mb:g} MiB, first {first or mb:g} MiB ({len(models['overlap flat'].buckets)} buckets), median of {args.repeats}")
    rows: list[dict[str, Any]] = []
    for batch in batches:
        g = torch.Generator().manual_seed(world.rank)
        x = torch.randn(batch, args.seq, 768, generator=g)
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        exposed_wait: dict[str, list[float]] = {"no overlap": [], "overlap flat": [], "overlap hier": []}
        comm: dict[str, list[float]] = {"flat": [], "hierarchical": []}
        for rep in range(args.warmup + args.repeats):
            for v in VARIANTS:  # interleaved: noise hits every variant alike
                m = models[v]
                m.zero_grad(set_to_none=False)
                world.barrier()
                t = time.perf_counter()
                m(x).float().pow(2).mean().backward()
                dt = _reduce_max(world, [time.perf_counter() - t])[0]
                if rep >= args.warmup:
                    times[v].append(dt)
                    if v in exposed_wait:
                        exposed_wait[v].append(m.last_stats["exposed_s"])
            if rep >= args.warmup:
                comm["flat"].append(_comm_only(world, models["overlap flat"]))
                comm["hierarchical"].append(_comm_only(world, models["overlap hier"]))
            say(f"  batch {batch}: step {rep + 1}/{args.warmup + args.repeats}" + (" (warmup)" if rep < args.warmup else "")
                + "  " + "  ".join(f"{v} {times[v][-1] * 1e3:.0f} ms" for v in VARIANTS if times[v] and rep >= args.warmup))
        med = {v: statistics.median(ts) for v, ts in times.items()}
        comm_med = {a: statistics.median(ts) for a, ts in comm.items()}
        for v in VARIANTS:
            alg = "hierarchical" if "hier" in v else ("flat" if v != "compute only" else None)
            exposed = med[v] - med["compute only"] if alg else 0.0
            wait = statistics.median(exposed_wait[v]) if v in exposed_wait else None
            rows.append({
                "batch": batch, "variant": v, "algorithm": alg, "step_s": med[v], "steps": times[v], "min_step_s": min(times[v]),
                "speedup_min_vs_ddp": min(times[BASELINE]) / min(times[v]),
                "hidden_wait": (1 - wait / comm_med[alg]) if wait is not None and alg else None,
                "speedup_vs_ddp": med[BASELINE] / med[v],
                "comm_alone_s": comm_med.get(alg) if alg else None,
                "comm_cpu_s": statistics.median(_COMM_CPU[alg]) if alg and _COMM_CPU.get(alg) else None,
                "exposed_s": exposed if alg else None,
                "hidden": (1 - exposed / comm_med[alg]) if alg else None,
                "exposed_wait_s": wait,
            })
    if args.timeline:
        path = models["overlap hier"].write_timeline()
        say(f"wrote timeline {path}")
    n_buckets = len(models["overlap flat"].buckets)
    if world.is_main:
        _report(args, rows, world, n_params, n_buckets)
    world.barrier()
    # DDP reducers and our hooks hold the process group: drop them before destroying it
    models.clear()
    del hooked
    world.close()
    return 0


def _report(args: argparse.Namespace, rows: list[dict[str, Any]], world: Any, n_params: int, n_buckets: int) -> None:
    from scaleout.bench.common import format_table, write_json

    def ms(v: float | None) -> Any:
        return v * 1e3 if v is not None else "-"

    def pct(v: float | None) -> str:
        return f"{v * 100:.0f} %" if v is not None else "-"

    table = [[r["batch"], r["variant"], r["step_s"] * 1e3, r["speedup_vs_ddp"], r["min_step_s"] * 1e3, r["speedup_min_vs_ddp"],
              ms(r["comm_alone_s"]), ms(r["exposed_s"]), pct(r["hidden"]), ms(r["exposed_wait_s"]), pct(r["hidden_wait"])]
             for r in rows]
    print(format_table(["batch/rank", "variant", "step ms (median)", "speedup vs DDP", "step ms (min)", "speedup (min)",
                        "comm alone ms", "exposed ms", "hidden", "wait after bwd ms", "hidden (wait)"], table))
    print("exposed = step - compute-only step; hidden = 1 - exposed / comm alone; hidden (wait) = 1 - wait after "
          "backward / comm alone (DataParallel's own measure, excludes CPU contention with compute)")
    cores = os.cpu_count() or 1
    for alg in ("flat", "hierarchical"):
        cpu = next((r["comm_cpu_s"] for r in rows if r["algorithm"] == alg and r.get("comm_cpu_s") is not None), None)
        comm = next((r["comm_alone_s"] for r in rows if r["algorithm"] == alg), None)
        if cpu is not None and comm:
            floor = cpu * world.world_size / cores  # all emulated nodes share this machine's cores
            print(f"{alg}: the communication alone used {cpu * 1e3:.0f} ms of CPU per rank ({world.world_size} ranks on "
                  f"{cores} cores: >= {floor * 1e3:.0f} ms of step time when backward keeps every core busy, i.e. at most "
                  f"{max(0.0, 1 - floor / comm) * 100:.0f} % of its {comm * 1e3:.0f} ms can be hidden on this machine)")
    path = write_json(args.out or None, {
        "bench": NAME, "rows": rows, "params": n_params, "buckets": n_buckets, "bucket_mb": args.bucket_mb,
        "layers": args.layers, "seq": args.seq,
        "world": {"world_size": world.world_size, "nnodes": world.num_nodes, "nproc_per_node": world.local_size},
        "link_rate_bps": os.environ.get("SCALEOUT_LINK_RATE_BPS"), "command": " ".join(sys.argv),
    })
    if path:
        print(f"wrote {path}")
    if args.png:
        _plot(rows, args.png)


def _plot(rows: list[dict[str, Any]], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    batches = list(dict.fromkeys(r["batch"] for r in rows))
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4), squeeze=False)
    for ax, b in zip(axes[0], batches, strict=True):
        rs = [r for r in rows if r["batch"] == b]
        ax.barh([r["variant"] for r in rs], [r["step_s"] * 1e3 for r in rs], color="tab:blue")
        ax.invert_yaxis()
        ax.set_xlabel("step time (ms, slowest rank, median)")
        ax.set_title(f"batch {b}/rank")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
