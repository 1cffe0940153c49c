"""Print this rank's World (and the launcher variables it came from) as one JSON line, then check
that all-reduces on the world and node groups give the expected sums. Used by the Slurm/MPI
tests."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import scaleout


def main() -> int:
    world = scaleout.init(timeout_s=120)
    x = torch.tensor([float(world.rank + 1)])
    dist.all_reduce(x)
    ok = x.item() == world.world_size * (world.world_size + 1) / 2
    if world.uniform:
        y = torch.tensor([1.0])
        dist.all_reduce(y, group=world.intra)
        ok = ok and y.item() == world.local_size
    report = {
        "rank": world.rank,
        "local_rank": world.local_rank,
        "node_rank": world.node_rank,
        "num_nodes": world.num_nodes,
        "local_size": world.local_size,
        "world_size": world.world_size,
        "launcher": world.launcher,
        "master_addr": world.master_addr,
        "master_port": world.master_port,
        "ranks_per_node": world.ranks_per_node,
        "allreduce_ok": ok,
        "slurmd_nodename": os.environ.get("SLURMD_NODENAME"),
    }
    if (
        world.launcher == "mpi"
    ):  # the node split mpi4py sees (one host = one node), whatever the World says
        from scaleout.env.mpi import _mpi_topology

        report["mpi4py_topology"] = list(_mpi_topology())
    print("WORLD " + json.dumps(report), flush=True)
    world.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
