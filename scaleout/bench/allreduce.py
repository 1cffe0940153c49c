"""scaleout bench allreduce: every registered all-reduce algorithm, side by side, over message
sizes.

Runs inside the ranks (under any launcher), or one-shot: ``--nnodes/--nproc-per-node [--netns]``
starts the ranks itself via ``scaleout launch`` and tears the emulated cluster down afterwards.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import scaleout
from scaleout.argtypes import fmt_bytes, parse_csv, parse_size, parse_sizes
from scaleout.bench._harness import (
    add_one_shot_arguments,
    add_standard_arguments,
    check_counts,
    emit,
    in_ranks,
    interleave,
    reduce_max,
    say0,
)
from scaleout.bench._nccl_style import count_wrong, fill, format_block, size_range

if TYPE_CHECKING:
    from scaleout.world import World

NAME = "allreduce"
HELP = "every registered all-reduce algorithm over message sizes: time, algbw, busbw, link floor"
DESCRIPTION = """\
Times every all-reduce algorithm on every message size (median of --repeats runs, each the slowest
rank's time, algorithms interleaved so noise hits them alike) and reports algbw = bytes / time and
busbw = algbw * 2(p-1)/p (nccl-tests). On more than one node it also measures the link: a ring shift
of the same bytes between nodes gives the per-direction link rate, and the floor is the bytes that
must cross a node's link, 2(k-1)/k * n, at that rate. It also times group creation (intra + inter +
torus groups) against a plain init_process_group. Rank 0 prints a Markdown table, writes JSON
(--out) and a PNG of busbw vs size (--png, needs matplotlib).

examples:
  scaleout launch --nnodes 2 --nproc-per-node 2 --netns --rate 1gbit -- scaleout bench allreduce
  --sizes 64MiB
  scaleout bench allreduce --nnodes 2 --nproc-per-node 2 --netns --sizes 64MiB      # one-shot, same
  thing
  scaleout bench allreduce --nnodes 4 --nproc-per-node 4 --sizes 4KiB --repeats 3   # group creation
  at 16 ranks
  srun -N 4 --ntasks-per-node 8 scaleout bench allreduce --sizes 4KiB..256MiB
  srun -N 4 --ntasks-per-node 8 scaleout bench allreduce -b 8 -e 128M -f 2 -n 20 -w 5 -d float   #
  nccl-tests flags

Besides the comparison table, every algorithm gets a block laid out as nccl-tests' all_reduce_perf
prints it (size, count, type, redop, root, time in us, algbw, busbw, #wrong from an in-place check
of a rank-dependent fill) and an '# Avg bus bandwidth' line, to compare with a cluster's nccl-tests
logs.
"""

DTYPES = {
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
}  # float/half: nccl-tests' -d names


SMOKE_ARGS = ["--nnodes", "1", "--nproc-per-node", "2", "--sizes", "4KiB", "-n", "1", "-w", "0"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sizes",
        default=None,
        help="message sizes: list and/or A..B ranges in x4 steps (default 4KiB..256MiB)",
    )
    # nccl-tests' flags (all_reduce_perf -b 8 -e 128M -f 2 -n 20 -w 5 -d float); K/M/G are powers of
    # 1024 there too
    p.add_argument(
        "-b",
        "--minbytes",
        default=None,
        help="nccl-tests: smallest size (with -e/-f instead of --sizes)",
    )
    p.add_argument("-e", "--maxbytes", default=None, help="nccl-tests: largest size (default: -b)")
    p.add_argument(
        "-f", "--stepfactor", type=int, default=None, help="nccl-tests: size multiplier (default 2)"
    )
    p.add_argument(
        "--algorithms",
        default=None,
        help="comma list (default: every registered algorithm; flat is always included)",
    )
    p.add_argument(
        "-d", "--dtype", default="fp32", choices=sorted(DTYPES), help="element type (default fp32)"
    )
    p.add_argument(
        "--chunk-bytes",
        default=None,
        help="comma list of pipeline chunk sizes: hierarchical/torus2d get one variant each",
    )
    p.add_argument(
        "--composition",
        default=None,
        help="comma list of gloo phase compositions (sharded, leader): one variant each",
    )
    p.add_argument(
        "--torus", default=None, metavar="XxY", help="torus2d grid (default x = ranks per node)"
    )
    # nccl-tests' -n / -w for the rounds
    p.add_argument(
        "-n",
        "--repeats",
        type=int,
        default=5,
        help="timed runs per size and algorithm; the median is reported (default 5)",
    )
    p.add_argument("-w", "--warmup", type=int, default=1, help="untimed runs first (default 1)")
    add_standard_arguments(p, NAME, png=True)
    add_one_shot_arguments(p)


def _sizes(args: argparse.Namespace) -> list[int]:
    """--sizes, or nccl-tests' -b/-e/-f (one or the other)."""
    from scaleout.errors import UserError

    if args.minbytes is None and args.maxbytes is None and args.stepfactor is None:
        return parse_sizes(args.sizes or "4KiB..256MiB")
    if args.sizes is not None:
        raise UserError("--sizes and -b/-e/-f both given: expected one way of choosing the sizes")
    lo = parse_size(args.minbytes or args.maxbytes, "-b" if args.minbytes else "-e")
    return size_range(
        lo, parse_size(args.maxbytes, "-e") if args.maxbytes else lo, args.stepfactor or 2
    )


