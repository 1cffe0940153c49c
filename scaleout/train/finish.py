"""The end of a run, after the last step: the replica check, peak memory, report.json, and the release
after a preemption stop (requeue, last barrier). Split from the loop (scaleout/train/loop.py), which calls
these once."""

from __future__ import annotations

import json
import logging
import resource
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from scaleout import preempt
from scaleout.checkpoint import atomic_write
from scaleout.devices import device_peak
from scaleout.errors import UserError
from scaleout.log import print0
from scaleout.report import RunReport
from scaleout.world import World

if TYPE_CHECKING:
    from scaleout.train.loop import Trainer

log = logging.getLogger("scaleout.train")


def weights_consistent(model: torch.nn.Module, world: World) -> bool:
    """Data parallelism keeps every replica identical; check it (one all-gather of a float64 digest)."""
    with torch.no_grad():
        digest = (
            torch.stack(
                [
                    p.detach().double().sum() + (p.detach().double() ** 2).sum()
                    for p in model.parameters()
                ]
            )
            .sum()
            .reshape(1)
        )
    if world.world_size == 1:
        return True
    everyone = [torch.zeros_like(digest) for _ in range(world.world_size)]
    dist.all_gather(everyone, digest)
    return all(bool(torch.equal(d, everyone[0])) for d in everyone)


def peak_rss_mib(world: World, guard: Any) -> float | None:
    """Peak resident memory of the most hungry rank process (ru_maxrss, KiB on Linux), in MiB; None when a
    peer may be gone (a SIGTERM is pending), since it is a collective."""
    peak = torch.tensor(
        [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64
    )
    if world.world_size > 1:
        if guard.terminating:
            return None
        peak = peak.to(world.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak.item())


def write_report(
    tr: Trainer,
    ttt: float,
    steps: int,
    samples: int,
    tokens: int,
    flops: float,
    metric: float | None,
    consistent: bool | None,
) -> RunReport:
    """The run's RunReport; rank 0 prints it and writes report.json (a collective: peak memory)."""
    cfg, world, timers = tr.cfg, tr.world, tr.timers
    peak = device_peak(
        world.device, cfg.train.precision, cfg.train.peak_flops, ranks_on_host=world.local_size
    )
    report = RunReport(
        arch=cfg.model.arch,
        time_to_train_s=max(ttt, 1e-9),
        steps=steps,
        samples=samples,
        flops_per_sample=flops
        / max(samples, 1),  # counted per micro-batch from what ran (MicroBatch.flops)
        devices=world.world_size,
        real_tokens=tokens,
        achieved=metric,
        target=cfg.train.target,
        quality_exponent=tr.task.family.quality_exponent,
        device_name=peak.name,
        peak_flops_per_device=peak.flops,
        peak_source=peak.source,
        breakdown_s=timers.mean(),
    )
    # The fraction of step time spent waiting for data, over the steps the timers sampled.
    data_wait = timers.mean().get("data", 0.0) / max(timers.mean_step(), 1e-12)
    peak_rss = peak_rss_mib(
        world, tr.guard
    )  # a collective (MAX over ranks) unless a peer may be gone
    if world.rank != 0:
        return report
    timed = tr.timed
    print(report.render(), flush=True)
    print(
        f"data wait: {timers.mean().get('data', 0.0) * 1e3:.2f} ms per step = {data_wait:.1%} of step time "
        f"(data.num_workers={cfg.data.num_workers})",
        flush=True,
    )
    plain = timed["seconds"] / max(timed["steps"], 1)
    print(
        f"step time: {plain * 1e3:.2f} ms plain (every timed step); breakdown sampled on {timers.steps} "
        f"steps (train.timing_every={timers.every}), {timers.mean_step() * 1e3:.2f} ms each",
        flush=True,
    )
    if consistent is False:
        print("WARNING: model replicas differ between ranks at the end of the run", flush=True)
    payload = {
        **report.to_dict(),
        "skipped_steps": tr.skipped,
        "weights_consistent": consistent,
        "resumed_from_step": tr.resumed_from,
        "run_id": tr.record.get("run_id"),
        "data_wait_fraction": data_wait,
        "peak_rss_mib_per_rank_max": peak_rss,
        # breakdown_s: means over the sampled steps (they synchronise the device per phase);
        # timed.step_s: every timed step, uninstrumented
        "breakdown_sampling": {
            "every": timers.every,
            "steps": timers.steps,
            "step_s": timers.mean_step(),
        },
        "status": tr.status,
        "task": tr.task.info,
        "timed": {
            **timed,
            "skipped_warmup_steps": cfg.train.timing_skip_steps,
            "samples_per_s": timed["samples"] / max(timed["seconds"], 1e-12),
            "step_s": timed["seconds"] / max(timed["steps"], 1),
        },
    }
    atomic_write(tr.out / "report.json", json.dumps(payload, indent=2, default=str).encode())
    return report


def requeue_and_release(world: World, flags: Any, guard: Any, checkpointing: bool) -> int:
    """After a preemption stop (checkpoint written): rank 0 requeues the Slurm job if some rank got a
    notice, then every rank passes one barrier and exits 75. The barrier comes after the requeue because
    under ``srun --kill-on-bad-exit=1`` the first rank to exit 75 makes Slurm kill the others: a rank 0
    still on its way to ``scontrol requeue`` would die with them and the job would end, not come back.
    Once slurmctld has recorded the requeue, its SIGTERM only sets flags here (handlers stay installed
    until run_training returns). ``flags``: the agreed StepFlags of the last step."""
    code = preempt.EXIT_PREEMPTED
    if not flags.notice:
        pass  # SIGTERM only: the scheduler decides (its own requeue is done; scancel means stop)
    elif not checkpointing:
        print0(
            "preemption notice, but checkpoint.dir is not set: nothing was saved, so the job is not "
            "requeued (it would start again from step 0)",
            rank=world.rank,
        )
    elif world.rank == 0:
        preempt.hold_requeue_for_tests(guard)
        try:
            if (flags.terminate or guard.terminating) and not preempt.time_limit_reached():
                print(
                    "preemption notice, then SIGTERM before the time limit (scancel?): not requeueing",
                    flush=True,
                )
            elif preempt.requeue():
                print(f"requeued Slurm job {preempt.slurm_job_id()}", flush=True)
        except (UserError, OSError, subprocess.SubprocessError) as exc:
            print(f"rank 0: {exc}", file=sys.stderr, flush=True)
            code = 1
    try:
        world.barrier()
    except (
        RuntimeError
    ) as exc:  # a peer already gone (killed at the end of KillWait): nothing left to wait for
        log.warning("rank %d: final barrier after the preemption stop failed: %s", world.rank, exc)
    return code
