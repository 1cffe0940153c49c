"""World under the local launcher for real (gloo processes): identity, topology and group
membership.

Membership is observed, not assumed: each rank all-reduces a one-hot vector of its rank inside a
group, so the result is exactly the set of ranks that group contains.
"""

from __future__ import annotations

import pytest
import torch
from distutil import run_dist

from scaleout.env import WorldSpec
from scaleout.errors import TopologyError
from scaleout.world import World


def _members(world, group) -> list[int]:
    import torch.distributed as dist

    v = torch.zeros(world.world_size)
    v[world.rank] = 1.0
    dist.all_reduce(v, group=group)
    return [int(i) for i in torch.nonzero(v).flatten()]


def _observe(world, extra_grids):
    out = {
        "id": (
            world.rank,
            world.local_rank,
            world.node_rank,
            world.num_nodes,
            world.local_size,
            world.world_size,
        ),
        "launcher": world.launcher,
        "device": str(world.device),
        "backend": world.backend,
        "intra": _members(world, world.intra),
        "inter": _members(world, world.inter),
    }
    intra_again = world.intra
    out["cached"] = intra_again is world.intra
    t = world.torus()
    out["torus"] = (t.x, t.y, _members(world, t.row), _members(world, t.col))
    for x, y in extra_grids:
        g = world.torus(x, y)
        out[f"torus{x}x{y}"] = (_members(world, g.row), _members(world, g.col))
    try:
        world.torus(world.world_size + 1, 1)
        out["bad_grid"] = None
    except TopologyError as exc:
        out["bad_grid"] = str(exc)
    return out


@pytest.mark.multi_process
@pytest.mark.parametrize(
    ("nnodes", "nproc", "grids"), [(2, 2, [(4, 1), (1, 4)]), (3, 2, [(3, 2)]), (2, 4, [(2, 4)])]
)
def test_groups_membership(nnodes: int, nproc: int, grids) -> None:
    res = run_dist(_observe, nnodes, nproc, args=(grids,), timeout=180)
    p = nnodes * nproc
    for rank, r in enumerate(res):
        node, local = divmod(rank, nproc)
        assert r["id"] == (rank, local, node, nnodes, nproc, p)
        assert r["launcher"] == "local" and r["device"] == "cpu" and r["backend"] == "gloo"
        assert r["intra"] == [node * nproc + i for i in range(nproc)]
        assert r["inter"] == [n * nproc + local for n in range(nnodes)]
        assert r["cached"]
        x, y, row, col = r["torus"]
        assert (x, y) == (nproc, nnodes)  # default X = ranks per node
        assert row == r["intra"] and col == r["inter"]
        for gx, gy in grids:
            grow, gcol = r[f"torus{gx}x{gy}"]
            assert grow == list(range((rank // gx) * gx, (rank // gx + 1) * gx))
            assert gcol == list(range(rank % gx, p, gx))
        assert "does not match the world size" in r["bad_grid"]


def _fake_world(node_of: tuple[int, ...]) -> World:
    spec = WorldSpec(
        0, 0, 0, len(set(node_of)), node_of.count(0), len(node_of), "127.0.0.1", 1, "test"
    )
    return World(spec, torch.device("cpu"), "gloo", node_of)


@pytest.mark.multi_process
@pytest.mark.parametrize("family", ["intra", "inter", "torus"])
def test_unequal_ranks_per_node_rejected(family: str) -> None:
    """No process group is needed: the check runs before any group is created (Slurm '2(x2),1')."""
    world = _fake_world((0, 0, 1, 1, 2))
    with pytest.raises(
        TopologyError, match=r"same number of ranks on every node, got ranks per node \[2, 2, 1\]"
    ):
        world.torus() if family == "torus" else getattr(world, family)


@pytest.mark.multi_process
def test_torus_shape_resolution() -> None:
    w = _fake_world((0, 0, 0, 0, 1, 1, 1, 1))
    assert w.torus_shape() == (4, 2)
    assert w.torus_shape(2, None) == (2, 4)
    assert w.torus_shape(None, 8) == (1, 8)
    for x, y in [(3, None), (3, 3), (None, 3), (0, 8)]:
        with pytest.raises(TopologyError, match="world size 8"):
            w.torus_shape(x, y)


def _cyclic_torus(world) -> dict:
    from scaleout.comm import all_reduce

    t = world.torus()
    x = torch.arange(1000, dtype=torch.float64) * (world.rank + 1)
    flat = all_reduce(x.clone(), world, "flat")
    torus = all_reduce(x.clone(), world, "torus2d")
    return {
        "nodes": world.ranks_per_node,
        "row": _members(world, t.row),
        "col": _members(world, t.col),
        "row_ranks": list(t.row_ranks),
        "equal": bool(torch.equal(flat, torus)),
    }


@pytest.mark.multi_process
def test_torus_rows_follow_the_nodes_under_cyclic_placement() -> None:
    """srun --distribution=cyclic / mpirun --map-by node: node 0 holds ranks 0 and 2. The default
    torus rows (x = ranks per node) must be the nodes, not the rank blocks [0, 1], [2, 3] (which
    would put every row across the network and every column inside a node)."""
    res = run_dist(_cyclic_torus, nnodes=2, nproc_per_node=2, placement="cyclic", timeout=180)
    for rank, r in enumerate(res):
        assert r["nodes"] == [[0, 2], [1, 3]]
        node = [n for n in r["nodes"] if rank in n][0]
        assert r["row"] == node and r["row_ranks"] == node
        assert r["col"] == sorted(
            n[node.index(rank)] for n in r["nodes"]
        )  # same position on every node
        assert r[
            "equal"
        ]  # torus2d on the node-shaped grid = flat, bit for bit (integer-valued data)


@pytest.mark.full_system
def test_launch_master_port_sets_the_rendezvous_port() -> None:
    """launch.master_port (like launch.master_addr) wins over the launcher's port: the TCP store
    listens there."""
    import os
    import subprocess
    import sys

    from scaleout.env import free_port

    port = free_port()
    code = (
        "import scaleout; from scaleout.config import load_config; "
        "w = scaleout.init(load_config(None, ['launch.env=single', "
        f"'launch.master_port={port}'])); "
        "print(w.master_port); w.close()"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith(("SCALEOUT_", "MASTER_"))},
    )
    assert r.returncode == 0 and r.stdout.strip() == str(port), r.stdout + r.stderr