def run(args: argparse.Namespace) -> int:
    return in_ranks(args, _in_rank)


def _variants(args: argparse.Namespace) -> list[tuple[str, str, dict[str, Any]]]:
    from scaleout.comm import ALGORITHMS, get_algorithm
    from scaleout.errors import UserError

    names = parse_csv(args.algorithms, "--algorithms") if args.algorithms else list(ALGORITHMS)
    names = ["flat"] + [n for n in names if n != "flat"]  # the baseline, always, first
    chunks = (
        parse_csv(args.chunk_bytes, "--chunk-bytes", lambda c: parse_size(c, "--chunk-bytes"))
        if args.chunk_bytes
        else [None]
    )
    grid: dict[str, Any] = {}
    if args.torus:
        m = re.fullmatch(r"(\d+)x(\d+)", args.torus)
        if not m:
            raise UserError(f"--torus={args.torus!r}: expected XxY, e.g. 2x4")
        grid = {"x": int(m.group(1)), "y": int(m.group(2))}
    out = []
    for name in names:
        fields = get_algorithm(name).Options.model_fields  # which of the flags apply to it
        comps = (
            parse_csv(args.composition, "--composition")
            if args.composition and "composition" in fields
            else [None]
        )
        for comp in comps:
            for c in chunks if "chunk_bytes" in fields else [None]:
                opts = {k: v for k, v in grid.items() if k in fields}
                tags = []
                if comp is not None:
                    opts["composition"] = comp
                    tags.append(comp)
                if c is not None:
                    opts["chunk_bytes"] = c
                    tags.append(f"chunk={fmt_bytes(c)}")
                out.append((name + (f"[{','.join(tags)}]" if tags else ""), name, opts))
    return out


def _timed_init() -> tuple[Any, dict[str, float]]:
    """init_process_group and group creation, each timed as the slowest rank after a barrier."""

    import torch.distributed as dist

    from scaleout.env import detect_environment

    reader = detect_environment(os.environ)
    spec = reader.read(os.environ)
    t = time.perf_counter()
    if spec.world_size > 1:
        addr, port = reader.rendezvous(spec)
        dist.init_process_group(
            "gloo" if not _cuda() else "nccl",
            init_method=f"tcp://{addr}:{port}",
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=timedelta(seconds=600),
        )
    init_s = time.perf_counter() - t
    world = scaleout.init()
    # init_process_group's time includes waiting for the last rank to start: the last one to arrive
    # (smallest time) shows the cost itself. Group creation starts from a barrier: the slowest rank
    # counts.
    world.barrier()
    t = time.perf_counter()
    dist.new_group(list(range(world.world_size)))  # a plain world-sized gloo mesh, for reference
    world_group_s = time.perf_counter() - t
    world.barrier()
    t = time.perf_counter()
    if world.uniform:
        _ = world.intra, world.inter, world.torus()
    groups_s = time.perf_counter() - t
    stats = reduce_max(world, [-init_s, world_group_s, groups_s])
    return world, {
        "init_process_group_s": -stats[0],
        "new_world_group_s": stats[1],
        "groups_s": stats[2],
    }


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _link_rate(world: World, nbytes: int, repeats: int) -> float | None:
    """Bytes/s one way over a node's link, measured with raw TCP (no gloo): local rank 0 of every
    node streams nbytes to the next node's leader while receiving as much from the previous one,
    so both directions of every link are busy, as in an all-reduce. Median of ``repeats``."""
    import torch.distributed as dist

    k = world.num_nodes
    if k < 2 or not world.uniform:
        return None
    leaders = [node[0] for node in world.ranks_per_node]
    server = _listen(world) if world.rank in leaders else None
    gathered: list[Any] = [None] * world.world_size
    dist.all_gather_object(gathered, server.getsockname() if server else None)
    shift = None
    if server is not None:
        i = leaders.index(world.rank)
        shift = _RingShift(server, gathered[leaders[(i + 1) % k]], nbytes)
    times = interleave(
        {"shift": shift.run if shift else (lambda: None)}, repeats, warmup=1, world=world
    )["shift"]
    if shift is not None:
        shift.close()
    return nbytes / statistics.median(t.wall for t in times)


