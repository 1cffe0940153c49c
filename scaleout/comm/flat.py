"""``flat``: torch.distributed's own all_reduce on the world group -- the baseline.

gloo runs a ring (or halving-doubling) over all p ranks, so every node boundary carries 2(p-1)/p * n
bytes each way; NCCL picks ring/tree itself. The cost model is one ring over the p ranks (Patarasuk
& Yuan 2009): 2(p-1) lock-step steps of n/p bytes, each paced by its slowest hop (a node-crossing
hop when k > 1), the bytes crossing each node boundary spread over the NICs a ring can drive (NCCL
channels; gloo: one socket).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scaleout.comm.algorithm import Algorithm, Options, register

if TYPE_CHECKING:
    import torch

    from scaleout.sim.cluster import Cluster
    from scaleout.sim.cost import Plan
    from scaleout.world import World


class Flat(Algorithm):
    name = "flat"
    help = "torch.distributed all_reduce on the world group (baseline)"
    single_collective = True

    def start(self, buf: torch.Tensor, world: World, opts: Options) -> Any:
        import torch.distributed as dist  # deferred: torch runtime

        if world.world_size > 1 and buf.numel():
            return dist.all_reduce(buf, group=world.group, async_op=True)
        return None

    def all_reduce(self, buf: torch.Tensor, world: World, opts: Options, prepared: Any) -> None:
        work = self.start(buf, world, opts)
        if work is not None:
            work.wait()

    def cost(
        self,
        opts: Options,
        cluster: Cluster,
        nodes: int,
        nbytes: float,
        chunks: int | None = None,
    ) -> Plan:
        from scaleout.sim.cost import Plan, ring_phase, vec  # deferred: numpy cost model

        g = cluster.gpus_per_node
        plan = Plan().add(1, vec(base=1))
        return ring_phase(plan, cluster, g * nodes, nbytes, "ar", nodes > 1, intra_hop=g > 1)


register(Flat())
