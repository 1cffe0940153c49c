"""The training loop: World -> task (model + data) -> gradient sync -> optimizer + schedule -> steps with
evaluation to the target -> MLPerf log, checkpoints, report.

Kept short on purpose; every piece is built from the config elsewhere, and the loop asks interfaces instead
of modes: the task (scaleout/families/task.py) for everything about the model family, the gradient sync
(scaleout/parallel/sync.py: DataParallel or the sharded optimizer) for everything about communication and
optimizer state. Time-to-train is MLPerf's: run_start (after init, all ranks at a barrier) -> run_stop.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from scaleout import preempt
from scaleout.checkpoint import Checkpointer
from scaleout.config.schema import Config
from scaleout.data.batches import MicroBatch
from scaleout.log import print0
from scaleout.metrics import Metrics
from scaleout.mlperf import MLPerfLogger, default_platform
from scaleout.optim import build_optimizer, build_schedule
from scaleout.parallel import DataParallel
from scaleout.parallel.data_parallel import broadcast_from_rank0
from scaleout.parallel.sync import GradientSync
from scaleout.profile import build_profiler
from scaleout.timers import Timers
from scaleout.train import prefetch, rerun
from scaleout.train.capture import build_step_graphs, compile_model
from scaleout.train.faults import (
    EXIT_ABORTED,
    StepFlags,
    agree,
    exit_on_comm_failure,
    injected_nan,
    is_comm_failure,
    nonfinite,
)
from scaleout.train.finish import requeue_and_release, weights_consistent, write_report
from scaleout.train.hparams import hyperparameters
from scaleout.train.liveness import Heartbeat, period_for
from scaleout.train.progress import Progress
from scaleout.train.state import resume_checkpoint, save_checkpoint
from scaleout.train.task import Task, build_task
from scaleout.world import World, init


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


@dataclass
class _Run:
    """What one call of Trainer.run carries from the start through the steps to the finish."""

    start: int  # the first step of this run (a resumed run starts at its checkpoint's)
    progress: Progress
    own_guard: bool  # run() installed the preemption handlers, so it removes them
    samples_at_start: int  # a resumed run reports its own samples, not the checkpoint's
    t_start: float = field(default_factory=time.perf_counter)
    step: int = 0  # the last step taken (start if none was)
    status: str = "max_steps"
    metric: float | None = None
    tokens: int = 0
    flops: float = 0.0


class Trainer:
    def __init__(
        self,
        cfg: Config,
        world: World,
        config_file: str = "config.yaml",
        start: rerun.RunStart | None = None,
        guard: preempt.Preemption | None = None,
    ):
        self.cfg, self.world, self.config_file = cfg, world, config_file
        self.start_info = (
            start if start is not None else rerun.decide(cfg)
        )  # the rerun policy (train/rerun.py)
        self.guard = (
            guard  # preempt.Preemption installed by run_training before the World; else by run()
        )
        self.out = Path(cfg.train.output_dir)
        kind = self.start_info.kind
        if world.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            if kind == "new":  # an earlier run's log in this directory is kept, not appended to
                rerun.set_aside(self.out / "mlperf.log")
            if kind != "finished":  # an earlier run's or segment's report is kept
                rerun.set_aside(self.out / "report.json")
        # A resumed run appends: every attempt of a requeued or resubmitted run adds its own
        # init_start..run_stop segment (scaleout.mlperf.split_attempts); none erases an earlier one.
        writes = world.rank == 0 and kind != "finished"  # a finished run's log stays as it is
        self.mll = MLPerfLogger(
            self.out / "mlperf.log" if writes else None, rank=world.rank, stdout=cfg.mlperf.stdout
        )
        self.ckpt = (
            Checkpointer(cfg.checkpoint.dir, cfg.checkpoint.keep, world.rank)
            if cfg.checkpoint.dir
            else None
        )
        self.timers = Timers(
            world.device, every=cfg.train.timing_every
        )  # breakdown sampled: timers.py
        self.metrics = Metrics(
            self.out,
            cfg.train.metrics,
            cfg.train.log_every,
            enabled=world.rank == 0,
            config=cfg.model_dump(mode="json"),
        )

    # -- construction -------------------------------------------------------------------------------
    def build(self) -> None:
        cfg, world = self.cfg, self.world
        self.mll.cache_clear()  # MLPerf requires the cache_clear event first (caches are cold at init)
        self.mll.init_start()
        torch.manual_seed(
            cfg.train.seed
        )  # same init everywhere; rank 0's weights are broadcast anyway
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True)
        self.task: Task = build_task(cfg, world)
        m = cfg.mlperf
        self.mll.submission(
            self.task.benchmark,
            org=m.org,
            division=m.division,
            status=m.status,
            platform=m.platform or default_platform(world),
        )
        model = self.task.model
        if (
            cfg.model.compile
        ):  # in place, before wrapping: the reducer's hooks stay on the parameters (capture.py)
            compile_model(model)
        if cfg.optim.sharded:  # the sharded optimizer owns its reduce-scatter / all-gather
            broadcast_from_rank0(list(model.parameters()) + list(model.buffers()), world)
            self.model = model
        else:
            self.model = DataParallel.from_config(
                model,
                world,
                cfg.comm,
                # re-bucketing after step 1 changes summation order; a
                # resumed run would re-bucket at a different step, so
                # deterministic runs keep the initial layout (bitwise resume)
                rebuild_buckets=not cfg.train.deterministic,
                defer_census=True,
            )  # read with the step's agreement (train_step)
        self.graphs = build_step_graphs(
            cfg, world, self.model, self.task
        )  # None unless CUDA + model.cuda_graphs
        self.prefetcher: Any = (
            None  # set by run() once the start step is known (scaleout/train/prefetch.py)
        )
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.losses: list[float | None] = []  # mean loss over ranks of every step this run took
        self.optimizer = build_optimizer(
            model, cfg.optim, world, cfg.comm, no_decay=self.task.family.no_decay
        )
        # Who averages the gradients, and so owns the optimizer state's layout: the one mode decision.
        self.sync: GradientSync = self.optimizer if cfg.optim.sharded else self.model
        self.schedule = build_schedule(self.optimizer, cfg.optim)
        if (
            cfg.comm.comm_nice
        ):  # CPU/gloo: communication threads ahead of compute (after groups exist)
            world.prioritize_communication(cfg.comm.comm_nice)
        self.mll.hyperparameters(
            hyperparameters(
                cfg,
                world.world_size,
                self.config_file,
                self.task.steps_per_epoch(cfg.train.global_batch),
                self.task.sequences_per_row,
                world.device,
            )
        )

    # -- checkpoints (scaleout/train/state.py) ---------------------------------------------------------
    def save(self, step: int) -> None:
        save_checkpoint(self, step)

    def resume(self) -> int:
        return resume_checkpoint(self)

    # -- one step -------------------------------------------------------------------------------------
    def train_step(self, step: int) -> tuple[float | None, bool, bool]:
        """One optimizer step (grad_accum micro-batches). Returns (mean loss over ranks, skipped, stop).

        Outside the steps the timers sample (scaleout/timers.py), the step reads nothing from the device
        but the agreement's result (train/faults.py), which also carries the loss."""
        cfg, t, prec = self.cfg, self.timers, self.task.precision
        t.begin()
        with t(
            "data"
        ):  # with a prefetcher: only the time spent *waiting* for it (scaleout/train/prefetch.py)
            if self.prefetcher is not None:
                mbs = self.prefetcher.get(step)
            else:
                mbs = self.task.micro_batches(step * cfg.train.global_batch, cfg.train.grad_accum)
        if (
            self.graphs is not None
        ):  # forward + backward + all-reduce as one CUDA graph per shape (capture.py)
            with t("graph"):
                total = self.graphs(mbs)
        else:
            total = self._forward_backward(mbs)
            exposed = self.sync.last_stats.get(
                "exposed_s"
            )  # backward's wait for what overlap did not hide
            if (
                exposed is not None
            ):  # the non-overlapped sharded LAMB communicates inside step() instead
                t.add("exposed_comm", float(exposed))
                t.add("backward", -float(exposed))
        prec.unscale_(
            self.params, self.optimizer
        )  # fp16: gradients / S (reduced, or reduced linearly in step())
        if injected_nan(step, self.world.rank):
            self.params[0].grad.view(-1)[0] = float("nan")
        g = self.guard
        flags = agree(
            self.world,
            nonfinite(self.params),
            g.requested,
            total,
            self.sync.census_flag(),
            notice=g.noticed,
            terminate=g.terminating,
            flops=sum(mb.flops for mb in mbs),
        )
        self.flags = flags  # the end of the run follows these agreed flags, never this rank's own
        if flags.unused:
            self.sync.check_census()  # the same census everywhere: every rank raises the same error
        prec.update(
            flags.skip
        )  # the same flag on every rank: the loss scale stays equal everywhere
        self.losses.append(flags.loss)
        if flags.skip:
            self.skipped += 1
            print0(
                f"step {step + 1}: non-finite gradients on some rank; every rank skips this step",
                rank=self.world.rank,
            )
        else:
            with t("optimizer"):
                self.optimizer.step()
            self.schedule.step()
        self.optimizer.zero_grad(set_to_none=not self.sync.grads_are_views)
        return flags.loss, flags.skip, flags.stop

    def _forward_backward(self, mbs: list[MicroBatch]) -> torch.Tensor | None:
        """Forward and backward of each micro-batch; all but the last accumulate without communicating.
        Returns the step's loss (a device tensor: nothing is read here)."""
        t, total = self.timers, None
        for i, mb in enumerate(mbs):
            with contextlib.nullcontext() if i == len(mbs) - 1 else self.sync.no_sync():
                with t("forward"), self.task.autocast():
                    loss = self.task.loss(self.model, mb) / len(mbs)
                with t("backward"):
                    self.task.precision.scale_loss(loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
        return total

    # -- the run ----------------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        if self.start_info.kind == "finished":
            print0(f"scaleout train: {self.start_info.message}", rank=self.world.rank)
            return TrainResult("finished", 0, self.start_info.latest_step, None)
        run = self._begin()
        self._loop(run)
        return self._finish(run)

    def _begin(self) -> _Run:
        """Build, resume, start the data prefetcher and the preemption handlers; MLPerf init_stop, run_start."""
        cfg, world, mll = self.cfg, self.world, self.mll
        self.samples, self.skipped = 0, 0
        self.build()
        start = self.resume()
        self.resumed_from = start or None
        if (
            start
        ):  # MLPerf's key for "this run started from a checkpoint at step N" (GPT-3 rules use it)
            mll.event("init_checkpoint_step", start)
        self.record = (
            rerun.started(cfg, self.start_info, world.world_size) if world.rank == 0 else {}
        )
        # None when data.num_workers=0; reads no data until start(), after run_start (MLPerf timing rules)
        self.prefetcher = prefetch.build_prefetcher(cfg, self.task, world, start)
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
        run = _Run(
            start=start,
            step=start,
            own_guard=own_guard,
            samples_at_start=self.samples,
            progress=Progress(cfg.train.max_steps, cfg.train.progress and world.rank == 0, start),
        )
        mll.block_start(self.task.epoch_of(self.samples), 1, self.samples)
        # Timed throughput without warm-up steps (train.timing_skip_steps; used by `scaleout sweep`).
        self.timed = {"steps": 0, "samples": 0, "tokens": 0, "seconds": 0.0}
        return run

    def _loop(self, run: _Run) -> None:
        """Steps until the target, max_steps, an agreed preemption or divergence; sets ``run.status``."""
        cfg = self.cfg
        consecutive_skips, limit = 0, cfg.train.max_consecutive_skips
        for step in range(run.start, cfg.train.max_steps):
            run.step = step
            skipped, stop = self._timed_step(run, step)
            if stop:
                why = "SIGTERM" if self.flags.terminate else "notice"
                print0(
                    f"step {step + 1}: preemption ({why}) agreed by every rank: checkpoint and stop",
                    rank=self.world.rank,
                )
                self.save(step + 1)
                run.status = "preempted"
                return
            consecutive_skips = (
                consecutive_skips + 1 if skipped else 0
            )  # the same on every rank (agree())
            if limit and consecutive_skips >= limit:
                print0(
                    f"step {step + 1}: {consecutive_skips} consecutive steps with non-finite gradients "
                    f"(train.max_consecutive_skips={limit}): the run diverged; stopping",
                    rank=self.world.rank,
                )
                run.status = "aborted"
                return
            done = step + 1 == cfg.train.max_steps
            if eval_due(step + 1, cfg.train.eval_every, cfg.train.eval_start_step) or done:
                run.metric = self._evaluate(step)
                if cfg.train.target is not None and run.metric >= cfg.train.target:
                    run.status = "success"
                    return
                if not done:
                    self.mll.block_start(self.task.epoch_of(self.samples), 1, self.samples)
            if cfg.checkpoint.every_steps and (step + 1) % cfg.checkpoint.every_steps == 0:
                self.save(step + 1)

    def _timed_step(self, run: _Run, step: int) -> tuple[bool, bool]:
        """train_step plus its accounting (throughput, timers, metrics, progress). Returns (skipped, stop)."""
        cfg = self.cfg
        n, toks = self.task.samples_per_step(step * cfg.train.global_batch)
        skip = cfg.train.timing_skip_steps
        if skip and step == run.start + skip:
            self.timers.reset()  # breakdown_s then covers the timed steps only
        t0 = time.perf_counter()
        lr = self.optimizer.param_groups[0][
            "lr"
        ]  # this step's (the schedule moves it in train_step)
        loss, skipped, stop = self.train_step(step)
        run.flops += self.flags.flops  # every rank's micro-batches, summed by the step's agreement
        if step >= run.start + skip:
            for k, v in (
                ("steps", 1),
                ("samples", n),
                ("tokens", toks),
                ("seconds", time.perf_counter() - t0),
            ):
                self.timed[k] += v
        spans = self.timers.step(time.perf_counter() - t0)
        if (
            step == run.start
        ):  # the first step is done: from now on a hung peer is a failure, not slowness
            self.world.set_timeout(cfg.train.step_timeout_s)
        self.samples += n
        run.tokens += toks
        dt = time.perf_counter() - t0
        run.progress.update(
            step,
            loss,
            n / max(dt, 1e-9),
            f"{self.task.metric_name} {run.metric:.4f}" if run.metric is not None else "",
        )
        self.metrics.step(
            step + 1,
            self.samples,
            loss,
            lr,
            dt,
            n,
            toks,
            spans,
            skipped,
            force=stop or step + 1 == cfg.train.max_steps or (step + 1) % cfg.train.eval_every == 0,
        )
        if self.profiler is not None:
            self.profiler.step()
        return skipped, stop

    def _evaluate(self, step: int) -> float:
        """One evaluation inside MLPerf's block/eval events; the metric also goes to metrics and stdout."""
        mll, samples, epoch = self.mll, self.samples, self.task.epoch_of(self.samples)
        mll.block_stop(epoch, samples)
        mll.eval_start(epoch, samples)
        metric = self.task.evaluate(self.task.model)
        mll.eval_accuracy(metric, epoch, samples)
        self.metrics.eval(step + 1, samples, self.task.metric_name, metric, self.cfg.train.target)
        mll.eval_stop(epoch, samples)
        print0(
            f"step {step + 1}: {self.task.metric_name} {metric:.4f} (target {self.cfg.train.target})",
            rank=self.world.rank,
        )
        return metric

    def _finish(self, run: _Run) -> TrainResult:
        """MLPerf run_stop, the final checkpoint, the report, and the exit code of ``run.status``."""
        cfg, world, mll, status, step = self.cfg, self.world, self.mll, run.status, run.step
        run.progress.close()
        if self.prefetcher is not None:
            self.prefetcher.close()
        # Agreed SIGTERM (self.flags, the same on every rank): KillWait is short, leave out the optional
        # collectives. A rank's own late SIGTERM changes nothing here.
        hurry = status == "preempted" and self.flags.terminate
        if not hurry:
            world.barrier()
        ttt = time.perf_counter() - run.t_start
        mll.train_samples(self.samples)
        mll.eval_samples(self.task.eval_size)
        mll.run_stop("success" if status == "success" else "aborted", self.samples)
        steps_done = step + 1 - run.start
        self.status = status
        every = cfg.checkpoint.every_steps
        already = (
            status == "max_steps" and every and (step + 1) % every == 0
        )  # saved inside the loop
        if (
            status in ("success", "max_steps")
            and self.ckpt is not None
            and not already
            and steps_done > 0
        ):
            self.save(step + 1)
        if world.rank == 0:
            rerun.ended(cfg, self.record, status, step + 1)
        consistent = None if hurry else weights_consistent(self.task.model, world)
        report = write_report(
            self,
            ttt,
            steps_done,
            self.samples - run.samples_at_start,
            run.tokens,
            run.flops,
            run.metric,
            consistent,
        )
        if status == "preempted":
            code = requeue_and_release(
                world, self.flags, self.guard, checkpointing=self.ckpt is not None
            )
        else:
            code = EXIT_ABORTED if status == "aborted" else 0
        self._observe_end(status, ttt)
        if run.own_guard:
            self.guard.uninstall()
        return TrainResult(status, code, step + 1, run.metric, report)

    def _observe_start(self, start: int) -> None:
        """Metrics file header and the profiler (scaleout/metrics.py, scaleout/profile.py)."""
        w = self.world
        self.metrics.start(
            world_size=w.world_size,
            nodes=w.num_nodes,
            ranks_per_node=w.local_size,
            launcher=w.launcher,
            config=self.config_file,
            arch=self.cfg.model.arch,
            start_step=start,
            global_batch=self.cfg.train.global_batch,
        )
        self.profiler = build_profiler(self.cfg.train.profile, self.out, w.rank)

    def _observe_end(self, status: str, ttt: float) -> None:
        png = self.metrics.close(status, time_to_train_s=ttt)
        traces = self.profiler.close() if self.profiler is not None else []
        if png is not None:
            print0(f"metrics: {self.out / 'metrics.jsonl'}, curves {png}", rank=self.world.rank)
        if traces:
            print0(
                f"profile: traces in {traces[0].parent} (Perfetto, TensorBoard, HTA)",
                rank=self.world.rank,
            )


def run_training(cfg: Config, config_file: str = "config.yaml") -> TrainResult:
    """Entry point inside every rank (``scaleout train``)."""
    start = rerun.decide(
        cfg
    )  # the rerun policy, before any network or file: a refused start changes nothing
    if start.kind == "finished":
        print0(f"scaleout train: {start.message}")
        return TrainResult("finished", 0, start.latest_step, None)
    # Handlers first: the World's rendezvous can take minutes at scale, and a notice that arrives while
    # USR2 still has its default action would terminate the rank.
    guard = preempt.install()
    try:
        world = init(cfg)
        heartbeat = Heartbeat(
            world, lambda: period_for(world.timeout_s)
        )  # names a hung rank if one hangs
        try:
            cfg.check_world(world.world_size, world.local_size)
            torch.set_num_threads(
                max(1, int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
            )
            return Trainer(cfg, world, config_file, start, guard=guard).run()
        except Exception as exc:
            if is_comm_failure(
                exc
            ):  # a hung or dead peer: one line naming it, then end this process now
                exit_on_comm_failure(world, exc)
            raise
        finally:
            heartbeat.close()
            world.close()
    finally:
        guard.uninstall()