def _listen(world: World) -> Any:
    """A listening TCP socket on the address peers reach this rank on."""

    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.connect(
        (world.master_addr or "127.0.0.1", 9)
    )  # the address peers reach us on (no packet sent)
    ip = probe.getsockname()[0]
    probe.close()
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind((ip, 0))
    server.listen(1)
    return server


class _RingShift:
    """One node leader's part of the ring shift: send nbytes to the next leader while receiving
    nbytes."""

    def __init__(self, server: Any, nxt: tuple[str, int], nbytes: int):
        self.server, self.nbytes = server, nbytes
        self.out = socket.create_connection(nxt)
        self.out.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.inc, _ = server.accept()
        self.payload, self.sink = memoryview(bytearray(nbytes)), memoryview(bytearray(1 << 20))

    def _receive(self) -> None:
        left = self.nbytes
        while left:
            left -= self.inc.recv_into(self.sink, min(left, len(self.sink)))

    def run(self) -> None:
        rx = threading.Thread(target=self._receive)
        rx.start()
        self.out.sendall(self.payload)
        rx.join()

    def close(self) -> None:
        for s in (self.out, self.inc, self.server):
            s.close()


def _in_rank(args: argparse.Namespace) -> int:
    import torch

    check_counts(args, repeats=1, warmup=0)
    sizes = _sizes(args)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world, group_cost = _timed_init()
    variants = _variants(args)
    say = say0(world)
    say(
        f"allreduce bench: {world.world_size} ranks = {world.num_nodes} nodes x "
        f"{world.local_size}, {args.dtype}, sizes "
        f"{', '.join(fmt_bytes(s) for s in sizes)}, {len(variants)} variants, median of "
        f"{args.repeats}; groups "
        f"{group_cost['groups_s'] * 1e3:.1f} ms vs init_process_group "
        f"{group_cost['init_process_group_s'] * 1e3:.1f} ms"
    )
    rate_env = os.environ.get("SCALEOUT_LINK_RATE_BPS")
    link_bps = _link_rate(world, 32 << 20, 3) if world.num_nodes > 1 else None
    if link_bps:
        say(
            f"measured link rate: {link_bps / 1e6:.1f} MB/s one way"
            + (f" (tc rate {int(rate_env) / 8e6:.1f} MB/s)" if rate_env else "")
        )
    rows = [row for nbytes in sizes for row in _size(args, world, variants, nbytes, link_bps)]
    _report(args, rows, group_cost, link_bps, world)
    world.close()
    return 0


