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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scaleout.log import print0
from scaleout.train.faults import agree, grads_finite, injected_nan
from scaleout.train.progress import Progress
from scaleout.train.tasks import Task, build_task, steps_per_epoch

log = logging.getLogger("scaleout.train")


@dataclass
class TrainResult:
    status: str  # "success" (target reached), "max_steps", "preempted", "aborted"
    exit_code: int
    steps: int
    metric: float | None
    report: Any = None


class Trainer:
    def __init__(self, cfg: Any, world: Any, config_file: str = "config.yaml"):
        from scaleout.checkpoint import Checkpointer
        from scaleout.mlperf import MLPerfLogger
        from scaleout.timers import Timers

        self.cfg, self.world, self.config_file = cfg, world, config_file
        self.out = Path(cfg.train.output_dir)
        if world.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
        self.mll = MLPerfLogger(self.out / "mlperf.log" if world.rank == 0 else None, rank=world.rank)
        self.ckpt = Checkpointer(cfg.checkpoint.dir, cfg.checkpoint.keep, world.rank) if cfg.checkpoint.dir else None
        self.timers = Timers(world.device)
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
        self.mll.submission(self.task.benchmark)
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
                                      rebuild_buckets=not cfg.train.deterministic,
                                      **{k: v for k, v in (("x", cfg.comm.torus_x), ("y", cfg.comm.torus_y)) if v})
        from scaleout.train.capture import build_step_graphs

        self.graphs = build_step_graphs(cfg, world, self.model, self.task)  # None unless CUDA + model.cuda_graphs
        self.prefetcher: Any = None  # set by run() once the start step is known (scaleout/train/prefetch.py)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(model, cfg.optim, world)
        self.schedule = build_schedule(self.optimizer, cfg.optim)
        if cfg.comm.comm_nice:  # CPU/gloo: communication threads ahead of compute (after groups exist)
            world.prioritize_communication(cfg.comm.comm_nice)
        from scaleout.mlperf import hyperparameters

        self.mll.hyperparameters(hyperparameters(cfg, world.world_size, self.config_file,
                                                 steps_per_epoch(self.task, cfg.train.global_batch)))

    # -- checkpoints ----------------------------------------------------------------------------------
    def _state(self, step: int) -> dict[str, Any]:
        import torch.distributed as dist

        from scaleout.checkpoint import gather_rng_states

        opt_state: Any = self.optimizer.state_dict()
        if self.sharded and self.world.world_size > 1:  # every rank holds a different shard
            gathered: list[Any] = [None] * self.world.world_size
            dist.all_gather_object(gathered, opt_state)
            opt_state = gathered
        return {"model": self.task.model.state_dict(), "optimizer": opt_state,
                "schedule": self.schedule.state_dict(), "data_position": step * self.cfg.train.global_batch,
                "rng": gather_rng_states(self.world), "samples": self.samples, "skipped": self.skipped}

    def save(self, step: int) -> None:
        if self.ckpt is None:
            return
        state = self._state(step)  # collective: every rank takes part
        path = self.ckpt.save(step, state)
        if path is not None:
            print0(f"checkpoint: step {step} -> {path}", rank=self.world.rank)
        self.world.barrier()

    def resume(self) -> int:
        from scaleout.checkpoint import set_rng_state

        if self.ckpt is None or not self.cfg.checkpoint.resume:
            return 0
        found = self.ckpt.load_latest()
        if found is None:
            return 0
        state, path = found
        self.task.model.load_state_dict(state["model"])
        opt = state["optimizer"]
        self.optimizer.load_state_dict(opt[self.world.rank] if self.sharded and isinstance(opt, list) else opt)
        self.schedule.load_state_dict(state["schedule"])
        rng = state["rng"]
        if len(rng) != self.world.world_size:
            log.warning("checkpoint %s has RNG states of %d ranks, this run has %d: RNG streams restart",
                        path, len(rng), self.world.world_size)
        else:
            set_rng_state(rng[self.world.rank])
        self.samples, self.skipped = int(state.get("samples", 0)), int(state.get("skipped", 0))
        print0(f"resumed from {path} at step {state['step']}", rank=self.world.rank)
        return int(state["step"])

    # -- the loop -------------------------------------------------------------------------------------
    def train_step(self, step: int) -> tuple[float, bool, bool]:
        """One optimizer step (grad_accum micro-batches). Returns (loss, skipped, stop requested)."""
        cfg, t = self.cfg, self.timers
        with t("data"):  # with a prefetcher: only the time spent *waiting* for it (scaleout/train/prefetch.py)
            if self.prefetcher is not None:
                mbs = self.prefetcher.get(step)
            else:
                mbs = self.task.micro_batches(step * cfg.train.global_batch, cfg.train.grad_accum)
        total = 0.0
        if self.graphs is not None:  # forward + backward + all-reduce as one CUDA graph per shape (capture.py)
            with t("graph"):
                total = float(self.graphs(mbs))
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
                with t("forward"):
                    loss = self.task.loss(self.model, mb) / len(mbs)
                with t("backward"):
                    loss.backward()
            total += float(loss.detach())
        if not self.sharded and self.graphs is None:
            t.add("exposed_comm", float(self.model.last_stats.get("exposed_s", 0.0)))
            t.current["backward"] = t.current.get("backward", 0.0) - float(self.model.last_stats.get("exposed_s", 0.0))
        if injected_nan(step, self.world.rank):
            self.params[0].grad.view(-1)[0] = float("nan")
        flags = agree(self.world, nonfinite=not grads_finite(self.params), stop=self.guard.requested)
        if flags.skip:
            self.skipped += 1
            print0(f"step {step + 1}: non-finite gradients on some rank; every rank skips this step", rank=self.world.rank)
        else:
            with t("optimizer"):
                self.optimizer.step()
            self.schedule.step()
        self.optimizer.zero_grad(set_to_none=not hasattr(self.model, "no_sync") or self.sharded)
        return total, flags.skip, flags.stop

    def run(self) -> TrainResult:
        from scaleout import preempt

        cfg, world, mll = self.cfg, self.world, self.mll
        self.samples, self.skipped = 0, 0
        self.build()
        start = self.resume()
        from scaleout.train.prefetch import build_prefetcher

        self.prefetcher = build_prefetcher(cfg, self.task, world, start)  # None when data.num_workers=0
        self.guard = preempt.install()
        mll.init_stop()
        world.barrier()
        mll.run_start()
        self._observe_start(start)
        t_start = time.perf_counter()
        is_bert = self.task.benchmark == "bert"
        epoch_of = (lambda s: s) if is_bert else (lambda s: s // max(self.task.rows, 1))  # BERT: samples
        max_steps, metric, status = cfg.train.max_steps, None, "max_steps"
        progress = Progress(max_steps, cfg.train.progress and world.rank == 0, start)
        mll.block_start(epoch_of(self.samples), 1, self.samples)
        tokens = 0
        samples_at_start = self.samples  # a resumed run reports its own samples, not the checkpoint's
        step = start
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
            if step >= start + skip:
                for k, v in (("steps", 1), ("samples", n), ("tokens", toks), ("seconds", time.perf_counter() - t0)):
                    self.timed[k] += v
            spans = self.timers.step()
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
                self.save(step + 1)
                status = "preempted"
                break
            done = step + 1 == max_steps
            if (step + 1) % cfg.train.eval_every == 0 or done:
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
        if not self.guard.terminating:  # under SIGTERM peers may be gone: no collective
            world.barrier()
        ttt = time.perf_counter() - t_start
        mll.train_samples(self.samples)
        mll.eval_samples(len(getattr(self.task, "eval_seqs", [])) or len(getattr(self.task, "eval_idx", [])))
        mll.run_stop("success" if status == "success" else "aborted", self.samples)
        steps_done = step + 1 - start
        self.status = status
        every = cfg.checkpoint.every_steps
        already = status == "max_steps" and every and (step + 1) % every == 0  # saved inside the loop
        if status in ("success", "max_steps") and self.ckpt is not None and not already:
            self.save(step + 1)
        consistent = self._weights_consistent() if not self.guard.terminating else None
        report = self._report(ttt, steps_done, self.samples - samples_at_start, tokens, metric, consistent)
        self._observe_end(status, ttt)
        self.guard.uninstall()
        if status == "preempted":
            if self.guard.wants_requeue and world.rank == 0:
                preempt.requeue()
            return TrainResult(status, preempt.EXIT_PREEMPTED, step + 1, metric, report)
        return TrainResult(status, 0, step + 1, metric, report)

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

    def _report(
        self, ttt: float, steps: int, samples: int, tokens: int, metric: float | None, consistent: bool | None
    ) -> Any:
        from scaleout.report import QUALITY_EXPONENT, RunReport, device_peak_flops

        cfg, world = self.cfg, self.world
        mean_tokens = tokens / max(samples, 1) if tokens else 0.0
        name, peak = device_peak_flops(world.device)
        report = RunReport(
            arch=cfg.model.arch, time_to_train_s=max(ttt, 1e-9), steps=steps, samples=samples,
            flops_per_sample=self.task.flops_per_sample(mean_tokens) if mean_tokens or not tokens else 0.0,
            devices=world.world_size, real_tokens=tokens, achieved=metric, target=cfg.train.target,
            quality_exponent=QUALITY_EXPONENT.get(self.task.benchmark), device_name=name,
            peak_flops_per_device=peak, breakdown_s=self.timers.mean(),
        )
        # The fraction of step time spent waiting for data (issue 10 item 5): same steps as the timers.
        data_wait = self.timers.totals.get("data", 0.0) / max(self.timed["seconds"], 1e-12)
        if world.rank == 0:
            print(report.render(), flush=True)
            print(f"data wait: {self.timers.mean().get('data', 0.0) * 1e3:.2f} ms per step = {data_wait:.1%} of step time "
                  f"(data.num_workers={cfg.data.num_workers})", flush=True)
            if consistent is False:
                print("WARNING: model replicas differ between ranks at the end of the run", flush=True)
            payload = {**report.to_dict(), "skipped_steps": self.skipped, "weights_consistent": consistent,
                       "data_wait_fraction": data_wait,
                       "status": self.status, "task": getattr(self.task, "info", {}),
                       "timed": {**self.timed, "skipped_warmup_steps": cfg.train.timing_skip_steps,
                                 "samples_per_s": self.timed["samples"] / max(self.timed["seconds"], 1e-12),
                                 "step_s": self.timed["seconds"] / max(self.timed["steps"], 1)}}
            (self.out / "report.json").write_text(json.dumps(payload, indent=2, default=str))
        return report


def run_training(cfg: Any, config_file: str = "config.yaml") -> TrainResult:
    """Entry point inside every rank (``scaleout train``)."""
    import scaleout

    world = scaleout.init(cfg)
    try:
        cfg.check_world(world.world_size, world.local_size)
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))))
        return Trainer(cfg, world, config_file).run()
    finally:
        world.close()
