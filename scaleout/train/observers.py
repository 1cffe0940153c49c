"""The trainer's reporting channels, each an :class:`~scaleout.train.observe.Observer`: MLPerf log,
the metrics file, the progress line, the console messages, the profiler and the end-of-run
report. The trainer builds them in ``__init__`` (:func:`default_observers`) and calls their hooks
in list order."""

from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from scaleout.config.schema import Config
from scaleout.errors import UserError
from scaleout.fsutil import atomic_write
from scaleout.goodput import quarantine
from scaleout.log import print0
from scaleout.telemetry.devices import device_peak
from scaleout.telemetry.metrics import Metrics
from scaleout.telemetry.mlperf import MLPerfLogger, default_platform
from scaleout.telemetry.profiler import StepProfiler, build_profiler
from scaleout.telemetry.report import RunReport, verdict
from scaleout.telemetry.startup import describe as describe_start
from scaleout.telemetry.timers import Timers
from scaleout.train.devicetime import compute_timing
from scaleout.train.observe import (
    EvalRecord,
    EvalStart,
    InitEnd,
    Observer,
    RunEnd,
    RunStart,
    RunStop,
    StepRecord,
    eval_due,
    next_eval,
)
from scaleout.train.progress import Progress
from scaleout.train.skew import SkewTracker, quarantine_verdicts
from scaleout.world import World


