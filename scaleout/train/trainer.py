"""The trainer: World -> task (model + data) -> gradient sync -> optimizer + schedule -> steps with
evaluation to the target -> MLPerf log, checkpoints, report.

Everything a trainer holds is declared on the class below, in five groups, and built in
``__init__``. The methods read in the order they run: ``train()`` -> ``run_step()`` ->
``train_step()`` -> ``forward_backward()``, then evaluation, checkpoints (``state_dict()`` /
``load_state_dict()`` are what a checkpoint holds) and the end of the run. The trainer asks
interfaces instead of modes: the task (scaleout/families/task.py) for everything about the model
family, the gradient sync (scaleout/parallel/sync.py: DataParallel or the sharded optimizer) for
everything about communication and optimizer state, its save schedule
(scaleout/checkpoint_schedule.py) when to save, and its observers (scaleout/train/observe.py) for
everything it reports. Time-to-train is MLPerf's: run_start (after init, all ranks at a barrier)
-> run_stop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from scaleout.checkpoint import Checkpointer
from scaleout.checkpoint_schedule import SaveSchedule
from scaleout.comm.handles import prioritize_communication
from scaleout.comm.phasetime import CLOCK
from scaleout.config.schema import Config
from scaleout.data.batches import MicroBatch
from scaleout.env.nodelist import link_record, node_names
from scaleout.errors import UserError
from scaleout.goodput import preempt
from scaleout.log import print0
from scaleout.optim import build_optimizer, build_schedule
from scaleout.optim.warmup import warm_up
from scaleout.parallel import DataParallel
from scaleout.parallel.buckets import fold
from scaleout.parallel.data_parallel import broadcast_from_rank0
from scaleout.parallel.sync import GradientSync
from scaleout.store_share import share
from scaleout.telemetry.mlperf import MLPerfLogger
from scaleout.telemetry.report import RunReport, goodput_section
from scaleout.telemetry.startup import StartClock
from scaleout.telemetry.timers import Timers
from scaleout.train import hangwatch, prefetch, replicas, rerun
from scaleout.train.agreement import (
    HEAD,
    LOSS,
    PendingAgreement,
    StepFlags,
    agreement_size,
    nonfinite,
    stage_agreement,
    start_agreement,
)
from scaleout.train.capture import StepGraphs, build_step_graphs, compile_model
from scaleout.train.devicetime import ComputeClock, compute_timing
from scaleout.train.faults import (
    EXIT_ABORTED,
    Injections,
    exit_on_comm_failure,
    is_comm_failure,
    write_crash,
    write_replica_vote,
)
from scaleout.train.gcpolicy import GcPolicy
from scaleout.train.hparams import hyperparameters
from scaleout.train.inputs import check_input_files
from scaleout.train.liveness import Heartbeat, Progress, period_for
from scaleout.train.observe import (
    EvalRecord,
    EvalStart,
    InitEnd,
    Observer,
    RunEnd,
    RunStart,
    RunStatus,
    RunStop,
    StepRecord,
    Throughput,
    eval_due,
)
from scaleout.train.observers import (
    ConsoleObserver,
    MetricsObserver,
    MLPerfObserver,
    ProfilerObserver,
    ProgressObserver,
    ReportWriter,
)
from scaleout.train.rerun import check_data_position
from scaleout.train.resume_check import load_or_explain
from scaleout.train.rng import seed_step
from scaleout.train.rundirs import agree_owner, say_disk_full
from scaleout.train.skew import PHASES, SkewTracker, link_credit
from scaleout.train.task import Task, build_task
from scaleout.world import World, init

log = logging.getLogger("scaleout.train")


def check_fixed_epochs(cfg: Config, steps_per_epoch: int) -> None:
    """hpcai500.epochs (HPC-AI500's fixed-epoch protocol): train.max_steps must be exactly that
    many epochs of ``steps_per_epoch`` steps."""
    h = cfg.hpcai500
    if h is not None and h.epochs is not None and cfg.train.max_steps != h.epochs * steps_per_epoch:
        raise UserError(
            f"hpcai500.epochs={h.epochs} needs train.max_steps={h.epochs * steps_per_epoch} "
            f"({steps_per_epoch} steps per epoch), got train.max_steps={cfg.train.max_steps}"
        )


@dataclass
class TrainResult:
    """What ``Trainer.train`` / ``run_training`` return."""

    status: RunStatus
    exit_code: int
    steps: int  # steps done in total (the last step's index + 1)
    metric: float | None  # the last evaluation's value
    report: RunReport | None = None


class Trainer:
    """Data-parallel training of one config in this rank. ``Trainer(cfg, world).train()``."""

    # -- configs
    # ----------------------------------------------------------------------------------------
    cfg: Config
    world: World
    config_file: str  # the config's name, for the MLPerf log and the metrics header
    start_info: rerun.RunStart  # new, resume or finished (the rerun policy, train/rerun.py)
    out: Path  # train.output_dir
    started_unix: float  # goodput's wall clock starts here: the process's start, else __init__'s

    # -- swappable components (built from the config)
    # -----------------------------------------------
    task: Task  # the model family: model, data, loss, evaluation (families/task.py)
    model: torch.nn.Module  # DataParallel around the task's model, or the model itself when sharded
    optimizer: torch.optim.Optimizer
    sync: GradientSync  # who averages the gradients: DataParallel or the sharded optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    graphs: StepGraphs | None  # CUDA graphs of the step (model.cuda_graphs), else None
    step_in_graph: bool  # the graphs hold the optimizer's step (the sharded LAMB)
    prefetcher: prefetch.Prefetcher | None  # data in worker processes (data.num_workers > 0)

    # -- runtime utilities
    # --------------------------------------------------------------------------
    checkpointer: Checkpointer | None  # None without checkpoint.dir
    saves: SaveSchedule | None  # when to save (checkpoint.every_steps); None without checkpoint.dir
    timers: Timers  # the sampled step-time breakdown (train.timing_every)
    mlperf_log: MLPerfLogger
    report_writer: ReportWriter  # also an observer; holds the RunReport train() returns
    observers: list[Observer]  # every reporting channel, called in order (train/observe.py)
    injections: Injections  # test-only faults from their variables; none in a real run
    skew: SkewTracker  # stragglers and per-phase spread over the ranks (train/skew.py)
    compute_clock: ComputeClock  # this rank's own forward + backward, on the device (a step late)
    # False: the step's agreement carries its flags only, no phase times nor fingerprint
    # (`scaleout bench agreement` measures what they cost); the same on every rank
    attribution: bool
    # inter_allreduce x each rank's link credit names a slow link (train/skew.py), None: equal or
    # unknown link rates (a world-sized tensor on the device)
    link_credit: torch.Tensor | None
    progress: Progress  # where this rank is, for the heartbeat (phase marks: _at)
    preemption: preempt.Preemption | None  # signal handlers; train() installs them if None
    owns_preemption_handlers: bool  # train() installed them, so it removes them
    params: list[torch.nn.Parameter]  # those that require grad
    autocomm: Any  # comm.algorithm=auto's tuner (scaleout/parallel/autotune.py AutoComm), else None
    # the step's agreement is armed before the last backward (riding in the last bucket, or its
    # own all-reduce hidden by backward; a CUDA-graph step: inside the graph)

    # -- training state (checkpointed: state_dict)
    # ------------------------------------------------------
    step: int  # steps done (the next step's index)
    samples: int  # samples trained, over every run of this training
    skipped: int  # steps skipped (non-finite gradients), over every run

    # -- this run (not checkpointed)
    # ----------------------------------------------------------------
    start_step: int  # the step this run started from (a resumed run: its checkpoint's)
    resumed_from: int | None
    resumed_path: Path | None  # the checkpoint this run resumed from
    lost: dict[str, float]  # goodput's lost seconds: save_stall_s, evaluation_s, startup_s
    losses: list[float | None]  # mean loss over ranks of every step this run took
    metric: float | None  # the last evaluation's value
    flags: StepFlags  # the last step's agreed flags: the end of the run follows them
    consecutive_skips: int  # steps skipped in a row (train.max_consecutive_skips)
    this_run: Throughput  # every step of this run
    timed: Throughput  # the steps after train.timing_skip_steps (used by `scaleout sweep`)
    run_record: dict[str, Any]  # run.json's record (rank 0; {} elsewhere)
    _optimizer_s: float  # the last optimizer step's seconds (the next agreement sends them)
    # (step, its micro-batches) built in the last backward's wire wait (_build_ahead)
    _next_batches: tuple[int, list[MicroBatch]] | None
    _agreement: PendingAgreement | None  # armed for this eager step before its last backward
    # a graphed step's agreement (_stage_in_graph, _arm_in_graph): the device buffer the graph
    # all-reduces, the pinned host buffer it copies from, and what reads it (phases sent, with
    # skew, fingerprint, the collectives in words)
    _graph_flags: torch.Tensor | None
    _graph_host: torch.Tensor | None
    _graph_meta: tuple[bool, bool, int, str] | None
    # the last step's phase times and seconds: they ride in the next step's agreement (this step's
    # are complete only after its gradients arrived)
    _lagged: tuple[list[float], float] | None
    _skew_seconds: float | None  # the seconds of the step whose skew the last agreement carried
    # the untimed start (report.json untimed_start): its phase marks, MLPerf's init_start, the split
    start_clock: StartClock
    init_start_unix: float
    untimed_start: dict[str, Any] | None
    gc: GcPolicy  # Python's collector: frozen after set-up, collected only at boundaries

    def __init__(
        self,
        cfg: Config,
        world: World,
        config_file: str = "config.yaml",
        start: rerun.RunStart | None = None,
        preemption: preempt.Preemption | None = None,
        progress: Progress | None = None,
        started: float | None = None,
        start_clock: StartClock | None = None,
    ):
        # the wall clock of goodput starts here: the process's start (run_training), else now
        self.started_unix = started if started is not None else time.time()
        # the untimed start's phases (report.json untimed_start); marks are wall-clock reads
        self.start_clock = start_clock or StartClock(self.started_unix)
        self.untimed_start = None  # set at run_start
        self.gc = GcPolicy()  # collections only at evaluation/checkpoint boundaries
        # configs
        self.cfg, self.world, self.config_file = cfg, world, config_file
        self.start_info = start if start is not None else rerun.decide_start(cfg)
        self.out = Path(cfg.train.output_dir)
        self._prepare_output_dir()

        # runtime utilities; the MLPerf log first: its initialization starts here
        kind = self.start_info.kind
        writes = world.rank == 0 and kind != "finished"  # a finished run's log stays as it is
        # A resumed run appends: every attempt of a requeued or resubmitted run adds its own
        # init_start..run_stop segment (scaleout.telemetry.mlperf.split_attempts); none erases an
        # earlier one.
        self.mlperf_log = MLPerfLogger(
            self.out / "mlperf.log" if writes else None, rank=world.rank, stdout=cfg.mlperf.stdout
        )
        mlperf_observer = MLPerfObserver(self.mlperf_log, cfg, world)
        self.init_start_unix = time.time()
        self.checkpointer = (
            Checkpointer(
                cfg.checkpoint.dir,
                cfg.checkpoint.keep,
                world.rank,
                asynchronous=cfg.checkpoint.async_,
            )
            if cfg.checkpoint.dir
            else None
        )
        self.resumed_path = None
        self.lost = {"save_stall_s": 0.0, "evaluation_s": 0.0, "startup_s": 0.0}
        self.timers = Timers(world.device, every=cfg.train.timing_every)
        self.preemption = preemption
        self.owns_preemption_handlers = preemption is None
        self.injections = Injections.from_env(world.rank)
        # the heartbeat's (run_training), or one nobody reads; phase marks are attribute writes
        self.progress = progress if progress is not None else Progress()
        self.compute_clock = ComputeClock(torch.device(world.device))
        self.skew = SkewTracker(
            world.node_of,
            cfg.train.straggler_threshold,
            compute_timing=compute_timing(world.device, cfg.model.cuda_graphs),
        )
        self.attribution = True
        self._optimizer_s = 0.0
        self._next_batches = None

        # swappable components
        torch.manual_seed(cfg.train.seed)  # same init everywhere; rank 0's weights are broadcast
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True)
        self.task = build_task(cfg, world)
        model = self.task.model
        if (
            cfg.model.compile
        ):  # in place, before wrapping: the reducer's hooks stay on the parameters
            compile_model(model)
        self.start_clock.mark("model_and_data")
        if cfg.optim.sharded:  # the sharded optimizer owns its reduce-scatter / all-gather
            broadcast_from_rank0(list(model.parameters()) + list(model.buffers()), world)
            self.model = model
        else:
            self.model = DataParallel.from_config(
                model,
                world,
                cfg.comm,
                # re-bucketing after step 1 changes summation order; a resumed run would re-bucket
                # at a different step, so deterministic runs keep the initial layout (bitwise
                # resume)
                rebuild_buckets=not cfg.train.deterministic,
                defer_unused=True,  # unused parameters are read with the step's agreement
                # the step's agreement rides in the last bucket (uncompressed wire; see below)
                rider=agreement_size(world.world_size, self.attribution),
            )
        self.autocomm = None
        if cfg.comm.auto and world.world_size > 1:  # one rank: nothing to all-reduce, flat stays
            from scaleout.parallel.autotune import AutoComm  # deferred: sim + scipy only for auto

            self.autocomm = AutoComm(self.model, cfg.comm, world)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(
            model, cfg.optim, world, cfg.comm, no_decay=self.task.family.no_decay
        )
        # the sharded LAMB's graphs hold its step too (capture.py): built after it
        self.graphs = build_step_graphs(
            cfg, world, self.model, self.task, self.optimizer, arm=self._arm_in_graph
        )
        # whether the captured step holds the optimizer's step (it then settles after the agreement)
        self.step_in_graph = self.graphs is not None and cfg.optim.sharded
        # Who averages the gradients, and so owns the optimizer state's layout: the one mode
        # decision.
        self.sync = self.optimizer if cfg.optim.sharded else self.model
        self.link_credit = self._exchange_links()
        # The step's agreement rides in the last gradient bucket (the reducer's rider, when the
        # wire is uncompressed), else goes out as its own small all-reduce before backward, which
        # hides it: no round trip of its own after the gradients (on a busy host each hop of a
        # small ring waits for a peer's thread to be scheduled: `scaleout bench framework`
        # measured it at ~6 % of a step on 2 x 2 ranks sharing 2 cores). "Non-finite" is then
        # decided from the reduced gradients without a collective of its own: the replicated
        # path's ranks hold the same ones and each reads them alike; the sharded LAMB's ranks hold
        # their own shards, and it sums their non-finite counts in the norm all-reduce its step
        # makes anyway, skipping on every rank alike (ShardedLAMB.skipped). A CUDA-graph step
        # carries it inside the graph instead: the host stages its values before each run of the
        # step, the graph copies them up, adds the loss and all-reduces them before the last
        # backward, and the trainer reads the result after the replay (_stage_in_graph,
        # _arm_in_graph). A rank whose reduced gradients alone are non-finite skips alone: the
        # steps skipped so far ride in the fingerprint, so the next agreement names it.
        self._agreement = None
        # the graphed step's agreement: its device buffer (a static input of the graphs), the
        # host buffer it is copied from, and what reads it (_stage_in_graph)
        self._graph_flags = (
            torch.zeros(
                agreement_size(world.world_size, self.attribution),
                dtype=torch.float32,
                device=world.device,
            )
            if self.graphs is not None
            else None
        )
        self._graph_host, self._graph_meta = None, None
        self._lagged, self._skew_seconds = None, None
        self.progress.watch(self.sync)  # its collectives issued, and its wait as "grad-sync"
        self.schedule = build_schedule(self.optimizer, cfg.optim)
        if cfg.comm.comm_nice:  # CPU/gloo: communication threads ahead of compute (after groups)
            prioritize_communication(world, cfg.comm.comm_nice)

        # training state, then the checkpoint's over it
        self.start_clock.mark("communicators")
        self.step, self.samples, self.skipped = 0, 0, 0
        self.start_step = self.resume()
        self.start_clock.mark("checkpoint")
        self.resumed_from = self.start_step or None
        self.saves = (
            SaveSchedule(
                self.checkpointer,
                world,
                cfg.checkpoint.every_steps,
                cfg.checkpoint.mtbf_h,
                settle_timeout_s=cfg.train.init_timeout_s,
                start_step=self.start_step,
            )
            if self.checkpointer is not None
            else None
        )

        # this run
        self.losses, self.metric = [], None
        self.flags = StepFlags(skip=False, stop=False)
        self.consecutive_skips = 0
        self.this_run, self.timed = Throughput(), Throughput()
        self.run_record = {}
        # None when data.num_workers=0; reads no data until start(), after run_start (MLPerf rules)
        self.prefetcher = prefetch.build_prefetcher(cfg, self.task, world, self.start_step)

        # observers, in the order they are called
        self.report_writer = ReportWriter(
            cfg,
            world,
            self.out,
            self.timers,
            self.task.family.quality_exponent,
            self.task.info,
            skew=self.skew,
        )
        self.observers = [
            mlperf_observer,
            ProgressObserver(cfg, world),
            ConsoleObserver(world.rank, cfg.train.target),
            self.report_writer,
            MetricsObserver(cfg, world, self.out, config_file),
            ProfilerObserver(cfg, self.out, world.rank),
        ]

    def _prepare_output_dir(self) -> None:
        """Rank 0 makes the output directory and sets aside what an earlier run left there."""
        kind = self.start_info.kind
        if self.world.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            if kind == "new":  # an earlier run's log in this directory is kept, not appended to
                rerun.set_aside_earlier(self.out / "mlperf.log")
            if kind != "finished":  # an earlier run's or segment's report is kept
                rerun.set_aside_earlier(self.out / "report.json")

    def _exchange_links(self) -> torch.Tensor | None:
        """Every rank's link rate, summed once into a world-sized vector on the device (each rank
        its own slot: one small all-reduce at start-up), for the link credit that attributes a
        slow link (scaleout/train/skew.py ``link_credit``); and each node's name as doctor names
        it (``scaleout.env.nodelist.node_names``), left in the store by the node's first rank and
        read
        by rank 0 for the stragglers' quarantine verdicts. None on one node."""
        world = self.world
        if world.world_size == 1 or world.num_nodes == 1:
            return None
        me = link_record(world)
        store = dist.distributed_c10d._get_default_store()
        if world.local_rank == 0:
            store.set(f"scaleout/node_name/{me['node']}", json.dumps([me["host"], me["netns"]]))
        rates = torch.zeros(world.world_size)
        rates[world.rank] = me["link_bps"] or 0.0
        rates = rates.to(world.device)
        dist.all_reduce(rates, group=world.group)
        if world.rank == 0:
            names = [
                json.loads(store.get(f"scaleout/node_name/{i}").decode())
                for i in range(world.num_nodes)
            ]
            self.skew.node_names = node_names(
                [{"node": i, "host": h, "netns": n} for i, (h, n) in enumerate(names)]
            )
        credit = link_credit([r or None for r in rates.tolist()])
        if credit is None:
            return None
        return torch.tensor(credit, dtype=torch.float32).to(world.device)

    def resume(self) -> int:
        """Load the latest checkpoint (rank 0 chooses; every rank follows); its step (0: none)."""
        if self.checkpointer is None or not self.cfg.checkpoint.resume:
            return 0
        _, shards = self.sync.optimizer_state(
            self.optimizer
        )  # the sharded pieces are read in place
        found = self.checkpointer.restore(self.world, shards=shards)
        if found is None:
            return 0
        state, path = found
        self.resumed_path = path
        check_data_position(state, self.cfg.train.global_batch, path)  # a changed batch is refused
        # a changed model or optimizer: one line naming what differs, not torch's traceback
        load_or_explain(
            lambda: self.load_state_dict(state), state, self.task.model, path, self.world.rank
        )
        print0(f"resumed from {path} at step {self.step}", rank=self.world.rank)
        return self.step

    # -- the run: train() -> each step (run_step -> train_step -> forward_backward) -> end
    # ------------------------------------------------------------------------------------------
    def train(self) -> TrainResult:
        """Steps until the target, train.max_steps, an agreed preemption or divergence."""
        CLOCK.reset()  # row / column phase times for the agreement (scaleout/comm/phasetime.py)
        CLOCK.enabled = self.world.world_size > 1
        try:
            result = self._train()
            self.sync.wait_params()  # the weights a caller reads after train() are complete
            return result
        finally:  # also when a step raises: the log file is closed, its lines are on disk
            CLOCK.enabled = False
            self.gc.stop()
            self.mlperf_log.close()
            if self.checkpointer is not None:  # a write in flight finishes (the run's end
                error = self.checkpointer.close()  # waited for it unless a step raised)
                if error is not None:
                    log.error("%s", error)

    def _train(self) -> TrainResult:
        if self.start_info.kind == "finished":
            print0(f"scaleout train: {self.start_info.message}", rank=self.world.rank)
            return TrainResult("finished", 0, self.start_info.latest_step, None)
        clock = self._start_clock()
        status: RunStatus = "max_steps"
        reason = ""
        for step in range(self.start_step, self.cfg.train.max_steps):
            end = self.run_step(step)
            if end is not None:
                status, reason = end
                break
        return self._finish(status, reason, clock)

    def _start_clock(self) -> float:
        """The end of initialization: preemption handlers, MLPerf init_stop, a barrier,
        run_start, the first touch of the training data. Returns the clock's start
        (time.perf_counter)."""
        cfg, world = self.cfg, self.world
        if world.rank == 0:
            self.run_record = rerun.record_start(cfg, self.start_info, world.world_size)
        if self.preemption is None:
            self.preemption = preempt.install()
        steps_per_epoch = self.task.steps_per_epoch(cfg.train.global_batch)
        check_fixed_epochs(cfg, steps_per_epoch)
        init_end = InitEnd(
            benchmark=self.task.benchmark,
            hyperparameters=hyperparameters(
                cfg,
                world.world_size,
                self.config_file,
                steps_per_epoch,
                self.task.sequences_per_row,
                world.device,
            ),
            resumed_from=self.resumed_from,
            steps_per_epoch=steps_per_epoch,
            train_set_size=self.task.rows,
        )
        if self.autocomm is not None:  # before run_start: synthetic tensors, no data touched
            probe = self.autocomm.start()
            self.mlperf_log.event(
                "scaleout_comm_probe",
                round(probe.seconds, 3),
                metadata={"algorithms": list(self.autocomm.space.algorithms)},
            )
            print0(
                f"comm.algorithm=auto: probed {', '.join(self.autocomm.space.algorithms)} in "
                f"{probe.seconds:.2f} s",
                rank=world.rank,
            )
        # the one-pass LAMB/LARS kernels compile here, outside the timed region (optim/warmup.py)
        compiled_s = warm_up(self.optimizer)
        if compiled_s is not None:
            self.mlperf_log.event("scaleout_optimizer_compile", round(compiled_s, 3))
        for observer in self.observers:
            observer.on_init_end(init_end)
        self.gc.start()  # set-up's objects frozen; no automatic collection inside a step
        world.barrier()
        clock = time.perf_counter()
        self.lost["startup_s"] = time.time() - self.started_unix
        self.untimed_start = self.start_clock.section(time.time(), self.init_start_unix)
        start = RunStart(self.start_step, self.samples, self.task.epoch_of(self.samples))
        for observer in self.observers:
            observer.on_run_start(start)
        if self.prefetcher is not None:
            self.prefetcher.start()  # the first touch of the training data
        return clock

    def run_step(self, step: int) -> tuple[RunStatus, str] | None:
        """Step ``step`` of the loop (after ``_start_clock``): the training step, its record to
        the observers, the evaluation and save when due. Returns (status, reason) when the run
        ends here, else None. ``scaleout bench framework`` times exactly this against a plain
        DDP loop's step."""
        cfg = self.cfg
        warmup = cfg.train.timing_skip_steps
        if warmup and step == self.start_step + warmup:
            self.timers.reset()  # breakdown_s then covers the timed steps only
        step_samples, step_tokens = self.task.samples_per_step(step * cfg.train.global_batch)
        lr = self.optimizer.param_groups[0]["lr"]  # this step's (train_step moves it)
        t0 = time.perf_counter()
        seed_step(cfg.train.seed, step, self.world.rank)  # a resume needs no RNG state
        try:
            flags = self.train_step(step)
        except torch.OutOfMemoryError as exc:
            raise out_of_memory(exc, cfg, self.world, step) from None
        seconds = time.perf_counter() - t0
        if step == self.start_step:  # from now on a hung peer is a failure, not slowness
            # no main-thread collective while the sharded LAMB's all-gathers are in flight on
            # the comm thread: on one node its row group is the world group, and two threads'
            # collectives on one gloo group can be matched in different orders across ranks
            self.sync.wait_params()
            self.world.set_timeout(cfg.train.step_timeout_s)
        self.step, self.samples = step + 1, self.samples + step_samples
        self.skipped += int(flags.skip)
        self.losses.append(flags.loss)
        skew_s, self._skew_seconds = self._skew_seconds, None  # the lagged skew's own step
        self.skew.add(flags.skew, seconds if skew_s is None else skew_s)
        self.this_run = self.this_run.plus(step_samples, step_tokens, seconds, flags.flops)
        if step >= self.start_step + warmup:
            self.timed = self.timed.plus(step_samples, step_tokens, seconds)
        done = self.step == cfg.train.max_steps
        eval_now = eval_due(self.step, cfg.train.eval_every, cfg.train.eval_start_step) or done
        record = StepRecord(
            step=self.step,
            samples=self.samples,
            loss=flags.loss,
            lr=lr,
            seconds=seconds,
            step_samples=step_samples,
            step_tokens=step_tokens,
            breakdown_s=self.timers.step(seconds),
            skipped=flags.skip,
            stop=flags.stop,
            terminate=flags.terminate,
            flush=flags.stop or done or self.step % cfg.train.eval_every == 0,
            skew=flags.skew,
            skew_seconds=skew_s,
        )
        if self.attribution:
            self._lagged = (self._lagged[0], seconds) if self._lagged else None
        for observer in self.observers:
            observer.on_step(record)
        if self.autocomm is not None and not self.autocomm.done:
            self._tune_comm(seconds)
        if flags.stop:
            self.save_checkpoint()
            return "preempted", ""
        if self._vote_due(done):  # a replica that drifted stops the run here, not at its end
            vote = self._replica_vote()
            if not vote.consistent:
                return "aborted", (
                    f"step {self.step}: {vote.sentence(self.world.world_size)} (silent data "
                    "corruption or different code); stopping"
                )
        # the same everywhere (agreed flags)
        self.consecutive_skips = self.consecutive_skips + 1 if flags.skip else 0
        limit = cfg.train.max_consecutive_skips
        if limit and self.consecutive_skips >= limit:
            return "aborted", (
                f"step {self.step}: {self.consecutive_skips} consecutive steps with non-finite "
                f"gradients (train.max_consecutive_skips={limit}): the run diverged; stopping"
            )
        if eval_now:
            t_eval = time.perf_counter()
            self.metric = self.evaluate(last=done)
            self.gc.collect()  # a boundary every rank reaches at this step
            self.lost["evaluation_s"] += time.perf_counter() - t_eval
            if self.stops_at_target and self.task.family.reached(self.metric, cfg.train.target):
                return "success", ""
        if self.saves is not None and self.saves.due(self.step):
            self.save_checkpoint()
            self.gc.collect()
        return None

    def train_step(self, step: int) -> StepFlags:
        """One optimizer step (grad_accum micro-batches); returns every rank's agreed outcome.

        Outside the steps the timers sample (scaleout/telemetry/timers.py), the step reads nothing
        from the
        device but the agreement's result (train/faults.py), which also carries the loss."""
        timers, precision = self.timers, self.task.precision
        delay = self.injections.delay
        start, start_wall = time.perf_counter(), time.time()  # phase times for the agreement
        timers.begin()
        self._at(step, "data")
        with timers("data"):  # with a prefetcher: only the time spent *waiting* for it
            if delay is not None:
                delay("data")
            ready, self._next_batches = self._next_batches, None
            if self.prefetcher is not None:
                micro_batches = self.prefetcher.get(step)
            elif ready is not None and ready[0] == step:  # built in the last step's wire wait
                micro_batches = ready[1]
            else:
                micro_batches = self.task.micro_batches(
                    step * self.cfg.train.global_batch, self.cfg.train.grad_accum
                )
        data_done = time.perf_counter()
        stats: dict[str, Any] = {}
        if self.graphs is not None:  # the step as one CUDA graph per shape (train/capture.py)
            self._at(step, "forward")
            self._stage_in_graph(micro_batches)
            with timers("graph"):
                self.graphs(micro_batches)  # (its loss reaches the host with the agreement)
        else:
            self.forward_backward(micro_batches)
            stats = self.sync.last_stats
            exposed = stats.get("exposed_s")  # backward's wait for what overlap did not hide
            if (
                exposed is not None
            ):  # the non-overlapped sharded LAMB communicates in step() instead
                timers.add("exposed_comm", float(exposed))
                timers.add("backward", -float(exposed))
            idle = float(stats.get("idle_s") or 0.0)  # the next step's batch, built in the wait
            if idle:
                timers.add("data", idle)
                timers.add("backward", -idle)
        computed = time.perf_counter()
        wait = float(stats.get("exposed_s") or 0.0)
        idle = float(stats.get("idle_s") or 0.0) if self.graphs is None else 0.0
        # this rank's own forward + backward without its waits (on a GPU: device time, a step
        # late; train/devicetime.py); the graphed step: its host time
        own = self.compute_clock.take()
        launched = stats.get("first_launch_at")  # DataParallel: this rank's first bucket out
        phases = [  # scaleout.train.skew.PHASES
            data_done - start + idle,
            own if own is not None else computed - data_done - wait - idle,
            launched - start_wall if launched is not None else computed - start - wait,
            wait,
            self._optimizer_s,
            *CLOCK.take(),  # intra, inter_allreduce (on CUDA: the step before's)
        ]
        precision.unscale_(self.params, self.optimizer)  # fp16: gradients / S
        if self.injections.gradient_faults:
            self.injections.damage_gradients(step, self.params)
        self.sync.wait_params()  # gathers of modules this forward did not run (see run_step)
        self._at(step, "agreement")
        pending, self._agreement = self._agreement, None
        if pending is None:  # the graphed step: its agreement was all-reduced inside the graph
            pending = self._graph_agreement(step)
            flags = pending.result((self._nonfinite(), self.sync.unused_flag()))
        else:  # out with the last bucket, or before the last backward
            summed = self.sync.ride_result() if pending.rode else None
            # sharded: the optimizer reads its shards' non-finite count in its step
            local = () if self.sync.finds_nonfinite else (self._nonfinite(),)
            flags = pending.result((*local, self.sync.unused_flag()), summed)
        if pending.with_skew:
            self._skew_seconds = self._lagged[1] if self._lagged else None
        self._lagged = (phases, 0.0)  # its seconds: run_step's, once measured
        self.flags = flags  # the end of the run follows these agreed flags, never this rank's own
        if flags.unused_params:
            self.sync.check_unused()  # the same on every rank: every rank raises the same error
        t0 = time.perf_counter()
        if self.step_in_graph:  # the update ran in the graph, or was blended away on every rank
            self.optimizer.settle(flags.skip)
            if not flags.skip:
                self.schedule.step()
        elif not flags.skip:
            self._at(step, "optimizer")
            with timers("optimizer"):
                self.optimizer.step()
            if getattr(self.optimizer, "skipped", False):  # sharded: non-finite, found alike
                flags = self.flags = replace(flags, skip=True)
            else:
                self.schedule.step()
        precision.update(flags.skip)  # the same flag on every rank: the loss scale stays equal
        self._optimizer_s = time.perf_counter() - t0
        # DataParallel: its bucket buffers, a few fills; the sharded LAMB: .grad set to None
        self.sync.zero_grad(set_to_none=not self.sync.grads_are_views)
        return flags

    def forward_backward(self, micro_batches: list[MicroBatch]) -> torch.Tensor | None:
        """Forward and backward of each micro-batch; all but the last accumulate without
        communicating. Returns the step's loss (a device tensor: nothing is read here)."""
        timers, total, step, nan = self.timers, None, self.step, self.injections.nan
        delay, clock = self.injections.delay, self.compute_clock
        for i, mb in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with contextlib.nullcontext() if last else self.sync.no_sync():
                self._at(step, "forward")
                clock.begin()
                with timers("forward"), self.task.autocast():
                    if delay is not None and i == 0:
                        delay("compute")  # a slow device's forward (test-only)
                    loss = self.task.loss(self.model, mb) / len(micro_batches)
                if nan is not None:
                    loss = nan.poison(step, loss)
                if last:
                    mean = loss.detach() if total is None else total + loss.detach()
                    self._arm_agreement(mean, sum(m.flops for m in micro_batches))
                if last:
                    self._build_ahead(step + 1)
                self._at(step, "backward")
                with timers("backward"):
                    scaled = self.task.precision.scale_loss(loss)
                    clock.arm(scaled)  # its end mark: before the gradient sync's wait
                    scaled.backward()
            total = loss.detach() if total is None else total + loss.detach()
        return total

    def _fingerprint(self) -> tuple[int, str]:
        """This step's collectives (the sync's fingerprint and words), the steps skipped so far
        folded in: a rank that skipped alone is named like a desynchronised one."""
        fingerprint, collectives = self.sync.collectives()
        if self.skipped:
            fingerprint = fold(fingerprint, self.skipped)
            collectives += f", {self.skipped} steps skipped"
        return fingerprint, collectives

    def _stage_in_graph(self, micro_batches: list[MicroBatch]) -> None:
        """The host values of a graphed step's agreement, written into its pinned host buffer
        before every run of the step (eager, captured or replayed): the graph's copy of that
        buffer then reads this step's flags, FLOPs, last step's phase times and this step's
        fingerprint, as :meth:`_arm_agreement` would send them (:meth:`_arm_in_graph`)."""
        fingerprint, collectives = self._fingerprint()
        lagged, p = self._lagged, self.preemption
        phases = (lagged[0] if lagged else [0.0] * len(PHASES)) if self.attribution else None
        flops = sum(mb.flops for mb in micro_batches)
        parts = [False, p.requested, p.noticed, p.terminating, 0.0, 0.0, flops]
        self._graph_host = stage_agreement(self.world, parts, phases, fingerprint)
        with_skew = lagged is not None and self.attribution
        self._graph_meta = (phases is not None, with_skew, fingerprint, collectives)
        self.progress.collectives += 1

    def _arm_in_graph(self, loss: torch.Tensor) -> Any:
        """Inside the graphed step, before its last backward: the staged values up to the
        device, this rank's loss beside them, their all-reduce started (it runs during
        backward); returns its wait, which the step makes at its end (a stream wait on CUDA:
        the capture joins it)."""
        flags, host = self._graph_flags, self._graph_host
        assert flags is not None and host is not None, "staged before the step"
        flags.copy_(host, non_blocking=True)
        flags[LOSS : LOSS + 1].copy_(loss.detach().reshape(1))
        if self.world.world_size == 1:
            return None
        return dist.all_reduce(flags, async_op=True).wait

    def _graph_agreement(self, step: int) -> PendingAgreement:
        """The graphed step's agreement, to read after the step ran (:meth:`_arm_in_graph`)."""
        assert self._graph_flags is not None and self._graph_meta is not None
        phases, with_skew, fingerprint, collectives = self._graph_meta
        return PendingAgreement(
            rode=False,
            world=self.world,
            flags=self._graph_flags,
            work=None,
            head=HEAD,
            phases=phases,
            with_skew=with_skew,
            has_loss=True,
            fingerprint=fingerprint,
            step=step,
            describe=collectives,
            credit=self.link_credit,
        )

    def _arm_agreement(self, loss: torch.Tensor, flops: float) -> None:
        """The eager step's agreement, before the last backward: written by
        the reducer into the last gradient bucket's rider as it goes out (uncompressed wire), else
        launched now, so that it completes during backward. It carries the host flags as they are
        then, this rank's loss and FLOPs, and the block of the *last* step's phase times (this
        step's are complete only once its gradients arrived) with *this* step's collectives'
        fingerprint, which also folds in the steps skipped so far: a rank that skipped alone (its
        reduced gradients non-finite where the others' were not: a silent corruption) is named
        like a desynchronised one."""
        step = self.step
        self._agreement = None

        def fill(view: torch.Tensor) -> None:  # in the last bucket, after its pre-divide
            self._agreement = agreement(view)

        def agreement(into: torch.Tensor | None) -> PendingAgreement:
            fingerprint, collectives = self._fingerprint()
            lagged = self._lagged
            if into is None:
                self.progress.collectives += 1
            p = self.preemption
            return start_agreement(
                self.world,
                False,  # non-finite: read from the reduced gradients, alike on every rank
                p.requested,
                loss,
                notice=p.noticed,
                terminate=p.terminating,
                flops=flops,
                # riding, the block is there as the rider was sized (attribution at start-up)
                phases=(lagged[0] if lagged and self.attribution else [0.0] * len(PHASES))
                if (self.attribution if into is None else into.numel() > HEAD)
                else None,
                fingerprint=fingerprint,
                step=step,
                describe=collectives,
                credit=self.link_credit,
                with_skew=lagged is not None and self.attribution,
                into=into,
            )

        if self.sync.ride(fill):
            return
        # the sharded LAMB: no world collective from here while its all-gathers may be in flight
        self.sync.wait_params()
        self._agreement = agreement(None)

    def _build_ahead(self, step: int) -> None:
        """Build step ``step``'s micro-batches while this backward's last gradient bucket is on
        the wire (the sync's ``while_waiting``), where the host would otherwise sit idle; the
        next train_step then starts computing at once. The same batches, in the same order, as
        the synchronous path (a pure function of the data position); a failure is left for that
        path to raise in its own step. Only for the in-process data path on a host wait (no
        prefetch workers: they build ahead already)."""
        if self.prefetcher is not None or step >= self.cfg.train.max_steps:
            return
        cfg = self.cfg.train

        def build() -> None:
            try:
                self._next_batches = (
                    step,
                    self.task.micro_batches(step * cfg.global_batch, cfg.grad_accum),
                )
            except Exception:  # noqa: BLE001 -- raised again, in its own step, by the normal path
                self._next_batches = None

        self.sync.while_waiting(build)  # the sharded LAMB has no such wait: dropped

    def _nonfinite(self) -> torch.Tensor | bool:
        """1.0 on the device if a reduced gradient is NaN/Inf: the sync's flag from its averaging
        pass (DataParallel's fp32 buckets divided after the sum) when nothing touched the
        gradients since (no injected gradient fault), else one pass of its own over the reduced
        gradients: the sync's buffers (a few flat tensors), else every ``.grad``."""
        if not self.injections.gradient_faults:
            found = self.sync.nonfinite_flag()
            if found is not None:
                return found
        grads = self.sync.reduced_grads()
        if grads is None:
            grads = [p.grad for p in self.params if p.grad is not None]
        return nonfinite(grads)

    def _at(self, step: int, phase: str) -> None:
        """This rank enters ``phase`` of step ``step``: the heartbeat's mark (a step index;
        eval/checkpoint/finish: the steps done), and a test's hang there (SCALEOUT_TEST_HANG)."""
        self.progress.at(step, phase)
        if self.injections.hang is not None:
            self.injections.hang(step, phase)

    def _tune_comm(self, seconds: float) -> None:
        """comm.algorithm=auto after a step: the profile, an A/B step, or the decision (every
        rank alike: it all-reduces what it decides from). The decision goes to the MLPerf log."""
        chosen = self.autocomm.after_step(seconds)
        if chosen is None:
            return
        s = self.autocomm.summary()
        self.mlperf_log.event(
            "scaleout_comm_plan",
            chosen.label(),
            metadata={
                "step": self.step,
                "predicted_step_s": s.get("predicted_step_s"),
                "measured_step_s": s.get("measured_step_s"),
                "candidates": s.get("candidates"),
                "diverged": s.get("diverged"),
            },
        )
        ab = ", ".join(
            f"{a['label']}: predicted {a['predicted_step_s'] * 1e3:.1f} ms, measured "
            f"{(a['measured_median_s'] or 0) * 1e3:.1f} ms"
            for a in s.get("ab", [])
        )
        print0(
            f"comm.algorithm=auto: {chosen.label()} after step {self.step} ({ab})",
            rank=self.world.rank,
        )

    # -- evaluation
    # ------------------------------------------------------------------------------------------
    @property
    def stops_at_target(self) -> bool:
        """Stop when an evaluation reaches train.target: unless there is none, or HPC-AI500's
        fixed-epoch protocol (hpcai500.epochs) runs every epoch whatever the quality."""
        h = self.cfg.hpcai500
        fixed = h is not None and h.epochs is not None
        return self.cfg.train.target is not None and not fixed

    def evaluate(self, last: bool = False) -> float:
        """One evaluation of the task's metric, between the observers' eval events. ``last``: no
        training follows (train.max_steps reached)."""
        target, epoch = self.cfg.train.target, self.task.epoch_of(self.samples)
        self._at(self.step, "eval")
        self.sync.wait_params()  # an evaluation may read the weights outside the model's forward
        at = EvalStart(self.step, self.samples, epoch)
        for observer in self.observers:
            observer.on_eval_start(at)
        value = self.task.evaluate(self.task.model)
        reached = self.stops_at_target and self.task.family.reached(value, target)
        record = EvalRecord(
            step=self.step,
            samples=self.samples,
            epoch=epoch,
            metric=self.task.metric_name,
            value=value,
            target=target,
            continues=not (reached or last),
        )
        for observer in self.observers:
            observer.on_eval(record)
        return value

    # -- checkpoints
    # ------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        """Collective: every rank takes part (BN statistics, sharded pieces). Synchronous
        (checkpoint.async=false): rank 0 writes, then a barrier. Asynchronous: the previous save
        is waited for, the state is copied to host memory and a background thread writes it;
        one small all-reduce agrees on failures (and, for every_steps=auto, on the costs)."""
        if self.saves is None:
            return
        self._at(self.step, "checkpoint")
        stall = self.saves.save(
            self.step, self._write_checkpoint, self._mean_step_s(), self.progress
        )
        self.lost["save_stall_s"] += stall

    def _write_checkpoint(self) -> None:
        """This rank's part of a save at ``self.step`` (a snapshot when asynchronous)."""
        assert self.checkpointer is not None  # saves exist only with a checkpointer
        self.task.sync_buffers()  # BN statistics equal on every rank, so a resume is exact
        state = self.state_dict()
        _, shards = self.sync.optimizer_state(self.optimizer)  # sharded: each rank its own
        path = self.checkpointer.save(self.step, state, world=self.world, shards=shards)
        if path is not None:
            how = " (written in the background)" if self.checkpointer.asynchronous else ""
            print0(f"checkpoint: step {self.step} -> {path}{how}", rank=self.world.rank)

    def _mean_step_s(self) -> float:
        return self.this_run.seconds / max(self.this_run.steps, 1)

    def state_dict(self) -> dict[str, Any]:
        """The replicated part of a checkpoint at ``self.step`` (rank 0 writes it); the sharded
        optimizer's pieces are written apart. No RNG state: a step's random streams follow from
        (train.seed, step, rank) (train/rng.py)."""
        self.sync.wait_params()  # the sharded LAMB's last all-gathers, before the weights are read
        opt_state, _ = self.sync.optimizer_state(self.optimizer)
        return {
            "model": self.task.model.state_dict(),
            "optimizer": opt_state,
            "config": self.cfg.model_dump(mode="json"),  # self-describing: `scaleout ckpt show`
            "schedule": self.schedule.state_dict(),
            "data_position": self.step * self.cfg.train.global_batch,
            "samples": self.samples,
            "skipped": self.skipped,
            "precision": self.task.precision.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The inverse of :meth:`state_dict` (an older checkpoint's ``rng`` entry is ignored)."""
        self.task.model.load_state_dict(state["model"])
        self.sync.load_optimizer_state(self.optimizer, state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.step = int(state["step"])
        self.samples, self.skipped = int(state.get("samples", 0)), int(state.get("skipped", 0))
        self.task.precision.load_state_dict(state.get("precision", {}))  # the fp16 loss scale

    # -- the end of the run
    # ------------------------------------------------------------------------------------------
    def _finish(self, status: RunStatus, reason: str, clock: float) -> TrainResult:
        """MLPerf run_stop, the final checkpoint, the report, and the exit code of ``status``."""
        cfg, world = self.cfg, self.world
        self._at(self.step, "finish")
        if self.prefetcher is not None:
            self.prefetcher.close()
        # An agreed SIGTERM (the same on every rank): KillWait is short, leave out the optional
        # collectives. A rank's own late SIGTERM changes nothing here.
        peers_may_be_gone = status == "preempted" and self.flags.terminate
        self.sync.wait_params()  # before any main-thread collective (see run_step)
        if not peers_may_be_gone:
            world.barrier()
        time_to_train = time.perf_counter() - clock
        stop = RunStop(status, time_to_train, self.samples, self.task.eval_size, reason)
        for observer in self.observers:
            observer.on_run_stop(stop)
        saved_in_loop = self.saves is not None and self.saves.saved_step == self.step
        took_steps = self.this_run.steps > 0
        if status in ("success", "max_steps") and not saved_in_loop and took_steps:
            self.save_checkpoint()
        # the last save is committed before the run's end is recorded (and before a requeue)
        settle = time.perf_counter()
        if self.saves is not None:
            self.saves.settle(self._mean_step_s(), agree=not peers_may_be_gone)
        self.lost["save_stall_s"] += time.perf_counter() - settle
        if world.rank == 0:
            rerun.record_end(cfg, self.run_record, status, self.step)
        replica_vote = None if peers_may_be_gone else self._replica_vote()  # reports a split
        if cfg.comm.timeline and not peers_may_be_gone and isinstance(self.model, DataParallel):
            trace = self.model.write_timeline()  # collective: rank 0 merges every rank's spans
            if trace is not None:
                print0(f"timeline: {trace} (chrome://tracing, ui.perfetto.dev)", rank=world.rank)
        self.gc.stop()
        goodput = goodput_section(
            useful_step_s=self.this_run.seconds,
            wall_s=time.time() - self.started_unix,
            restart_s=restart_loss_s(self.start_info, self.resumed_path, self.started_unix),
            **self.lost,
        )
        assert self.preemption is not None  # installed by _start_clock
        end = RunEnd(
            status=status,
            time_to_train_s=time_to_train,
            this_run=self.this_run,
            timed=self.timed,
            metric=self.metric,
            skipped=self.skipped,
            resumed_from=self.resumed_from,
            run_id=self.run_record.get("run_id"),
            weights_consistent=None if replica_vote is None else replica_vote.consistent,
            odd_ranks=[] if replica_vote is None else replica_vote.odd_ranks,
            # the agreed flag, never this rank's own signal state: a SIGTERM that reached this rank
            # after the last agreement must not drop a collective its peers still enter
            terminating=peers_may_be_gone,
            goodput=goodput,
            comm_auto=self.autocomm.summary() if self.autocomm is not None else None,
            sections={
                "untimed_start": self.untimed_start,
                "gc": self.gc.summary(),
            },
        )
        for observer in self.observers:
            observer.on_run_end(end)
        if status == "preempted":
            code = preempt.release_after_stop(
                world,
                self.preemption,
                notice=self.flags.notice,
                terminate=self.flags.terminate,
                checkpointing=self.checkpointer is not None,
                before_requeue=self.injections.requeue_delay,
            )
        else:
            code = EXIT_ABORTED if status == "aborted" else 0
        if self.owns_preemption_handlers:
            self.preemption.uninstall()
            self.preemption = None
        return TrainResult(status, code, self.step, self.metric, self.report_writer.report)

    def _vote_due(self, done: bool) -> bool:
        """A periodic replica vote after this step (train.replica_vote_every; the end of the run
        votes anyway): the same on every rank."""
        every = self.cfg.train.replica_vote_every
        return bool(every) and self.step % every == 0 and not done

    def _replica_vote(self) -> replicas.Vote:
        """The replicas' vote at this step boundary (every rank), reported when they differ."""
        self.sync.wait_params()  # before any main-thread collective (see run_step)
        vote = replicas.vote(self.task.model, self.world)
        if not vote.consistent:
            self._report_replica_vote(vote)
        return vote

    def _report_replica_vote(self, vote: replicas.Vote) -> None:
        """Rank 0 says which replicas differ and, under ``scaleout slurm run``, leaves the vote
        for the supervisor, which quarantines the odd ranks' nodes."""
        if self.world.rank != 0:
            return
        text = vote.sentence(self.world.world_size)
        print(f"WARNING: {text}", flush=True)
        if vote.odd_ranks:
            write_replica_vote(self.world, text, vote.odd_ranks)


def restart_loss_s(start: rerun.RunStart, resumed: Path | None, started_unix: float) -> float:
    """Seconds lost to the failure or preemption before this segment (goodput's ``restart``):
    after a preempted segment (run.json recorded its end), the time from that end to this
    process's start (requeue and queue wait; its last checkpoint was taken at the stop, so no
    work is redone); after one that died without recording an end, the time from the checkpoint
    resumed from to this start (the work done after it, lost and redone, plus the downtime). A
    new run, or the continuation of a run that finished (max_steps raised), lost nothing."""
    record = start.record or {}
    if start.kind != "resume" or resumed is None:
        return 0.0
    status, ended = record.get("status"), record.get("ended_unix")
    if status == "preempted" and ended is not None:
        return max(started_unix - float(ended), 0.0)
    if status == "running":  # the segment before never recorded its end: it crashed
        try:
            return max(started_unix - resumed.stat().st_mtime, 0.0)
        except OSError:
            return 0.0
    return 0.0


def out_of_memory(exc: BaseException, cfg: Config, world: World, step: int) -> UserError:
    """A device out-of-memory in a training step as one line: rank, step, the per-rank batch
    and what to change (instead of the allocator's multi-line report under a traceback)."""
    t = cfg.train
    rows = t.global_batch // max(1, world.world_size * t.grad_accum)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return UserError(
        f"rank {world.rank} step {step}: out of memory on {world.device} with {rows} rows per "
        f"micro-batch (train.global_batch={t.global_batch} / {world.world_size} ranks / "
        f"train.grad_accum={t.grad_accum}): {first[:200]}; raise train.grad_accum or lower "
        "train.global_batch"
    )


def process_start_unix() -> float:
    """When this process started (Linux: /proc), else now."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def run_training(cfg: Config, config_file: str = "config.yaml") -> TrainResult:
    """Entry point inside every rank (``scaleout train``)."""
    started = process_start_unix()  # goodput's wall clock: imports and rendezvous count
    start_clock = StartClock(started)
    # Handlers first: the World's rendezvous can take minutes at scale, and a notice that arrives
    # while USR2 still has its default action would terminate the rank.
    preemption = preempt.install()
    try:
        world = init(cfg)
        start_clock.mark("rendezvous")
        heartbeat = Heartbeat(world, lambda: period_for(world.timeout_s))  # names a hung rank
        owner = None
        # NCCL: scaleout's hang budget runs out before the watchdog's abort (train/hangwatch.py)
        watches = hangwatch.start(world, heartbeat.progress, cfg.train.output_dir)
        try:
            # corrupt or foreign files under path-valued keys, before any write: rank 0 sniffs
            # them and every rank raises its one line (O(1) file-system calls on the others)
            share(world, "input-files", lambda: check_input_files(cfg))
            # the rerun policy, decided on rank 0 and broadcast (every rank does the same; the
            # launcher's preflight already refused what it could before spawning): a refused start
            # writes nothing
            owner = agree_owner(cfg, world)  # one job per run directory, before any write
            start = rerun.agree_start(cfg, world)
            if start.kind == "finished":
                print0(f"scaleout train: {start.message}")
                return TrainResult("finished", 0, start.latest_step, None)
            cfg.check_world(world.world_size, world.local_size)
            torch.set_num_threads(
                max(1, int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
            )
            trainer = Trainer(
                cfg,
                world,
                config_file,
                start,
                preemption=preemption,
                progress=heartbeat.progress,
                started=started,
                start_clock=start_clock,
            )
            return trainer.train()
        except Exception as exc:
            if is_comm_failure(
                exc
            ):  # a hung or dead peer: one line naming it, then end this process
                exit_on_comm_failure(world, exc)
            write_crash(world, exc)  # for `scaleout slurm run`: a software error, not a node
            full = say_disk_full(world, exc, cfg.train.output_dir)  # this rank, not a bystander
            if full is not None and full is not exc:
                raise full from None  # one line (path, bytes free), not a writer's traceback
            raise
        finally:
            if owner is not None:
                owner.release()
            for watch in watches:
                watch.close()
            heartbeat.close()
            world.close()
    finally:
        preemption.uninstall()
