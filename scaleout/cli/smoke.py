"""scaleout smoke: build the World and its groups, check all-reduces, print a short report (rank
0)."""

from __future__ import annotations

import argparse
import time

import scaleout
from scaleout.env import detection_order

NAME = "smoke"
ORDER = 15
HELP = "distributed smoke check: World, groups, all-reduce correctness and a short report"
DESCRIPTION = """\
Run under any launcher (scaleout launch, srun, mpiexec, torchrun). Every rank builds the World,
creates the intra-node, inter-node and torus groups, checks an all-reduce on each against the
expected sum, and rank 0 prints the topology and timings. Exits non-zero on any mismatch.

example:
  scaleout launch --nnodes 2 --nproc-per-node 2 -- scaleout smoke
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--env",
        default=None,
        help=f"force a launcher environment ({', '.join(detection_order())}; default: detect)",
    )
    p.add_argument(
        "--numel", type=int, default=1 << 20, help="elements in the timed all-reduce (default 1 Mi)"
    )


def run(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from scaleout.log import print0

    t0 = time.perf_counter()
    world = scaleout.init(environment=args.env)
    t_init = time.perf_counter() - t0
    errors: list[str] = []

    def check(name: str, group, members: list[int]) -> None:
        x = torch.tensor([float(world.rank + 1)], device=world.device)
        dist.all_reduce(x, group=group)
        want = float(sum(r + 1 for r in members))
        if x.item() != want:
            errors.append(f"rank {world.rank}: {name} all-reduce gave {x.item()}, expected {want}")

    check("world", world.group, list(range(world.world_size)))
    groups = "world"
    if world.uniform:
        t1 = time.perf_counter()
        check("intra-node", world.intra, world.intra_ranks)
        check("inter-node", world.inter, world.inter_ranks)
        tg = world.torus()
        check("torus row", tg.row, list(tg.row_ranks))
        check("torus column", tg.col, list(tg.col_ranks))
        groups = (
            f"world, intra, inter, torus {tg.x}x{tg.y} (built in {time.perf_counter() - t1:.2f} s)"
        )
    big = torch.ones(args.numel, device=world.device)
    dist.all_reduce(big)
    t2 = time.perf_counter()
    dist.all_reduce(big)
    t_ar = time.perf_counter() - t2
    bad = torch.tensor([len(errors)], device=world.device)
    dist.all_reduce(bad)
    for e in errors:
        print(e, flush=True)
    print0(
        "scaleout smoke report\n"
        f"  launcher environment : {world.launcher}\n"
        f"  world                : {world.world_size} ranks on {world.num_nodes} nodes, ranks per "
        "node "
        f"{[len(r) for r in world.ranks_per_node]}\n"
        f"  device / backend     : {world.device} / {world.backend}\n"
        f"  rendezvous           : {world.master_addr}:{world.master_port} (init {t_init:.2f} s)\n"
        f"  groups               : {groups}\n"
        f"  all-reduce {args.numel * 4 / 2**20:.0f} MiB fp32: {t_ar * 1e3:.1f} ms\n"
        "  result               : "
        f"{'OK' if bad.item() == 0 else f'FAILED on {int(bad.item())} checks'}",
        rank=world.rank,
    )
    world.close()
    return 0 if bad.item() == 0 else 1