def _size(
    args: argparse.Namespace,
    world: World,
    variants: list[tuple[str, str, dict[str, Any]]],
    nbytes: int,
    link_bps: float | None,
) -> list[dict[str, Any]]:
    """Every variant on one message size, interleaved; then each one's in-place result checked
    (#wrong)."""
    import torch

    from scaleout.comm import all_reduce

    dtype = getattr(torch, DTYPES[args.dtype])
    esize = torch.empty((), dtype=dtype).element_size()
    p, k = world.world_size, world.num_nodes
    n = max(1, nbytes // esize)
    base = fill(n, world.rank, dtype, world.device)

    def reduce(name: str, opts: dict[str, Any]) -> Callable[[], Any]:
        def run() -> Any:
            t = base.clone()
            all_reduce(t, world, name, **opts)
            if t.is_cuda:
                torch.cuda.synchronize()
            return t

        return run

    runs = {label: reduce(name, opts) for label, name, opts in variants}
    samples = interleave(
        {label: _discard(r) for label, r in runs.items()}, args.repeats, args.warmup, world=world
    )
    wrong = {label: int(reduce_max(world, [count_wrong(r(), p)])[0]) for label, r in runs.items()}
    floor = 2 * (k - 1) / k * n * esize / link_bps if link_bps else None
    rate_env = os.environ.get("SCALEOUT_LINK_RATE_BPS")
    rows = []
    for label, name, opts in variants:
        med = statistics.median(t.wall for t in samples[label])
        algbw = n * esize / med
        rows.append(
            {
                "algorithm": label,
                "base_algorithm": name,
                "options": opts,
                "nbytes": n * esize,
                "count": n,
                "dtype": args.dtype,
                "torch_dtype": DTYPES[args.dtype],
                "wrong": wrong[label],
                "nnodes": k,
                "nproc_per_node": world.local_size,
                "world_size": p,
                "time_s": med,
                "times": [t.wall for t in samples[label]],
                "algbw": algbw,
                "busbw": algbw * 2 * (p - 1) / p if p > 1 else 0.0,
                "link_rate_bps": link_bps * 8
                if link_bps
                else (int(rate_env) if rate_env else None),
                "link_floor_s": floor,
            }
        )
        say0(world)(
            f"  {fmt_bytes(nbytes):>7} {label:<28} {med * 1e6:12.1f} us  #wrong {wrong[label]}"
        )
    return rows


def _discard(fn: Callable[[], Any]) -> Callable[[], None]:
    """``fn`` without its result (the timed runs keep no message alive)."""
    return lambda: (fn(), None)[1]


def _report(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    group_cost: dict[str, float],
    link_bps: float | None,
    world: World,
) -> None:
    shape = (
        f"{world.world_size} ranks = {world.num_nodes} nodes x {world.local_size}, {world.backend}"
    )
    if world.rank == 0:
        for label in dict.fromkeys(r["algorithm"] for r in rows):
            print(
                format_block([r for r in rows if r["algorithm"] == label], label, shape) + "\n",
                flush=True,
            )
    flat = {r["nbytes"]: r["time_s"] for r in rows if r["algorithm"] == "flat"}
    table = [
        [
            fmt_bytes(r["nbytes"]),
            r["count"],
            r["algorithm"],
            r["time_s"] * 1e6,
            r["algbw"] / 1e9,
            r["busbw"] / 1e9,
            r["wrong"],
            flat[r["nbytes"]] / r["time_s"],
            r["link_floor_s"] * 1e6 if r["link_floor_s"] else "-",
            r["time_s"] / r["link_floor_s"] if r["link_floor_s"] else "-",
        ]
        for r in rows
    ]
    ratio = (
        group_cost["groups_s"] / group_cost["init_process_group_s"]
        if world.world_size > 1
        else None
    )
    notes = [
        f"\ngroup creation at {world.world_size} ranks: intra+inter+torus "
        f"{group_cost['groups_s'] * 1e3:.1f} ms, "
        f"init_process_group {group_cost['init_process_group_s'] * 1e3:.1f} ms (ratio "
        f"{ratio:.2f}x), "
        f"a world-sized new_group {group_cost['new_world_group_s'] * 1e3:.1f} ms"
        if ratio is not None
        else ""
    ]
    if link_bps:
        notes.append(
            f"link: {link_bps / 1e6:.1f} MB/s one way measured with raw TCP between node leaders "
            "(both "
            "directions at once)"
        )
    emit(
        args,
        NAME,
        [
            "size",
            "count",
            "algorithm",
            "time us",
            "algbw GB/s",
            "busbw GB/s",
            "#wrong",
            "speedup vs flat",
            "link floor us",
            "time / floor",
        ],
        table,
        {
            "rows": rows,
            "group_creation": {**group_cost, "ratio_groups_to_init": ratio},
            "world": {
                "world_size": world.world_size,
                "nnodes": world.num_nodes,
                "nproc_per_node": world.local_size,
                "backend": world.backend,
            },
            "link_rate_bytes_per_s": link_bps,
            "netns": os.environ.get("SCALEOUT_NETNS"),
            "tc_rate_bps": os.environ.get("SCALEOUT_LINK_RATE_BPS"),
        },
        notes=notes,
        plot=lambda plt: _plot(plt, rows),
        world=world,
    )


def _plot(plt: Any, rows: list[dict[str, Any]]) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label in dict.fromkeys(r["algorithm"] for r in rows):
        pts = [(r["nbytes"], r["busbw"] / 1e9) for r in rows if r["algorithm"] == label]
        ax.plot(*zip(*pts, strict=True), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(
        f"all-reduce, {rows[0]['nnodes']} nodes x {rows[0]['nproc_per_node']} ranks, "
        f"{rows[0]['dtype']}"
    )
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig
