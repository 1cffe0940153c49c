"""Adding an all-reduce algorithm takes one file (docs/extending.md): this one registers a toy
``naive`` all-reduce (all-gather every rank's buffer, add them up) and runs it through the real
paths: a config naming it validates, ``scaleout simulate`` lists and prices it (all-reduce, training
step, sharded optimizer), and ``scaleout.comm.all_reduce`` / ``reduce_scatter`` / ``all_gather`` run
it on two gloo processes. No other file names it; it is unregistered at the end.
"""

from __future__ import annotations

from typing import Any

import pytest
from distutil import run_dist

from scaleout.comm import ALGORITHMS, Algorithm, Options

NAME = "naive"


class NaiveOptions(Options):
    """Its config section: none of the ``comm.*`` keys; one option for ``all_reduce(...,
    **options)``."""

    accumulate_fp64: bool = False


class Naive(Algorithm):
    name = NAME
    help = "all-gather every rank's buffer, then add the copies up (a toy: p x the bytes of a ring)"
    Options = NaiveOptions

    def check(self, opts: Any, world_size: int, ranks_per_node: int | None) -> None:
        pass  # any world size

    def all_reduce(self, buf, world, opts, prepared) -> None:  # noqa: ANN001
        import torch  # deferred: torch runtime
        import torch.distributed as dist  # deferred: torch runtime

        if world.world_size == 1:
            return
        copies = torch.empty(world.world_size * buf.numel(), dtype=buf.dtype)
        dist.all_gather_into_tensor(copies, buf, group=world.group)
        acc = torch.float64 if opts.accumulate_fp64 else buf.dtype
        buf.copy_(copies.view(world.world_size, -1).to(acc).sum(0))

    def cost(self, opts, cluster, nodes, nbytes, chunks=None):  # noqa: ANN001, ANN201
        from scaleout.sim.collectives import Plan, ring_phase, vec  # deferred: numpy cost model

        g = cluster.gpus_per_node
        p = g * nodes
        plan = Plan().add(1, vec(base=1))  # a ring all-gather of p buffers, then p - 1 additions
        ring_phase(plan, cluster, p, p * nbytes, "ag", nodes > 1, intra_hop=g > 1)
        return plan.add(1, vec(gamma=(p - 1) * nbytes))


def register() -> None:
    if NAME not in ALGORITHMS:  # the spawned ranks import this module once per process
        ALGORITHMS.register(NAME, Naive())


@pytest.fixture(autouse=True, scope="module")
def _registered():
    register()
    yield
    ALGORITHMS.unregister(NAME)


@pytest.mark.unit
def test_config_names_it() -> None:
    from scaleout.config import load_config
    from scaleout.errors import ConfigError

    cfg = load_config(overrides=[f"comm.algorithm={NAME}"])
    cfg.check_world(4, 2)
    assert cfg.comm.options() == NaiveOptions()
    with pytest.raises(ConfigError, match=f"comm.torus_x=2 is an option of torus2d.*={NAME}"):
        load_config(overrides=[f"comm.algorithm={NAME}", "comm.torus_x=2"])


@pytest.mark.unit
def test_simulator_lists_and_prices_it(capsys) -> None:
    from scaleout.cli import main
    from scaleout.sim.cluster import get_cluster
    from scaleout.sim.collectives import algorithm_names, allreduce_cost
    from scaleout.sim.sharded import reduce_time
    from scaleout.sim.step import TrainSpec, get_model, step_time

    assert NAME in algorithm_names()
    c = get_cluster("dgx-a100")
    naive, flat = (allreduce_cost(a, c, 4, 64e6).time for a in (NAME, "flat"))
    assert naive > 4 * flat  # p x the bytes of a ring
    step = step_time(get_model("bert-large"), TrainSpec(local_batch=4, algorithm=NAME), c, 2)
    assert step.step > 0
    assert reduce_time("sharded", NAME, c, 2, 1e6) > 0  # the default reduce-scatter: a world ring
    assert main(["simulate", "allreduce", "--nnodes", "2", "--sizes-mb", "1"]) == 0
    assert f"| {NAME}" in capsys.readouterr().out


def _run(world) -> dict:
    import torch

    from scaleout.comm import all_gather, all_reduce, reduce_scatter, shard_index

    register()
    p, r = world.world_size, world.rank
    t = torch.arange(10, dtype=torch.float32) + r
    want = torch.arange(10, dtype=torch.float32) * p + p * (p - 1) / 2
    out = {"sync": bool(torch.equal(all_reduce(t.clone(), world, NAME), want))}
    h = all_reduce(t.clone(), world, NAME, op="avg", async_op=True, accumulate_fp64=True)
    out["async_avg"] = bool(torch.allclose(h.wait(), want / p))
    big = torch.arange(4 * p, dtype=torch.float32) + r
    part = reduce_scatter(torch.empty(4), big, world, NAME)
    i = shard_index(world, NAME)
    out["reduce_scatter"] = bool(
        torch.equal(part, (torch.arange(4 * p) * p)[4 * i : 4 * i + 4] + p * (p - 1) / 2)
    )
    back = all_gather(torch.empty(4 * p), part, world, NAME)
    out["all_gather"] = bool(torch.equal(back, torch.arange(4 * p) * p + p * (p - 1) / 2))
    return out


@pytest.mark.multi_process
def test_runs_on_two_gloo_ranks() -> None:
    for r in run_dist(_run, nnodes=2, nproc_per_node=1, timeout=120):
        assert all(r.values()), r
