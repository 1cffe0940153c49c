"""The framework costs nothing (issue 29 item 4): scaleout's trainer on the plain DDP loop's recipe
has that loop's first bucket, its optimizer kernel and, as an option, its data order.
``scaleout bench framework`` times the two (docs/ttt.md)."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, DistributedSampler

from scaleout.config.schema import CommConfig, OptimConfig
from scaleout.data.sampler import make_sampler
from scaleout.errors import ConfigError
from scaleout.optim import build_optimizer
from scaleout.parallel import DataParallel
from scaleout.world import init

LAYER_BYTES = (256 * 256 + 256) * 4  # one Linear(256, 256): weight and bias


def _chain() -> torch.nn.Sequential:
    return torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(8)))  # 2.0 MiB


@pytest.mark.unit
def test_first_bucket_is_ddps_1mib_and_holds_the_last_layers() -> None:
    """comm.first_bucket_mb (default 1 MiB, torch DDP's _DEFAULT_FIRST_BUCKET_BYTES) closes the
    first bucket after the last layers' gradients, the first ready in backward, so its all-reduce
    starts while backward goes on; the rest go in comm.bucket_mb buckets. A first cap not below
    bucket_mb, or null, leaves the layout as it was (one rank: no collectives)."""
    assert CommConfig().first_bucket_mb == 1.0
    world = init(environment="single")
    try:
        model = _chain()
        dp = DataParallel.from_config(model, world, CommConfig(bucket_mb=25.0))
        # 4 layers (1.004 MiB) close the first bucket; 3 would be 0.75 MiB
        assert [b.nbytes for b in dp.reducer.buckets][0] == 4 * LAYER_BYTES
        assert len(dp.buckets) == 2 and {n.split(".")[0] for n in dp.buckets[0]} == {
            "4",
            "5",
            "6",
            "7",
        }
        # after one backward the buckets follow the order gradients became ready (rank 0's):
        # the first bucket is still the last layers'
        dp(torch.randn(3, 256)).sum().backward()
        assert {n.split(".")[0] for n in dp.buckets[0]} == {"4", "5", "6", "7"}
        assert dp.last_stats["launch_order"] == [0, 1]
        for comm in (CommConfig(first_bucket_mb=None), CommConfig(bucket_mb=1.0)):
            same = DataParallel.from_config(_chain(), world, comm)
            want = 1 if comm.bucket_mb == 25.0 else 2
            assert len(same.buckets) == want and same.reducer._layout[3] is None, comm
    finally:
        world.close()


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.unit
def test_adamw_step_is_torchs_fused_kernel_on_cpu() -> None:
    """optim.name=adamw on CPU is torch's fused AdamW, as the plain torch loop's (one kernel per
    parameter group instead of a dozen foreach passes over every tensor: 2.5x faster here), so
    the ablation's framework step does not pay for a slower optimizer."""
    model = _chain()
    opt = build_optimizer(model, OptimConfig(name="adamw", lr=1e-3))
    assert opt.defaults.get("fused") is True
    model(torch.randn(2, 256)).sum().backward()
    opt.step()  # the first step creates the state
    with _Ops() as ops:
        opt.step()
    fused = [n for n in ops.names if "fused_adam" in n]
    # foreach: ~15 passes over every tensor per group; fused: the kernel and the step counters
    assert fused and len(ops.names) <= 3 * len(opt.param_groups), ops.names


def _torch_batches(n: int, world: int, rank: int, batch: int, seed: int, epochs: int) -> list:
    sampler = DistributedSampler(
        range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True
    )
    loader = DataLoader(range(n), batch_size=batch // world, sampler=sampler, drop_last=True)
    out = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out += [b.tolist() for b in loader]
    return out


@pytest.mark.unit
def test_torch_order_reads_the_distributed_samplers_batches() -> None:
    """data.order=torch: rank r's batch at every step is the one DistributedSampler(seed,
    drop_last=True) + set_epoch + DataLoader(drop_last=True) gives the plain loop, across epoch
    boundaries (53 rows, 2 ranks: 26 each, 6 batches of 4 per epoch, 2 rows never read)."""
    n, world, batch, seed = 53, 2, 8, 3
    for rank in range(world):
        want = _torch_batches(n, world, rank, batch, seed, epochs=3)
        s = make_sampler("torch", n, batch, rank, world, seed=seed)
        got = [s.local_indices(step * batch).tolist() for step in range(len(want))]
        assert len(want) == 18 and got == want, rank
    with pytest.raises(ConfigError, match="data.order=torch"):
        make_sampler("torch", 5, 8, 0, 2)
    with pytest.raises(ConfigError, match="data.order='x'"):
        make_sampler("x", 53, 8)


def _collectives_per_step(world, out: str) -> dict:
    """The trainer's steps on the replicated path, counting torch.distributed.all_reduce calls:
    the step's agreement rides in the last gradient bucket on an fp32 wire (no collective of its
    own), and goes out as one more all-reduce before the backward on a bf16 one (first, so it
    completes while backward computes)."""
    import torch.distributed as dist

    from scaleout.config import load_config
    from scaleout.train.agreement import agreement_size
    from scaleout.train.trainer import Trainer
    from tests.train.test_skew import RUN

    calls = []
    real = dist.all_reduce

    def counting(*a, **k):
        calls.append(a[0].numel())
        return real(*a, **k)

    res = {}
    for wire in ("none", "bf16"):
        cfg = load_config(
            None, [*RUN, f"train.output_dir={out}/{wire}", f"comm.compression={wire}"]
        )
        trainer = Trainer(cfg, world)
        trainer.preemption = type(
            "P", (), {"requested": False, "noticed": False, "terminating": False}
        )()
        trainer._start_clock()
        per_step, skews, first = [], [], []
        dist.all_reduce = counting
        try:
            for step in range(4):
                calls.clear()
                assert trainer.run_step(step) is None
                per_step.append(len(calls))
                first.append(calls[0] == agreement_size(world.world_size, True))
                skews.append(trainer.flags.skew is not None)
        finally:
            dist.all_reduce = real
        res[wire] = {
            "per_step": per_step,
            "buckets": len(trainer.model.reducer.buckets),
            "losses": [float(x) for x in trainer.losses],
            "skews": skews,
            "rode": trainer.sync.ride_result() is not None,
            "first": first,
        }
        trainer.mlperf_log.close()
    return res


@pytest.mark.multi_process
def test_the_step_agreement_rides_in_the_last_bucket(tmp_path) -> None:
    from tests.distutil import run_dist

    results = run_dist(_collectives_per_step, 1, 2, args=(str(tmp_path),), timeout=180)
    for res in results:
        fp32, bf16 = res["none"], res["bf16"]
        # step 0 also rebuilds the buckets (a broadcast, no all-reduce)
        assert fp32["rode"] and fp32["per_step"][1:] == [fp32["buckets"]] * 3, fp32
        assert not bf16["rode"] and bf16["per_step"][1:] == [bf16["buckets"] + 1] * 3, bf16
        assert bf16["first"][1:] == [True] * 3, bf16  # the agreement (not a bucket) went first
        # the skew of a step rides in the next step's agreement: none at the first step
        assert fp32["skews"] == [False, True, True, True] == bf16["skews"], (fp32, bf16)
    assert results[0]["none"]["losses"] == results[1]["none"]["losses"]  # agreed on every rank


def _built_ahead(world, out: str) -> dict:
    """Four steps of the trainer twice from the same start: as it runs (each next step's batch
    built in the wire wait of the last gradient bucket) and with the build ahead switched off
    (every batch built at its own step's start). Records each call of the task's batch builder:
    its data position and whether every bucket was on the wire then."""
    from scaleout.config import load_config
    from scaleout.train.trainer import Trainer
    from tests.train.test_skew import RUN

    res = {}
    for mode in ("ahead", "inline"):
        cfg = load_config(None, [*RUN, f"train.output_dir={out}/{mode}"])
        trainer = Trainer(cfg, world)
        trainer.preemption = type(
            "P", (), {"requested": False, "noticed": False, "terminating": False}
        )()
        if mode == "inline":
            trainer._build_ahead = lambda step: None
        reducer, build = trainer.model.reducer, trainer.task.micro_batches
        calls = []

        def counting(position, accum, build=build, reducer=reducer, calls=calls):
            out_on_wire = len(reducer.launch_order) == len(reducer.buckets) and not reducer.waiting
            calls.append((position, out_on_wire and reducer._in_backward is False))
            return build(position, accum)

        trainer.task.micro_batches = counting
        trainer._start_clock()
        idle = []
        for step in range(4):
            assert trainer.run_step(step) is None
            idle.append(trainer.sync.last_stats["idle_s"])
        res[mode] = {
            "calls": calls,
            "losses": [float(x) for x in trainer.losses],
            "idle": idle,
            "batch": cfg.train.global_batch,
        }
        trainer.mlperf_log.close()
    return res


@pytest.mark.multi_process
def test_the_next_batch_is_built_while_the_last_bucket_is_on_the_wire(tmp_path) -> None:
    """On a host wait (gloo, flat: nothing in flight needs this process's GIL) the trainer builds
    step s+1's batch after step s's last gradient bucket went out and before it blocks on the
    wire: each step's batch is built exactly once, the next step uses it, and the run is the run
    of the synchronous path bit for bit (2 real gloo ranks)."""
    from tests.distutil import run_dist

    results = run_dist(_built_ahead, 1, 2, args=(str(tmp_path),), timeout=180)
    for res in results:
        ahead, inline = res["ahead"], res["inline"]
        gb = ahead["batch"]
        # step 0 at its start, steps 1-4 in the wait of steps 0-3 (4 < train.max_steps)
        assert [p for p, _ in ahead["calls"]] == [s * gb for s in range(5)], ahead
        assert [w for _, w in ahead["calls"]] == [False, True, True, True, True], ahead
        assert all(t > 0 for t in ahead["idle"]), ahead
        assert [p for p, _ in inline["calls"]] == [s * gb for s in range(4)], inline
        assert inline["idle"] == [0.0] * 4, inline
        assert ahead["losses"] == inline["losses"], res


@pytest.mark.unit
def test_no_host_work_in_the_wait_while_a_comm_thread_schedule_runs() -> None:
    """A hierarchical or torus schedule runs as Python on the World's comm thread: work holding
    the GIL in the main thread would delay its phases, so the reducer runs its while_waiting
    only when that thread is idle (or absent) and the buckets are on the host."""
    import threading

    from scaleout.comm import handles

    world = init(environment="single")
    try:
        dp = DataParallel.from_config(_chain(), world, CommConfig(bucket_mb=25.0))
        assert dp.reducer._host_waits()
        release = threading.Event()
        thread = handles.comm_thread(world)
        handle = thread.submit(release.wait, torch.zeros(1))
        try:
            assert not dp.reducer._host_waits()
            ran = []
            dp.while_waiting(lambda: ran.append(1))

            def release_once_the_bucket_queued() -> None:
                # the bucket queues behind the busy thread: released once backward waits on it
                # (a fixed timer can fire before backward gets there on a loaded machine)
                deadline = time.monotonic() + 120
                while not dp.reducer.waiting and time.monotonic() < deadline:
                    time.sleep(0.005)
                release.set()

            threading.Thread(target=release_once_the_bucket_queued, daemon=True).start()
            dp(torch.randn(3, 256)).sum().backward()
            assert ran == [] and dp.last_stats["idle_s"] == 0.0
            assert dp.reducer._wait_work is None  # taken, not left for a later backward
        finally:
            release.set()
            handle.wait()
        ran = []
        dp.while_waiting(lambda: ran.append(1))
        dp(torch.randn(3, 256)).sum().backward()
        assert ran == [1]
    finally:
        world.close()