class MLPerfObserver(Observer):
    """The MLPerf log (``<output_dir>/mlperf.log``): its constructor opens the initialization
    (cache_clear, init_start), so the trainer makes it first; the clock runs from run_start to
    run_stop.

    Families with ``mlperf_epochs`` (ResNet) are logged as the MLPerf reference and NVIDIA's
    ``mlperf_fit`` write them: an epoch is ``steps_per_epoch`` steps (NVIDIA's
    ``get_epoch_size``), numbered from 1; ``epoch_start``/``epoch_stop`` around every epoch;
    ``block_start`` carries the block's first epoch and ``epoch_count`` = the epochs until the next
    evaluation (the eval period); evaluations carry the epoch of the last step trained; and
    ``train_samples`` is the training set's size. Others (BERT) keep samples as epoch numbers."""

    def __init__(self, log: MLPerfLogger, cfg: Config, world: World):
        self.log, self.cfg, self.world = log, cfg, world
        self.epochs = cfg.model.family.mlperf_epochs
        self.spe, self.train_set_size, self.block_first = 1, None, 1
        log.cache_clear()  # MLPerf requires the cache_clear event first (caches are cold at init)
        log.init_start()

    def on_init_end(self, init: InitEnd) -> None:
        m = self.cfg.mlperf
        self.spe, self.train_set_size = max(init.steps_per_epoch, 1), init.train_set_size
        self.log.submission(
            init.benchmark,
            org=m.org,
            division=m.division,
            status=m.status,
            platform=m.platform or default_platform(self.world),
        )
        self.log.hyperparameters(init.hyperparameters)
        # MLPerf's key for "started from a checkpoint at step N" (GPT-3 rules)
        if init.resumed_from:
            self.log.event("init_checkpoint_step", init.resumed_from)
        self.log.init_stop()

    # -- epochs (mlperf_epochs families)
    def _epoch_of_step(self, steps_done: int) -> int:
        """The 1-based epoch the last step taken belongs to."""
        return -(-steps_done // self.spe)

    def _eval_due(self, steps_done: int) -> bool:
        t = self.cfg.train
        return eval_due(steps_done, t.eval_every, t.eval_start_step) or steps_done >= t.max_steps

    def _block_start(self, steps_done: int, samples: int) -> None:
        t = self.cfg.train
        first = steps_done // self.spe + 1
        until = min(next_eval(steps_done, t.eval_every, t.eval_start_step), t.max_steps)
        count = max(self._epoch_of_step(until) - first + 1, 1)
        self.block_first = first
        self.log.block_start(first, count, samples)

    def on_run_start(self, start: RunStart) -> None:
        self.log.run_start()
        if not self.epochs:
            self.log.block_start(start.epoch, 1, start.samples)
            return
        self._block_start(start.start_step, start.samples)
        self.log.epoch_start(start.start_step // self.spe + 1, start.samples)

    def on_step(self, record: StepRecord) -> None:
        if not self.epochs or record.step % self.spe:
            return
        epoch = record.step // self.spe
        self.log.epoch_stop(epoch, record.samples)
        # the next epoch starts here unless an evaluation (its block_start) or the end comes first
        if not (self._eval_due(record.step) or record.stop):
            self.log.epoch_start(epoch + 1, record.samples)

    def on_eval_start(self, at: EvalStart) -> None:
        if not self.epochs:
            self.log.block_stop(at.epoch, at.samples)
            self.log.eval_start(at.epoch, at.samples)
            return
        self.log.block_stop(self.block_first, at.samples)
        self.log.eval_start(self._epoch_of_step(at.step), at.samples)

    def on_eval(self, record: EvalRecord) -> None:
        epoch = self._epoch_of_step(record.step) if self.epochs else record.epoch
        self.log.eval_accuracy(record.value, epoch, record.samples)
        self.log.eval_stop(epoch, record.samples)
        if not record.continues:
            return
        if not self.epochs:
            self.log.block_start(record.epoch, 1, record.samples)
            return
        self._block_start(record.step, record.samples)
        if record.step % self.spe == 0:  # an evaluation at an epoch's end: the next one starts
            self.log.epoch_start(record.step // self.spe + 1, record.samples)

    def on_run_stop(self, stop: RunStop) -> None:
        dataset = self.epochs and self.train_set_size is not None
        self.log.train_samples(self.train_set_size if dataset else stop.samples)
        self.log.eval_samples(stop.eval_samples)
        self.log.run_stop("success" if stop.status == "success" else "aborted", stop.samples)
        self.log.close()  # the attempt's segment is complete


class MetricsObserver(Observer):
    """Rank 0's metrics file and sinks (scaleout/telemetry/metrics.py)."""

    def __init__(self, cfg: Config, world: World, out: Path, config_file: str):
        self.cfg, self.world, self.out, self.config_file = cfg, world, out, config_file
        self.metrics = Metrics(
            out,
            cfg.train.metrics,
            cfg.train.log_every,
            enabled=world.rank == 0,
            config=cfg.model_dump(mode="json"),
        )
        # the stragglers and spread of the steps since the last record written
        self.window = SkewTracker(
            world.node_of,
            cfg.train.straggler_threshold,
            compute_timing=compute_timing(world.device, cfg.model.cuda_graphs),
        )

    def on_run_start(self, start: RunStart) -> None:
        w = self.world
        self.metrics.start(
            world_size=w.world_size,
            nodes=w.num_nodes,
            ranks_per_node=w.local_size,
            launcher=w.launcher,
            config=self.config_file,
            arch=self.cfg.model.arch,
            start_step=start.start_step,
            global_batch=self.cfg.train.global_batch,
        )

    def on_step(self, record: StepRecord) -> None:
        self.window.add(
            record.skew, record.seconds if record.skew_seconds is None else record.skew_seconds
        )
        if self.metrics.step(record, self.window.report if record.skew is not None else None):
            self.window.reset()

    def on_eval(self, record: EvalRecord) -> None:
        self.metrics.eval(record)

    def on_run_end(self, end: RunEnd) -> None:
        png = self.metrics.close(end.status, time_to_train_s=end.time_to_train_s)
        if png is not None:
            print0(f"metrics: {self.out / 'metrics.jsonl'}, curves {png}", rank=self.world.rank)


class ProgressObserver(Observer):
    """Rank 0's progress line (scaleout/train/progress.py), when ``train.progress`` is set."""

    def __init__(self, cfg: Config, world: World):
        self.total, self.enabled = cfg.train.max_steps, cfg.train.progress and world.rank == 0
        self.bar: Progress | None = None
        self.metric = ""  # the last evaluation, for the line

    def on_run_start(self, start: RunStart) -> None:
        self.bar = Progress(self.total, self.enabled, start.start_step)

    def on_step(self, record: StepRecord) -> None:
        if self.bar is not None:
            self.bar.update(record.step - 1, record.loss, record.samples_per_s, self.metric)

    def on_eval(self, record: EvalRecord) -> None:
        self.metric = f"{record.metric} {record.value:.4f}"

    def on_run_stop(self, stop: RunStop) -> None:
        if self.bar is not None:
            self.bar.close()


class ConsoleObserver(Observer):
    """The run's one-line messages on rank 0's stdout: skipped steps, stops, evaluations."""

    def __init__(self, rank: int, target: float | None):
        self.rank, self.target = rank, target

    def on_step(self, record: StepRecord) -> None:
        if record.skipped:
            print0(
                f"step {record.step}: non-finite gradients on some rank; "
                "every rank skips this step",
                rank=self.rank,
            )
        if record.stop:
            why = "SIGTERM" if record.terminate else "notice"
            print0(
                f"step {record.step}: preemption ({why}) agreed by every rank: checkpoint and stop",
                rank=self.rank,
            )

    def on_eval(self, record: EvalRecord) -> None:
        print0(
            f"step {record.step}: {record.metric} {record.value:.4f} (target {self.target})",
            rank=self.rank,
        )

    def on_run_stop(self, stop: RunStop) -> None:
        if stop.reason:
            print0(stop.reason, rank=self.rank)


class ProfilerObserver(Observer):
    """``train.profile``: torch.profiler over a schedule of steps (telemetry/profiler.py)."""

    def __init__(self, cfg: Config, out: Path, rank: int):
        self.cfg, self.out, self.rank = cfg, out, rank
        self.profiler: StepProfiler | None = None

    def on_run_start(self, start: RunStart) -> None:
        self.profiler = build_profiler(self.cfg.train.profile, self.out, self.rank)

    def on_step(self, record: StepRecord) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def on_run_end(self, end: RunEnd) -> None:
        traces = self.profiler.close() if self.profiler is not None else []
        if traces:
            print0(
                f"profile: traces in {traces[0].parent} (Perfetto, TensorBoard, HTA)",
                rank=self.rank,
            )


def peak_rss_mib(world: World, terminating: bool) -> float | None:
    """Peak resident memory of the most hungry rank process (ru_maxrss, KiB on Linux), in MiB;
    None when a peer may be gone (a SIGTERM is pending), since it is a collective."""
    peak = torch.tensor(
        [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64
    )
    if world.world_size > 1:
        if terminating:
            return None
        peak = peak.to(world.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak.item())


class ReportWriter(Observer):
    """The run's RunReport: rank 0 prints it and writes ``report.json``. ``on_run_end`` is a
    collective (peak memory, MAX over ranks), so every rank holds one; the trainer returns
    ``report``."""

    def __init__(
        self,
        cfg: Config,
        world: World,
        out: Path,
        timers: Timers,
        quality_exponent: float | None,
        task_info: Any,
        skew: SkewTracker | None = None,
    ):
        self.cfg, self.world, self.out, self.timers = cfg, world, out, timers
        self.quality_exponent, self.task_info = quality_exponent, task_info
        self.skew = skew  # the trainer's: stragglers and the per-phase spread over the ranks
        self.report: RunReport | None = None

    def on_run_end(self, end: RunEnd) -> None:
        cfg, world, timers, run = self.cfg, self.world, self.timers, end.this_run
        peak = device_peak(
            world.device, cfg.train.precision, cfg.train.peak_flops, ranks_on_host=world.local_size
        )
        self.report = report = RunReport(
            arch=cfg.model.arch,
            time_to_train_s=max(end.time_to_train_s, 1e-9),
            steps=run.steps,
            samples=run.samples,
            # counted per micro-batch from what ran (MicroBatch.flops)
            flops_per_sample=run.flops / max(run.samples, 1),
            devices=world.world_size,
            real_tokens=run.tokens,
            achieved=end.metric,
            target=cfg.train.target,
            hpcai500_target=cfg.hpcai500.target if cfg.hpcai500 is not None else None,
            quality_exponent=self.quality_exponent,
            device_name=peak.name,
            peak_flops_per_device=peak.flops,
            peak_source=peak.source,
            breakdown_s=timers.mean(),
        )
        # The fraction of step time spent waiting for data, over the steps the timers sampled.
        data_wait = timers.mean().get("data", 0.0) / max(timers.mean_step(), 1e-12)
        peak_rss = peak_rss_mib(world, end.terminating)  # a collective unless a peer may be gone
        if world.rank != 0:
            return
        timed = end.timed
        print(report.render(), flush=True)
        if end.sections.get("untimed_start"):
            print(describe_start(end.sections["untimed_start"], end.time_to_train_s), flush=True)
        print(
            f"data wait: {timers.mean().get('data', 0.0) * 1e3:.2f} ms per step = {data_wait:.1%} "
            "of "
            f"step time (data.num_workers={cfg.data.num_workers})",
            flush=True,
        )
        plain = timed.seconds / max(timed.steps, 1)
        print(
            f"step time: {plain * 1e3:.2f} ms plain (every timed step); breakdown sampled on "
            f"{timers.steps} steps (train.timing_every={timers.every}), "
            f"{timers.mean_step() * 1e3:.2f} ms each",
            flush=True,
        )
        skew = self.skew.report() if self.skew is not None else {}
        for s in skew.get("stragglers", [])[:5]:
            print(
                f"straggler: rank {s['rank']} (node {s['node']}) {s['phase']}: "
                f"{s['slowdown']:.2f}x the median (+{s['excess_s'] * 1e3:.1f} ms) "
                f"on {s['steps']} steps",
                flush=True,
            )
        for s in skew.get("slow_devices", [])[:5]:
            print(
                f"slow device: rank {s['rank']} (node {s['node']}): its own forward + backward "
                f"({s['timing']}-timed) {s['slowdown']:.2f}x the median on {s['steps']} steps",
                flush=True,
            )
        self._quarantine(skew)
        payload = {
            **report.to_dict(),
            "skipped_steps": end.skipped,
            "weights_consistent": end.weights_consistent,
            "odd_ranks": end.odd_ranks,
            "resumed_from_step": end.resumed_from,
            "run_id": end.run_id,
            "data_wait_fraction": data_wait,
            "peak_rss_mib_per_rank_max": peak_rss,
            # breakdown_s: means over the sampled steps (they synchronise the device per phase);
            # timed.step_s: every timed step, uninstrumented
            "breakdown_sampling": {
                "every": timers.every,
                "steps": timers.steps,
                "step_s": timers.mean_step(),
            },
            "status": end.status,
            "goodput": end.goodput,
            "task": self.task_info,
            "timed": {
                "steps": timed.steps,
                "samples": timed.samples,
                "tokens": timed.tokens,
                "seconds": timed.seconds,
                "skipped_warmup_steps": cfg.train.timing_skip_steps,
                "samples_per_s": timed.samples / max(timed.seconds, 1e-12),
                "step_s": timed.seconds / max(timed.steps, 1),
            },
            **skew,  # "stragglers" and "spread" (scaleout/train/skew.py)
            **({"comm_auto": end.comm_auto} if end.comm_auto is not None else {}),
            **end.sections,
        }
        atomic_write(self.out / "report.json", json.dumps(payload, indent=2, default=str).encode())
        print(
            verdict(
                end.status, end.metric, cfg.train.target, report.steps, end.time_to_train_s,
                str(self.out), cfg.model.family.metric_goal,
            ),
            flush=True,
        )  # fmt: skip

    def _quarantine(self, skew: dict[str, Any]) -> None:
        """Rank 0: the nodes of persistent stragglers (scaleout/train/skew.py
        ``quarantine_verdicts``) go to ``<train.output_dir>/quarantine.json`` as verdicts of
        source ``straggler`` (scaleout/goodput/quarantine.py; the Slurm supervisor reads the file
        before its
        next start). A file that cannot be written is a warning, not a failure."""
        names = self.skew.node_names if self.skew is not None else []
        verdicts = quarantine_verdicts(skew, names)
        if not verdicts:
            return
        path = quarantine.path_for(self.out)
        try:
            quarantine.record(path, verdicts, "straggler")
        except (OSError, UserError) as exc:
            print(f"WARNING: straggler verdicts not quarantined: {exc}", flush=True)
            return
        for host, reason in verdicts:
            print(f"quarantine: {host}: {reason} (in {path})", flush=True)
