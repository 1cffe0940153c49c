"""The cost model's (scaleout.sim) efficiency for the points a sweep measured, for a side-by-side
column.

The simulator is given what the sweep knows: the model's gradient size (parameters from the family's
formula, scaleout/families/<arch>/flops.py), the per-rank batch of each point, the all-reduce
algorithm and bucket size of the config, and the per-rank compute speed measured at the base point
(step time minus its exposed communication). It then predicts each point's step time on a preset
cluster (``--simulate netns-1g`` for the emulated cluster, ``dgx-a100`` for "what would this do
there") with that point's node shape, and the same efficiency formula as the measurement is applied
to the predicted times.

What the model leaves out is exactly what the comparison shows: on one machine, compute slows down
as ranks share cores (the simulator assumes every rank computes at the base point's speed).
"""

from __future__ import annotations

from dataclasses import replace

from scaleout.config.schema import Config
from scaleout.sim import ModelSpec, TrainSpec, get_cluster, step_time
from scaleout.sim.cluster import custom_cluster
from scaleout.sim.fromconfig import optimizer_of, wire_bytes
from scaleout.sweep.results import PointResult


class Simulator:
    def __init__(self, preset: str, cfg: Config):
        self.cluster = get_cluster(preset)  # ConfigError names the preset before anything runs
        self.preset = preset
        self.cfg = cfg
        self.params = cfg.model.family.params(cfg)

        # Bytes per element on the wire: comm.compression for the all-reduce; ShardedLAMB sends
        # fp32.
        self.grad_bytes, self.param_bytes = wire_bytes(cfg)

    def _step(self, r: PointResult, per_rank_speed: float) -> float:
        p = r.point
        model = ModelSpec(
            self.cfg.model.arch,
            params=float(self.params),
            flops_per_sample=1.0,
            grad_bytes=self.grad_bytes,
            param_bytes=self.param_bytes,
            opt_bytes_per_param=0.0,
        )
        sharded = self.cfg.optim.sharded
        train = TrainSpec(
            local_batch=float(p.per_rank_batch),
            algorithm=self.cfg.comm.algorithm,  # auto: the fastest named one (sim.step)
            bucket_mb=self.cfg.comm.bucket_mb,
            samples_per_s=per_rank_speed,
            overlap=self.cfg.optim.overlap_comm if sharded else self.cfg.comm.overlap,
            optimizer=optimizer_of(self.cfg),
        )
        cluster = custom_cluster(self.cluster, gpus_per_node=p.ranks_per_node)
        # optimizer time is inside the measured per-rank speed
        cluster = replace(cluster, device=None)
        return step_time(model, train, cluster, p.nodes).step

    def fill(self, results: list[PointResult], base: PointResult, mode: str) -> None:
        """Set ``simulated_efficiency`` on every ok point (same formula as the measured
        efficiency)."""
        busy = base.step_s - base.breakdown_s.get("exposed_comm", 0.0)
        if busy <= 0:
            return
        # samples/s of one rank that does not wait on the network
        speed = base.point.per_rank_batch / busy
        b = base.point.world
        t_base = self._step(base, speed)
        for r in results:
            if not r.ok:
                continue
            n, t = r.point.world, self._step(r, speed)
            if mode == "weak":
                r.simulated_efficiency = (r.point.global_batch / t / n) / (
                    base.point.global_batch / t_base / b
                )
            else:
                r.simulated_efficiency = (t_base * b) / (n * t)
