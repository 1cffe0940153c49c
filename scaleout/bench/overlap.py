"""scaleout bench overlap: step time of gradient communication with and without overlap, per
algorithm, against torch DDP with the same bucket size, and how much communication backward hides.

Runs inside the ranks (under any launcher), or one-shot: ``--nnodes/--nproc-per-node [--netns]``
starts the ranks itself via ``scaleout launch`` (emulated cluster: launchers/netns.py).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import scaleout
from scaleout.bench._harness import (
    BERT_LAYER_SMOKE_ARGS,
    add_bert_layer_arguments,
    add_rank_arguments,
    check_counts,
    compare,
    emit,
    in_ranks,
    init_ranks,
    interleave,
    reduce_max,
    say0,
)
from scaleout.units import DEFAULT_BUCKET_MB

if TYPE_CHECKING:
    from scaleout.world import World

NAME = "overlap"
HELP = (
    "overlapped bucketed all-reduce vs no overlap vs torch DDP on BERT-like layers: step time, "
    "hidden comm"
)
DESCRIPTION = """\
A model of BERT-base-shaped encoder layers (hidden 768, 12 heads, FFN 3072; --layers of them) trains
on random data; in one run, interleaved step by step so noise hits all alike, it times a full step
(forward + backward + gradient averaging, the slowest rank) of:

  compute only       no communication at all (the floor)
  no overlap         DataParallel(overlap=False): every bucket all-reduced after backward (flat)
  overlap flat       DataParallel(algorithm='flat')
  overlap hier       DataParallel(algorithm='hierarchical')
  torch DDP          DistributedDataParallel(bucket_cap_mb=same)     <- the baseline of the ratios
  DDP + hier hook    DDP with scaleout.parallel.ddp_comm_hook('hierarchical')

and, with the same buckets and no compute, the communication alone. Exposed communication = step -
compute-only step; hidden = 1 - exposed / communication alone (so CPU contention between backward
and communication counts as exposed). DataParallel's own measure (wait after backward) is shown too.
Each --batch value is one regime: small batches are communication-bound (step ~ communication, where
the algorithm matters), large batches compute-bound (where overlap can hide communication).

examples:
  scaleout bench overlap --nnodes 2 --nproc-per-node 2 --netns --rate 1gbit          # one-shot
  scaleout launch --nnodes 2 --nproc-per-node 2 --netns -- scaleout bench overlap --batch 1,8
