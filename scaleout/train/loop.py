"""The training loop: World -> task (model + data) -> reducer -> optimizer + schedule -> steps with
evaluation to the target -> MLPerf log, checkpoints, report.

Kept short on purpose; every piece is built from the config elsewhere. Time-to-train is MLPerf's:
run_start (after init, all ranks at a barrier) -> run_stop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scaleout.log import print0
from scaleout.train.faults import EXIT_ABORTED, StepFlags, agree, injected_nan, nonfinite
from scaleout.train.progress import Progress
from scaleout.train.tasks import Task, build_task, steps_per_epoch

log = logging.getLogger("scaleout.train")


def eval_due(steps_done: int, every: int, first: int = 0) -> bool:
    """Evaluate after ``steps_done`` steps? Every ``every`` steps, from step ``first`` on (0: from ``every``),
    as NVIDIA's eval_iter_start_samples / eval_iter_samples in steps."""
    return steps_done >= first and (steps_done - first) % every == 0 and steps_done > 0


@dataclass
class TrainResult:
    status: str  # "success" (target reached), "max_steps", "preempted", "aborted"
    exit_code: int
    steps: int
    metric: float | None
    report: Any = None


class Trainer:
    def __init__(self, cfg: Any, world: Any, config_file: str = "config.yaml", start: Any = None,
                 guard: Any = None):
        from scaleout.checkpoint import Checkpointer
        from scaleout.mlperf import MLPerfLogger
        from scaleout.timers import Timers
        from scaleout.train.rerun import decide, set_aside

        self.cfg, self.world, self.config_file = cfg, world, config_file
        self.start_info = start if start is not None else decide(cfg)  # the rerun policy (train/rerun.py)
        self.guard = guard  # preempt.Preemption installed by run_training before the World; else by run()
        self.out = Path(cfg.train.output_dir)
        kind = self.start_info.kind
        if world.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            if kind == "new":  # an earlier run's log in this directory is kept, not appended to
                set_aside(self.out / "mlperf.log")
            if kind != "finished":  # an earlier run's or segment's report is kept
                set_aside(self.out / "report.json")
        # A resumed run appends: every attempt of a requeued or resubmitted run adds its own
        # init_start..run_stop segment (scaleout.mlperf.split_attempts); none erases an earlier one.
        writes = world.rank == 0 and kind != "finished"  # a finished run's log stays as it is
        self.mll = MLPerfLogger(self.out / "mlperf.log" if writes else None, rank=world.rank, stdout=cfg.mlperf.stdout)
        self.ckpt = Checkpointer(cfg.checkpoint.dir, cfg.checkpoint.keep, world.rank) if cfg.checkpoint.dir else None
        self.timers = Timers(world.device, every=cfg.train.timing_every)  # breakdown sampled: timers.py
        from scaleout.metrics import Metrics

        self.metrics = Metrics(self.out, cfg.train.metrics, cfg.train.log_every, enabled=world.rank == 0,
                               config=cfg.model_dump(mode="json"))

    # -- construction -------------------------------------------------------------------------------
    def build(self) -> None:
        from scaleout.optim import build_optimizer, build_schedule
        from scaleout.parallel import DataParallel
        from scaleout.parallel.data_parallel import broadcast_from_rank0

        cfg, world = self.cfg, self.world
        self.mll.cache_clear()  # MLPerf requires the cache_clear event first (caches are cold at init)
        self.mll.init_start()
        torch.manual_seed(cfg.train.seed)  # same init everywhere; rank 0's weights are broadcast anyway
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True)
        self.task: Task = build_task(cfg, world)
        from scaleout.mlperf import default_platform

        m = cfg.mlperf
        self.mll.submission(self.task.benchmark, org=m.org, division=m.division, status=m.status,
                            platform=m.platform or default_platform(world))
        model = self.task.model
        self.sharded = cfg.optim.sharded
        if cfg.model.compile:  # in place, before wrapping: the reducer's hooks stay on the parameters (capture.py)
            from scaleout.train.capture import compile_model

            compile_model(model)
        if self.sharded:  # the sharded optimizer owns its reduce-scatter / all-gather
            broadcast_from_rank0(list(model.parameters()) + list(model.buffers()), world)
            self.model = model
        else:
            self.model = DataParallel(model, world, algorithm=cfg.comm.algorithm, bucket_mb=cfg.comm.bucket_mb,
                                      compression=None if cfg.comm.compression == "none" else cfg.comm.compression,
                                      timeline=cfg.comm.timeline, overlap=cfg.comm.overlap,
                                      # re-bucketing after step 1 changes summation order; a resumed run
                                      # would re-bucket at a different step, so deterministic runs keep
                                      # the initial layout (bitwise resume)
                                      rebuild_buckets=not cfg.train.deterministic, **comm_options(cfg.comm))
            self.model.reducer.defer_census = True  # read with the step's agreement (train_step)
        from scaleout.train.capture import build_step_graphs

        self.graphs = build_step_graphs(cfg, world, self.model, self.task)  # None unless CUDA + model.cuda_graphs
        self.prefetcher: Any = None  # set by run() once the start step is known (scaleout/train/prefetch.py)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.losses: list[float | None] = []  # mean loss over ranks of every step this run took
        self.optimizer = build_optimizer(model, cfg.optim, world, cfg.comm)
        self.schedule = build_schedule(self.optimizer, cfg.optim)
        if cfg.comm.comm_nice:  # CPU/gloo: communication threads ahead of compute (after groups exist)
            world.prioritize_communication(cfg.comm.comm_nice)
        from scaleout.mlperf import hyperparameters

        self.mll.hyperparameters(hyperparameters(cfg, world.world_size, self.config_file,
                                                 steps_per_epoch(self.task, cfg.train.global_batch),
                                                 getattr(self.task, "sequences_per_row", None), world.device))

    # -- checkpoints ----------------------------------------------------------------------------------
    def _state(self, step: int) -> dict[str, Any]:
        """The replicated part of a checkpoint (only rank 0's copy is written; RNG states are gathered to it)."""
        from scaleout.checkpoint import gather_rng_states

        opt_state = self.optimizer.sharded_state()[0] if self.sharded else self.optimizer.state_dict()
        return {"model": self.task.model.state_dict(), "optimizer": opt_state,
                "config": self.cfg.model_dump(mode="json"),  # self-describing: `scaleout ckpt show/export`
                "schedule": self.schedule.state_dict(), "data_position": step * self.cfg.train.global_batch,
                "rng": gather_rng_states(self.world), "samples": self.samples, "skipped": self.skipped,
                "precision": self.task.precision.state_dict()}

    def save(self, step: int) -> None:
        if self.ckpt is None:
            return
        self.task.sync_buffers()  # collective: BN statistics equal on every rank, so a resume is exact everywhere
        state = self._state(step)  # collective: every rank takes part
        shards = self.optimizer.sharded_state()[1] if self.sharded else None  # each rank writes its own
        path = self.ckpt.save(step, state, world=self.world, shards=shards)
        if path is not None:
            print0(f"checkpoint: step {step} -> {path}", rank=self.world.rank)
        self.world.barrier()

    def resume(self) -> int:
        from scaleout.checkpoint import set_rng_state
        from scaleout.train.rerun import check_data_position

        cfg = self.cfg
        if self.ckpt is None or not self.cfg.checkpoint.resume:
            return 0
        shards = self.optimizer.sharded_state()[1] if self.sharded else None
        found = self.ckpt.restore(self.world, shards=shards)  # rank 0 chooses; every rank follows
        if found is None:
            return 0
        state, path = found
        check_data_position(state, cfg.train.global_batch, path)  # a changed global batch is refused
        self.task.model.load_state_dict(state["model"])
        if self.sharded:
            self.optimizer.load_replicated(state["optimizer"])  # the moments were read in place by restore()
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        if state["rng"] is None:
            log.warning("checkpoint %s has RNG states of another world size: RNG streams restart", path)
        else:
            set_rng_state(state["rng"])
        self.samples, self.skipped = int(state.get("samples", 0)), int(state.get("skipped", 0))
        self.task.precision.load_state_dict(state.get("precision", {}))  # the fp16 loss scale
        print0(f"resumed from {path} at step {state['step']}", rank=self.world.rank)
        return int(state["step"])

    # -- the loop -------------------------------------------------------------------------------------
    def train_step(self, step: int) -> tuple[float | None, bool, bool]:
        """One optimizer step (grad_accum micro-batches). Returns (mean loss over ranks, skipped, stop).

        Outside the steps the timers sample (scaleout/timers.py), the step reads nothing from the device
        but the agreement's result (train/faults.py), which also carries the loss."""
        cfg, t, prec = self.cfg, self.timers, self.task.precision
        t.begin()
        with t("data"):  # with a prefetcher: only the time spent *waiting* for it (scaleout/train/prefetch.py)
            if self.prefetcher is not None:
                mbs = self.prefetcher.get(step)
            else:
                mbs = self.task.micro_batches(step * cfg.train.global_batch, cfg.train.grad_accum)
        total = None
        if self.graphs is not None:  # forward + backward + all-reduce as one CUDA graph per shape (capture.py)
            with t("graph"):
                total = self.graphs(mbs)
        for i, mb in enumerate(mbs if self.graphs is None else []):
            last = i == len(mbs) - 1
            if last:
                sync = contextlib.nullcontext()
            elif self.sharded:  # the overlapped sharded LAMB sends during backward unless told not to
                no_sync = getattr(self.optimizer, "no_sync", None)
                sync = no_sync() if no_sync else contextlib.nullcontext()
            else:
                sync = self.model.no_sync()
            with sync:
                with t("forward"), self.task.autocast():
                    loss = self.task.loss(self.model, mb) / len(mbs)
                with t("backward"):
                    prec.scale_loss(loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
        if self.graphs is None:  # the wait after backward for what overlap did not hide (reducer or sharded LAMB)
            stats = getattr(self.optimizer if self.sharded else self.model, "last_stats", {})
            if "exposed_s" in stats:  # the non-overlapped sharded LAMB communicates inside step() instead
                t.add("exposed_comm", float(stats["exposed_s"]))
                t.add("backward", -float(stats["exposed_s"]))
        prec.unscale_(self.params, self.optimizer)  # fp16: gradients / S (reduced, or reduced linearly in step())
        if injected_nan(step, self.world.rank):
            self.params[0].grad.view(-1)[0] = float("nan")
        reducer = getattr(self.model, "reducer", None)
        census = reducer.census_flag() if reducer is not None else None
        g = self.guard
        flags = agree(self.world, nonfinite(self.params), g.requested, total, census, notice=g.noticed,
                      terminate=g.terminating, flops=sum(mb.flops for mb in mbs))
        self.flags = flags  # the end of the run follows these agreed flags, never this rank's own
        if flags.unused:
            reducer.check_census()  # the same census everywhere: every rank raises the same error
        prec.update(flags.skip)  # the same flag on every rank: the loss scale stays equal everywhere
        self.losses.append(flags.loss)
        if flags.skip:
            self.skipped += 1
            print0(f"step {step + 1}: non-finite gradients on some rank; every rank skips this step", rank=self.world.rank)
        else:
            with t("optimizer"):
                self.optimizer.step()
            self.schedule.step()
        self.optimizer.zero_grad(set_to_none=not hasattr(self.model, "no_sync") or self.sharded)
        return flags.loss, flags.skip, flags.stop

    def run(self) -> TrainResult:
        from scaleout import preempt
        from scaleout.train import rerun

        cfg, world, mll = self.cfg, self.world, self.mll
        if self.start_info.kind == "finished":
            print0(f"scaleout train: {self.start_info.message}", rank=world.rank)
            return TrainResult("finished", 0, self.start_info.latest_step, None)
        self.samples, self.skipped = 0, 0
        self.build()
        start = self.resume()
        self.resumed_from = start or None
        if start:  # MLPerf's key for "this run started from a checkpoint at step N" (GPT-3 rules use it)
            mll.event("init_checkpoint_step", start)
        self.record = rerun.started(cfg, self.start_info, world.world_size) if world.rank == 0 else {}
        from scaleout.train.prefetch import build_prefetcher

        # None when data.num_workers=0; reads no data until start(), after run_start (MLPerf timing rules)
        self.prefetcher = build_prefetcher(cfg, self.task, world, start)
        own_guard = self.guard is None
        if own_guard:
            self.guard = preempt.install()
        self.flags = StepFlags(skip=False, stop=False)
        mll.init_stop()
        world.barrier()
        mll.run_start()
        if self.prefetcher is not None:
            self.prefetcher.start()  # the first touch of the training data
        self._observe_start(start)
        t_start = time.perf_counter()
        is_bert = self.task.benchmark == "bert"
        epoch_of = (lambda s: s) if is_bert else (lambda s: s // max(self.task.rows, 1))  # BERT: samples
        max_steps, metric, status = cfg.train.max_steps, None, "max_steps"
        progress = Progress(max_steps, cfg.train.progress and world.rank == 0, start)
        mll.block_start(epoch_of(self.samples), 1, self.samples)
        tokens, flops = 0, 0.0
        samples_at_start = self.samples  # a resumed run reports its own samples, not the checkpoint's
        step = start
        consecutive_skips, limit = 0, cfg.train.max_consecutive_skips
        # Timed throughput without warm-up steps (train.timing_skip_steps; used by `scaleout sweep`).
        skip = cfg.train.timing_skip_steps
        self.timed = {"steps": 0, "samples": 0, "tokens": 0, "seconds": 0.0}
        for step in range(start, max_steps):
            n, toks = self.task.samples_per_step(step * cfg.train.global_batch)
            if skip and step == start + skip:
                self.timers.reset()  # breakdown_s then covers the timed steps only
            t0 = time.perf_counter()
            lr = self.optimizer.param_groups[0]["lr"]  # this step's (the schedule moves it in train_step)
            loss, skipped, stop = self.train_step(step)
            flops += self.flags.flops  # every rank's micro-batches, summed by the step's agreement
            if step >= start + skip:
                for k, v in (("steps", 1), ("samples", n), ("tokens", toks), ("seconds", time.perf_counter() - t0)):
                    self.timed[k] += v
            spans = self.timers.step(time.perf_counter() - t0)
            if step == start:  # the first step is done: from now on a hung peer is a failure, not slowness
                world.set_timeout(cfg.train.step_timeout_s)
            self.samples += n
            tokens += toks
            dt = time.perf_counter() - t0
            progress.update(step, loss, n / max(dt, 1e-9),
                            f"{self.task.metric_name} {metric:.4f}" if metric is not None else "")
            self.metrics.step(step + 1, self.samples, loss, lr, dt, n, toks, spans, skipped,
                              force=stop or step + 1 == max_steps or (step + 1) % cfg.train.eval_every == 0)
            if self.profiler is not None:
                self.profiler.step()
            if stop:
                why = "SIGTERM" if self.flags.terminate else "notice"
                print0(f"step {step + 1}: preemption ({why}) agreed by every rank: checkpoint and stop", rank=world.rank)
                self.save(step + 1)
                status = "preempted"
                break
            consecutive_skips = consecutive_skips + 1 if skipped else 0  # the same on every rank (agree())
            if limit and consecutive_skips >= limit:
                print0(f"step {step + 1}: {consecutive_skips} consecutive steps with non-finite gradients "
                       f"(train.max_consecutive_skips={limit}): the run diverged; stopping", rank=world.rank)
                status = "aborted"
                break
            done = step + 1 == max_steps
            if eval_due(step + 1, cfg.train.eval_every, cfg.train.eval_start_step) or done:
                mll.block_stop(epoch_of(self.samples), self.samples)
                mll.eval_start(epoch_of(self.samples), self.samples)
                metric = self.task.evaluate(self.task.model)
                mll.eval_accuracy(metric, epoch_of(self.samples), self.samples)
                self.metrics.eval(step + 1, self.samples, self.task.metric_name, metric, cfg.train.target)
                mll.eval_stop(epoch_of(self.samples), self.samples)
                print0(f"step {step + 1}: {self.task.metric_name} {metric:.4f} (target {cfg.train.target})",
                       rank=world.rank)
                if cfg.train.target is not None and metric >= cfg.train.target:
                    status = "success"
                    break
                if not done:
                    mll.block_start(epoch_of(self.samples), 1, self.samples)
            if cfg.checkpoint.every_steps and (step + 1) % cfg.checkpoint.every_steps == 0:
                self.save(step + 1)
        progress.close()
        if self.prefetcher is not None:
            self.prefetcher.close()
        # Agreed SIGTERM (self.flags, the same on every rank): KillWait is short, leave out the optional
        # collectives. A rank's own late SIGTERM changes nothing here.
        hurry = status == "preempted" and self.flags.terminate
        if not hurry:
            world.barrier()
        ttt = time.perf_counter() - t_start
        mll.train_samples(self.samples)
        mll.eval_samples(len(getattr(self.task, "eval_seqs", [])) or len(getattr(self.task, "eval_idx", [])))
        mll.run_stop("success" if status == "success" else "aborted", self.samples)
        steps_done = step + 1 - start
        self.status = status
        every = cfg.checkpoint.every_steps
        already = status == "max_steps" and every and (step + 1) % every == 0  # saved inside the loop
        if status in ("success", "max_steps") and self.ckpt is not None and not already and steps_done > 0:
            self.save(step + 1)
        if world.rank == 0:
            rerun.ended(cfg, self.record, status, step + 1)
        consistent = None if hurry else self._weights_consistent()
        report = self._report(ttt, steps_done, self.samples - samples_at_start, tokens, flops, metric, consistent)
        code = self._requeue_and_release() if status == "preempted" else EXIT_ABORTED if status == "aborted" else 0
        self._observe_end(status, ttt)
        if own_guard:
            self.guard.uninstall()
        return TrainResult(status, code, step + 1, metric, report)

    def _requeue_and_release(self) -> int:
        """After a preemption stop (checkpoint written): rank 0 requeues the Slurm job if some rank got a
        notice, then every rank passes one barrier and exits 75. The barrier comes after the requeue because
        under ``srun --kill-on-bad-exit=1`` the first rank to exit 75 makes Slurm kill the others: a rank 0
        still on its way to ``scontrol requeue`` would die with them and the job would end, not come back.
        Once slurmctld has recorded the requeue, its SIGTERM only sets flags here (handlers stay installed
        until run_training returns)."""
        from scaleout import preempt
        from scaleout.errors import UserError

        world, code = self.world, preempt.EXIT_PREEMPTED
        if not self.flags.notice:
            pass  # SIGTERM only: the scheduler decides (its own requeue is done; scancel means stop)
        elif self.ckpt is None:
            print0("preemption notice, but checkpoint.dir is not set: nothing was saved, so the job is not "
                   "requeued (it would start again from step 0)", rank=world.rank)
        elif world.rank == 0:
            preempt.hold_requeue_for_tests(self.guard)
            try:
                if (self.flags.terminate or self.guard.terminating) and not preempt.time_limit_reached():
                    print("preemption notice, then SIGTERM before the time limit (scancel?): not requeueing", flush=True)
                elif preempt.requeue():
                    print(f"requeued Slurm job {preempt.slurm_job_id()}", flush=True)
            except (UserError, OSError, subprocess.SubprocessError) as exc:
                print(f"rank 0: {exc}", file=sys.stderr, flush=True)
                code = 1
        try:
            world.barrier()
        except RuntimeError as exc:  # a peer already gone (killed at the end of KillWait): nothing left to wait for
            log.warning("rank %d: final barrier after the preemption stop failed: %s", world.rank, exc)
        return code

    def _observe_start(self, start: int) -> None:
        """Metrics file header and the profiler (scaleout/metrics.py, scaleout/profile.py)."""
        from scaleout.profile import build_profiler

        w = self.world
        self.metrics.start(world_size=w.world_size, nodes=w.num_nodes, ranks_per_node=w.local_size,
                           launcher=w.source, config=self.config_file, arch=self.cfg.model.arch, start_step=start,
                           global_batch=self.cfg.train.global_batch)
        self.profiler = build_profiler(self.cfg.train.profile, self.out, w.rank)

    def _observe_end(self, status: str, ttt: float) -> None:
        png = self.metrics.close(status, time_to_train_s=ttt)
        traces = self.profiler.close() if self.profiler is not None else []
        if png is not None:
            print0(f"metrics: {self.out / 'metrics.jsonl'}, curves {png}", rank=self.world.rank)
        if traces:
            print0(f"profile: traces in {traces[0].parent} (Perfetto, TensorBoard, HTA)", rank=self.world.rank)

    def _weights_consistent(self) -> bool:
        """Data parallelism keeps every replica identical; check it (one all-gather of a float64 digest)."""
        import torch.distributed as dist

        with torch.no_grad():
            digest = torch.stack([p.detach().double().sum() + (p.detach().double() ** 2).sum()
                                  for p in self.task.model.parameters()]).sum().reshape(1)
        if self.world.world_size == 1:
            return True
        everyone = [torch.zeros_like(digest) for _ in range(self.world.world_size)]
        dist.all_gather(everyone, digest)
        return all(bool(torch.equal(d, everyone[0])) for d in everyone)

    def _peak_rss_mib(self) -> float | None:
        """Peak resident memory of the most hungry rank process (ru_maxrss, KiB on Linux), in MiB."""
        import resource

        import torch.distributed as dist

        peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
        if self.world.world_size > 1:
            if self.guard.terminating:
                return None
            peak = peak.to(self.world.device)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return float(peak.item())

    def _report(
        self, ttt: float, steps: int, samples: int, tokens: int, flops: float, metric: float | None,
        consistent: bool | None,
    ) -> Any:
        from scaleout.checkpoint import atomic_write
        from scaleout.devices import device_peak
        from scaleout.report import QUALITY_EXPONENT, RunReport

        cfg, world = self.cfg, self.world
        peak = device_peak(world.device, cfg.train.precision, cfg.train.peak_flops, ranks_on_host=world.local_size)
        report = RunReport(
            arch=cfg.model.arch, time_to_train_s=max(ttt, 1e-9), steps=steps, samples=samples,
            flops_per_sample=flops / max(samples, 1),  # counted per micro-batch from what ran (MicroBatch.flops)
            devices=world.world_size, real_tokens=tokens, achieved=metric, target=cfg.train.target,
            quality_exponent=QUALITY_EXPONENT.get(self.task.benchmark), device_name=peak.name,
            peak_flops_per_device=peak.flops, peak_source=peak.source, breakdown_s=self.timers.mean(),
        )
        # The fraction of step time spent waiting for data, over the steps the timers sampled.
        data_wait = self.timers.mean().get("data", 0.0) / max(self.timers.mean_step(), 1e-12)
        peak_rss = self._peak_rss_mib()  # a collective (MAX over ranks) unless a peer may be gone
        if world.rank == 0:
            print(report.render(), flush=True)
            print(f"data wait: {self.timers.mean().get('data', 0.0) * 1e3:.2f} ms per step = {data_wait:.1%} of step time "
                  f"(data.num_workers={cfg.data.num_workers})", flush=True)
            plain = self.timed["seconds"] / max(self.timed["steps"], 1)
            print(f"step time: {plain * 1e3:.2f} ms plain (every timed step); breakdown sampled on {self.timers.steps} "
                  f"steps (train.timing_every={self.timers.every}), {self.timers.mean_step() * 1e3:.2f} ms each", flush=True)
            if consistent is False:
                print("WARNING: model replicas differ between ranks at the end of the run", flush=True)
            payload = {**report.to_dict(), "skipped_steps": self.skipped, "weights_consistent": consistent,
                       "resumed_from_step": self.resumed_from, "run_id": self.record.get("run_id"),
                       "data_wait_fraction": data_wait, "peak_rss_mib_per_rank_max": peak_rss,
                       # breakdown_s: means over the sampled steps (they synchronise the device per phase);
                       # timed.step_s: every timed step, uninstrumented
                       "breakdown_sampling": {"every": self.timers.every, "steps": self.timers.steps,
                                              "step_s": self.timers.mean_step()},
                       "status": self.status, "task": getattr(self.task, "info", {}),
                       "timed": {**self.timed, "skipped_warmup_steps": cfg.train.timing_skip_steps,
                                 "samples_per_s": self.timed["samples"] / max(self.timed["seconds"], 1e-12),
                                 "step_s": self.timed["seconds"] / max(self.timed["steps"], 1)}}
            atomic_write(self.out / "report.json", json.dumps(payload, indent=2, default=str).encode())
        return report


def comm_options(comm: Any) -> dict[str, Any]:
    """The all-reduce options of ``comm`` (scaleout.comm.all_reduce): torus grid, pipeline chunk."""
    opts: dict[str, Any] = {k: v for k, v in (("x", comm.torus_x), ("y", comm.torus_y)) if v}
    if comm.chunk_mb is not None:
        opts["chunk_bytes"] = max(1, int(comm.chunk_mb * 2**20))
    return opts


def run_training(cfg: Any, config_file: str = "config.yaml") -> TrainResult:
    """Entry point inside every rank (``scaleout train``)."""
    import scaleout
    from scaleout import preempt
    from scaleout.train.faults import exit_on_comm_failure, is_comm_failure
    from scaleout.train.liveness import Heartbeat, period_for
    from scaleout.train.rerun import decide

    start = decide(cfg)  # the rerun policy, before any network or file: a refused start changes nothing
    if start.kind == "finished":
        print0(f"scaleout train: {start.message}")
        return TrainResult("finished", 0, start.latest_step, None)
    # Handlers first: the World's rendezvous can take minutes at scale, and a notice that arrives while
    # USR2 still has its default action would terminate the rank.
    guard = preempt.install()
    try:
        world = scaleout.init(cfg)
        heartbeat = Heartbeat(world, lambda: period_for(world.timeout_s))  # names a hung rank if one hangs
        try:
            cfg.check_world(world.world_size, world.local_size)
            torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))))
            return Trainer(cfg, world, config_file, start, guard=guard).run()
        except Exception as exc:
            if is_comm_failure(exc):  # a hung or dead peer: one line naming it, then end this process now
                exit_on_comm_failure(world, exc)
            raise
        finally:
            heartbeat.close()
            world.close()
    finally:
        guard.uninstall()