"""

VARIANTS = (
    "compute only",
    "no overlap",
    "overlap flat",
    "overlap hier",
    "torch DDP",
    "DDP + hier hook",
)
BASELINE = "torch DDP"


SMOKE_ARGS = BERT_LAYER_SMOKE_ARGS


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_bert_layer_arguments(p)
    p.add_argument(
        "--batch",
        default="1,6",
        help="comma list of per-rank batch sizes, one regime each (default 1,6)",
    )
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=DEFAULT_BUCKET_MB,
        help=f"bucket size in MiB for all variants (default {DEFAULT_BUCKET_MB:g})",
    )
    p.add_argument(
        "--first-bucket-mb",
        type=float,
        default=1.0,
        help="first bucket cap for DataParallel, as torch DDP's 1 MiB default (0 = same as "
        "--bucket-mb)",
    )
    p.add_argument(
        "--comm-nice",
        type=int,
        default=0,
        help="lower the compute thread's priority by this nice value below the communication "
        "threads "
        "(comm.handles.prioritize_communication; applies to every variant alike, DDP included; "
        "default 0)",
    )
    p.add_argument(
        "--timeline", default=None, help="also write a Chrome trace of the overlap-hier steps here"
    )
    add_rank_arguments(p, NAME, repeats=5, warmup=1, png=True)


def run(args: argparse.Namespace) -> int:
    return in_ranks(args, _in_rank)


def bert_like(layers: int) -> Any:
    """BERT-base layer shapes (Devlin et al.: hidden 768, 12 heads, intermediate 3072) and a
    small head."""
    import torch

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(
                torch.nn.TransformerEncoderLayer(
                    768, 12, 3072, dropout=0.0, activation="gelu", batch_first=True
                )
                for _ in range(layers)
            )
            self.head = torch.nn.Linear(768, 768)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    return Encoder()


def _models(args: argparse.Namespace, world: World) -> dict[str, Any]:
    """Every variant's copy of the same model (DataParallel broadcasts rank 0's weights; DDP
    too)."""

    import torch
    from torch.nn.parallel import DistributedDataParallel

    from scaleout.parallel import ddp_comm_hook

    torch.manual_seed(0)
    base = bert_like(args.layers)
    mb, first = args.bucket_mb, args.first_bucket_mb or None

    def dp(algorithm: str, **kw: Any) -> Any:
        return scaleout.DataParallel(
            copy.deepcopy(base), world, algorithm, mb, first_bucket_mb=first, **kw
        )

    hooked = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=mb)
    hooked.register_comm_hook(None, ddp_comm_hook("hierarchical", world))
    return {
        "compute only": copy.deepcopy(base),
        "no overlap": dp("flat", overlap=False),
        "overlap flat": dp("flat"),
        "overlap hier": dp("hierarchical", timeline=args.timeline),
        "torch DDP": DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=mb),
        "DDP + hier hook": hooked,
    }


def _comm_only(world: World, dp: Any) -> tuple[float, float]:
    """All of ``dp``'s buckets, launched back to back in order, no compute: (wall, CPU seconds of
    the rank's every thread: gloo IO, comm thread, reductions), max over ranks. On a CPU-only box
    that CPU work competes with backward for the cores."""
    from scaleout.comm import all_reduce

    bufs = [b.buffer.clone() for b in dp.reducer.buckets]
    world.barrier()
    t, cpu = time.perf_counter(), time.process_time()
    handles = [all_reduce(b, world, dp.algorithm, op="sum", async_op=True) for b in bufs]
    for h in handles:
        h.wait()
    wall, cpu = reduce_max(world, [time.perf_counter() - t, time.process_time() - cpu])
    return wall, cpu


def _regime(
    args: argparse.Namespace, world: World, models: dict[str, Any], batch: int
) -> list[dict[str, Any]]:
    """Every variant's step at one per-rank batch, interleaved, with the communication alone per
    round."""
    import torch

    x = torch.randn(batch, args.seq, 768, generator=torch.Generator().manual_seed(world.rank))
    comm: dict[str, list[tuple[float, float]]] = {"flat": [], "hierarchical": []}

    def step(m: Any) -> Callable[[], float | None]:
        def run() -> float | None:
            m.zero_grad(set_to_none=False)
            m(x).float().pow(2).mean().backward()
            stats = getattr(m, "last_stats", None)  # DataParallel's own wait after backward
            return stats["exposed_s"] if stats is not None else None

        return run

    def comm_alone(_round: int) -> None:
        comm["flat"].append(_comm_only(world, models["overlap flat"]))
        comm["hierarchical"].append(_comm_only(world, models["overlap hier"]))

    samples = interleave(
        {v: step(m) for v, m in models.items()},
        args.repeats,
        args.warmup,
        world=world,
        alternate=False,
        after_round=comm_alone,
        say=lambda line: say0(world)(f"  batch {batch}:{line}"),
    )
    return _rows(batch, samples, comm)


def _rows(
    batch: int, samples: Any, comm: dict[str, list[tuple[float, float]]]
) -> list[dict[str, Any]]:
    by = {r.name: r for r in compare(samples, baseline=BASELINE)}
    comm_med = {a: statistics.median(w for w, _ in ts) for a, ts in comm.items()}
    rows = []
    for v in VARIANTS:
        r = by[v]
        alg = "hierarchical" if "hier" in v else ("flat" if v != "compute only" else None)
        exposed = r.median_s - by["compute only"].median_s if alg else None
        waits = [t.value for t in samples[v] if t.value is not None]
        wait = statistics.median(waits) if waits else None
        rows.append(
            {
                "batch": batch,
                "variant": v,
                "algorithm": alg,
                "step_s": r.median_s,
                "steps": r.times_s,
                "min_step_s": r.min_s,
                "speedup_min_vs_ddp": by[BASELINE].min_s / r.min_s,
                "speedup_vs_ddp": r.speedup,
                "hidden_wait": (1 - wait / comm_med[alg]) if wait is not None and alg else None,
                "comm_alone_s": comm_med.get(alg) if alg else None,
                "comm_cpu_s": statistics.median(c for _, c in comm[alg]) if alg else None,
                "exposed_s": exposed,
                "hidden": (1 - exposed / comm_med[alg]) if alg else None,
                "exposed_wait_s": wait,
            }
        )
    return rows


def _in_rank(args: argparse.Namespace) -> int:
    from scaleout.argtypes import parse_csv

    batches = parse_csv(args.batch, "--batch", int, at_least=1)
    check_counts(args, layers=1, repeats=1, warmup=0)
    world = init_ranks(2, NAME)
    models = _models(args, world)
    if args.comm_nice:
        from scaleout.comm.handles import prioritize_communication

        prioritize_communication(world, args.comm_nice)
    n_params = sum(q.numel() for q in models["compute only"].parameters())
    n_buckets = len(models["overlap flat"].buckets)
    say0(world)(
        f"overlap bench: {world.world_size} ranks = {world.num_nodes} nodes x {world.local_size}, "
        f"{args.layers} "
        f"BERT-base layers ({n_params / 1e6:.1f}M params, {n_params * 4 / 2**20:.0f} MiB fp32), "
        f"seq {args.seq}, "
        f"batch/rank {batches}, bucket {args.bucket_mb:g} MiB, first "
        f"{args.first_bucket_mb or args.bucket_mb:g} MiB "
        f"({n_buckets} buckets), median of {args.repeats}"
    )
    rows = [row for batch in batches for row in _regime(args, world, models, batch)]
    if args.timeline:
        say0(world)(f"wrote timeline {models['overlap hier'].write_timeline()}")
    _report(args, rows, world, n_params, n_buckets)
    world.barrier()
    # DDP reducers and our hooks hold the process group: drop them before destroying it
    models.clear()
    world.close()
    return 0


def _report(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    world: World,
    n_params: int,
    n_buckets: int,
) -> None:
    def ms(v: float | None) -> Any:
        return v * 1e3 if v is not None else "-"

    def pct(v: float | None) -> str:
        return f"{v * 100:.0f} %" if v is not None else "-"

    table = [
        [
            r["batch"],
            r["variant"],
            r["step_s"] * 1e3,
            r["speedup_vs_ddp"],
            r["min_step_s"] * 1e3,
            r["speedup_min_vs_ddp"],
            ms(r["comm_alone_s"]),
            ms(r["exposed_s"]),
            pct(r["hidden"]),
            ms(r["exposed_wait_s"]),
            pct(r["hidden_wait"]),
        ]
        for r in rows
    ]
    notes = [
        "exposed = step - compute-only step; hidden = 1 - exposed / comm alone; hidden (wait) = 1 "
        "- wait after "
        "backward / comm alone (DataParallel's own measure, excludes CPU contention with compute)"
    ]
    notes += _cpu_notes(rows, world)
    emit(
        args,
        NAME,
        [
            "batch/rank",
            "variant",
            "step ms (median)",
            "speedup vs DDP",
            "step ms (min)",
            "speedup (min)",
            "comm alone ms",
            "exposed ms",
            "hidden",
            "wait after bwd ms",
            "hidden (wait)",
        ],
        table,
        {
            "rows": rows,
            "params": n_params,
            "buckets": n_buckets,
            "bucket_mb": args.bucket_mb,
            "layers": args.layers,
            "seq": args.seq,
            "world": {
                "world_size": world.world_size,
                "nnodes": world.num_nodes,
                "nproc_per_node": world.local_size,
            },
            "link_rate_bps": os.environ.get("SCALEOUT_LINK_RATE_BPS"),
        },
        notes=notes,
        plot=lambda plt: _plot(plt, rows),
        world=world,
    )


def _cpu_notes(rows: list[dict[str, Any]], world: World) -> list[str]:
    """How much of the communication this machine's cores can hide at all (all emulated nodes
    share them)."""
    cores, notes = os.cpu_count() or 1, []
    for alg in ("flat", "hierarchical"):
        cpu = next(
            (
                r["comm_cpu_s"]
                for r in rows
                if r["algorithm"] == alg and r.get("comm_cpu_s") is not None
            ),
            None,
        )
        comm = next((r["comm_alone_s"] for r in rows if r["algorithm"] == alg), None)
        if cpu is not None and comm:
            floor = cpu * world.world_size / cores
            notes.append(
                f"{alg}: the communication alone used {cpu * 1e3:.0f} ms of CPU per rank "
                f"({world.world_size} "
                f"ranks on {cores} cores: >= {floor * 1e3:.0f} ms of step time when backward keeps "
                "every core "
                f"busy, i.e. at most {max(0.0, 1 - floor / comm) * 100:.0f} % of its "
                f"{comm * 1e3:.0f} ms can be "
                "hidden on this machine)"
            )
    return notes


def _plot(plt: Any, rows: list[dict[str, Any]]) -> Any:
    batches = list(dict.fromkeys(r["batch"] for r in rows))
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4), squeeze=False)
    for ax, b in zip(axes[0], batches, strict=True):
        rs = [r for r in rows if r["batch"] == b]
        ax.barh([r["variant"] for r in rs], [r["step_s"] * 1e3 for r in rs], color="tab:blue")
        ax.invert_yaxis()
        ax.set_xlabel("step time (ms, slowest rank, median)")
        ax.set_title(f"batch {b}/rank")
    fig.tight_layout()
    return fig
