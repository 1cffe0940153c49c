"""Submit scaleout runs with submitit: real Slurm when there is one, submitit's local executor
otherwise.

Every task (one per GPU) runs ``scaleout <subcommand> ...`` in-process through :class:`RankMain`, so
the scheduler's signals reach the training loop directly: scaleout.goodput.preempt's handlers
replace
submitit's while training runs, rank 0 checkpoints and calls ``scontrol requeue``, and the requeued
job (the same pickled RankMain) resumes from the checkpoint. Under the local executor, the submitit
variables (SUBMITIT_LOCAL_*) are translated into the ones scaleout's ``local`` environment reads,
and the rendezvous port is one that was free on this machine when the job was submitted (distinct
for every job of an ``--array``), not a hash of the job id.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from scaleout.env.base import free_ports, local_rank_env
from scaleout.errors import UserError
from scaleout.goodput import preempt
from scaleout.launchers.base import (
    EXIT_TIMED_OUT,
    Launcher,
    LaunchOptions,
    LaunchResult,
    RankExit,
    register,
)
from scaleout.launchers.cpus import cpu_share_lines


@dataclass
class SubmitSpec:
    argv: list[
        str
    ]  # scaleout subcommand + its arguments, e.g. ["train", "configs/x.yaml", "a.b=1"]
    nodes: int = 1
    gpus_per_node: int = 1  # = tasks per node (one rank per GPU)
    request_gpus: bool = True  # ask Slurm for the GPUs (False on CPU-only clusters)
    partition: str | None = None
    time_min: int = 60
    signal: str = "USR2"  # USR2: NCCL may install its own USR1 handler
    signal_delay_s: int = 120  # notice before the time limit: enough to write a checkpoint
    cluster: Literal["auto", "slurm", "local", "debug"] = "auto"
    folder: str = "submitit/%j"
    name: str = "scaleout"
    array: dict[str, list[str]] = field(
        default_factory=dict
    )  # override key -> values: one job per value
    extra_slurm: dict[str, Any] = field(default_factory=dict)
    # launch.container's srun options (pyxis --container-*, OCI --container): every task's srun
    srun_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise UserError(f"--nnodes={self.nodes}: expected an integer >= 1")
        if self.gpus_per_node < 1:
            raise UserError(
                f"--nproc-per-node={self.gpus_per_node}: expected an integer >= 1 (one rank per "
                "GPU)"
            )
        if self.time_min < 1:
            raise UserError(f"--time={self.time_min}: expected minutes >= 1")
        if not 0 <= self.signal_delay_s < self.time_min * 60:
            raise UserError(
                f"--signal-delay={self.signal_delay_s}: expected seconds from 0 to below --time "
                f"({self.time_min} min)"
            )
        if self.signal not in ("USR1", "USR2", "TERM", "INT", "HUP"):
            raise UserError(
                f"--signal={self.signal!r}: expected USR2 (default), USR1, TERM, INT or HUP"
            )
        if self.cluster not in ("auto", "slurm", "local", "debug"):
            raise UserError(f"--executor={self.cluster!r}: expected auto, slurm, local or debug")
        if len(self.array) > 1:
            raise UserError(
                f"--array given for {sorted(self.array)}: expected one key (one job per value)"
            )


def parse_array(text: str | None) -> dict[str, list[str]]:
    """``optim.lr=1e-3,2e-3`` -> {"optim.lr": ["1e-3", "2e-3"]}."""
    if not text:
        return {}
    key, eq, values = text.partition("=")
    items = [v for v in values.split(",") if v]
    if not eq or not key or not items:
        raise UserError(
            f"--array {text!r}: expected KEY=V1,V2,... (one job per value of the config key)"
        )
    return {key.strip(): items}


_SLURM_KEY = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")


def parse_slurm_options(items: Sequence[str] | None) -> dict[str, Any]:
    """``--slurm account=proj --slurm exclusive`` -> {"account": "proj", "exclusive": True}:
    sbatch options without their dashes (hyphens and underscores alike), passed to sbatch as
    ``--account=proj --exclusive``."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, eq, value = item.lstrip("-").partition("=")
        if not _SLURM_KEY.fullmatch(key) or (eq and not value):
            raise UserError(
                f"--slurm {item!r}: expected KEY=VALUE or KEY, an sbatch option without its dashes "
                f"(e.g. account=proj, qos=high, constraint=a100, exclusive)"
            )
        out[key.replace("-", "_")] = value if eq else True
    return out


def resolve_cluster(cluster: str) -> str:
    if cluster != "auto":
        if cluster == "slurm" and shutil.which("sbatch") is None:
            raise UserError("--executor=slurm but sbatch is not on PATH")
        return cluster
    return "slurm" if shutil.which("sbatch") is not None else "local"


class RankMain:
    """The callable every task runs: ``entry(argv)`` in this process (``entry``: the CLI's
    ``main``, which the caller passes, so that launchers never import the CLI). Picklable: plain
    data and a module-level function, pickled by reference. ``master_port``: the rendezvous port
    under submitit's local executor (chosen at submission)."""

    def __init__(
        self,
        argv: Sequence[str],
        master_port: int | None = None,
        entry: Callable[[list[str]], int] | None = None,
    ):
        self.argv = list(argv)
        self.master_port = master_port
        self.entry = entry

    def __call__(self) -> int:
        import submitit

        env = submitit.JobEnvironment()
        if (
            "SLURM_PROCID" not in os.environ
        ):  # submitit's local executor: speak scaleout's local variables
            port = getattr(
                self, "master_port", None
            )  # None in a RankMain pickled before ports were chosen
            if port is None and env.num_tasks > 1:
                raise RuntimeError(
                    "RankMain under submitit's local executor needs master_port (set by submit())"
                )
            port = port or free_ports(1)[0]  # one task: nobody else needs to know it
            os.environ.update(
                local_rank_env(
                    env.global_rank,
                    env.num_nodes,
                    env.num_tasks // env.num_nodes,
                    "127.0.0.1",
                    port,
                )
            )
        entry = getattr(self, "entry", None)
        if entry is None:  # a RankMain pickled before the entry point travelled with it
            raise RuntimeError(
                "RankMain has no entry point: resubmit the job with this version of scaleout"
            )
        rc = entry(self.argv)
        if rc == preempt.EXIT_PREEMPTED and preempt.slurm_job_id() is not None:
            # Rank 0 asked Slurm to requeue: wait to be stopped rather than report a result for this
            # run.
            time.sleep(600)
        if rc != 0:
            raise RuntimeError(
                f"rank {env.global_rank}: scaleout {' '.join(self.argv)} exited with code {rc}"
            )
        return rc

    def checkpoint(self) -> Any:
        """submitit calls this on its own preemption signal if our handler is not installed yet
        (before the training loop starts): resubmit the same command, which resumes from the
        latest checkpoint."""
        import submitit

        return submitit.helpers.DelayedSubmission(RankMain(self.argv, self.master_port, self.entry))


def make_executor(spec: SubmitSpec) -> Any:
    import submitit

    cluster = resolve_cluster(spec.cluster)
    folder = spec.folder
    if cluster == "slurm":
        ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=3)
        params: dict[str, Any] = dict(
            nodes=spec.nodes,
            ntasks_per_node=spec.gpus_per_node,
            time=spec.time_min,
            job_name=spec.name,
            signal_delay_s=spec.signal_delay_s,
            additional_parameters={"requeue": True, **spec.extra_slurm},
        )
        if (
            spec.request_gpus
        ):  # per node, as slurm/*.sh: per-task device cgroups would block CUDA IPC / NVLink P2P
            params["gpus_per_node"] = spec.gpus_per_node
            params["exclusive"] = True  # whole nodes: their CPUs are the tasks' to share
        # each task gets its share of the node's CPUs (launchers/cpus.py), not Slurm's default 1
        params["setup"] = cpu_share_lines(spec.gpus_per_node)
        if spec.partition:
            params["partition"] = spec.partition
        if spec.srun_args:
            params["srun_args"] = list(spec.srun_args)
        ex.update_parameters(**params)
        # submitit's own handler uses USR2 as well; keep the two consistent
        submitit.slurm.slurm.SlurmJobEnvironment.USR_SIG = spec.signal
        return ex
    if spec.nodes > 1:
        raise UserError(
            f"--nnodes={spec.nodes} without Slurm: submitit's local executor runs one node"
        )
    if spec.srun_args:
        raise UserError(
            f"launch.container ({' '.join(spec.srun_args)}): srun options, but this job runs on "
            f"submitit's {cluster} executor (no Slurm)"
        )
    if spec.extra_slurm:
        raise UserError(
            f"--slurm {', '.join(spec.extra_slurm)}: sbatch options, but this job runs on "
            "submitit's "
            f"{cluster} executor (no Slurm)"
        )
    ex = (
        submitit.LocalExecutor(folder=folder)
        if cluster == "local"
        else submitit.DebugExecutor(folder=folder)
    )
    ex.update_parameters(nodes=1, tasks_per_node=spec.gpus_per_node, timeout_min=spec.time_min)
    return ex


def job_argvs(spec: SubmitSpec) -> list[list[str]]:
    """The command of every job: one, or one per ``--array`` value."""
    if not spec.array:
        return [list(spec.argv)]
    ((key, values),) = spec.array.items()
    return [[*spec.argv, f"{key}={v}"] for v in values]


def rank_mains(spec: SubmitSpec, entry: Callable[[list[str]], int] | None = None) -> list[RankMain]:
    """What every job runs: ``entry(argv)``. Slurm: the ranks derive the port from the job id
    (scaleout.env.slurm.SlurmEnv). Locally every job runs on this machine now: each gets its own
    port, free here."""
    argvs = job_argvs(spec)
    local = resolve_cluster(spec.cluster) != "slurm"
    ports = free_ports(len(argvs)) if local else [None] * len(argvs)
    return [RankMain(argv, port, entry) for argv, port in zip(argvs, ports, strict=True)]


def submit(spec: SubmitSpec, entry: Callable[[list[str]], int]) -> list[Any]:
    """Submit one job (or one per ``--array`` value) whose every task runs ``entry(argv)`` (the
    CLI's main); return the submitit Job objects."""
    import submitit

    ex = make_executor(spec)
    fns = rank_mains(spec, entry)
    try:
        if len(fns) > 1 and hasattr(ex, "batch"):
            with ex.batch():
                jobs = [ex.submit(fn) for fn in fns]
            return jobs
        return [ex.submit(fn) for fn in fns]
    except submitit.core.utils.FailedJobError as exc:  # sbatch refused: its last words, in one line
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        raise UserError(f"submission failed: {lines[-1] if lines else exc}") from None


def follow(
    jobs: Sequence[Any],
    out: Callable[[str], None] = print,
    poll_s: float = 0.5,
    timeout_s: float | None = None,
) -> dict[str, str]:
    """Stream rank 0's log of every job until all are done (or the timeout); return job id ->
    state."""
    offsets: dict[str, int] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        done = all(j.done() for j in jobs)
        for j in jobs:
            path = Path(str(j.paths.stdout).replace("%t", "0"))
            if path.exists():
                with open(path, errors="replace") as f:
                    f.seek(offsets.get(j.job_id, 0))
                    text = f.read()
                    offsets[j.job_id] = f.tell()
                for line in text.splitlines():
                    out(f"[{j.job_id}] {line}" if len(jobs) > 1 else line)
        if done:
            return {j.job_id: j.state for j in jobs}
        if deadline is not None and time.monotonic() > deadline:
            return {j.job_id: j.state for j in jobs}
        sys.stdout.flush()
        time.sleep(poll_s)


def failure_line(exc: BaseException) -> str:
    """The one line of a failed task's error worth printing: the last that names an error or a rank
    (RankMain's "rank N: ... exited with code C"), else the last line."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    why = [ln for ln in lines if "Error" in ln or "rank " in ln] or lines or [type(exc).__name__]
    return why[-1]


_RANK_FAILED = re.compile(r"rank (\d+): .* exited with code (-?\d+)")


class SubmitJob:
    """A submitit job whose tasks are the ranks (task i = rank i, ``nproc_per_node`` per node)."""

    def __init__(self, job: Any, nproc_per_node: int, log_hint: str | None = None):
        self.job, self.nproc = job, nproc_per_node
        self.log_hint = log_hint or f"log {job.paths.stdout}"  # named in the failure message

    @property
    def job_id(self) -> str:
        return self.job.job_id

    def stop(self) -> None:
        self.job.cancel(check=False)

    def wait(self, timeout_s: float | None = None) -> LaunchResult:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while not self.job.done():
                if deadline is not None and time.monotonic() > deadline:
                    self.job.cancel()
                    return LaunchResult(
                        EXIT_TIMED_OUT,
                        None,
                        f"job {self.job_id}: timed out; cancelled",
                        "timed_out",
                    )
                time.sleep(0.5)
        except BaseException:  # Ctrl-C / SIGTERM of the caller: do not leave the job running
            self.stop()
            raise
        return self.result()

    def result(self) -> LaunchResult:
        """The result of a finished job: the first task that failed is the failed rank."""
        try:
            self.job.results()  # every task's return value; raises with the failing task's error
        except Exception as exc:  # noqa: BLE001 -- one line: the failing rank's error
            failed = self.failed_rank()
            return LaunchResult(
                1,
                failed,
                f"job {self.job_id}: failed: {failure_line(exc)} ({self.log_hint})",
                "failed",
            )
        return LaunchResult(0, None, f"job {self.job_id}: completed", "succeeded")

    def failed_rank(self) -> RankExit | None:
        for task in range(self.job.num_tasks):
            exc = self.job.task(task).exception()
            if exc is not None:
                match = _RANK_FAILED.search(str(exc))
                code = int(match.group(2)) if match else 1
                return RankExit.of(task, self.nproc, code)
        return None


@register
class SubmitLauncher(Launcher):
    """One submitit job per start (Slurm when sbatch is on PATH, else submitit's local executor);
    every task runs ``entry(argv)`` in-process (``entry``: the CLI's main, given by the caller,
    so that launchers never import the CLI). ``spec``: the SubmitSpec fields every start shares."""

    name = "submit"

    def __init__(
        self,
        entry: Callable[[list[str]], int] | None = None,
        extra_env: dict[str, str] | None = None,
        **spec: Any,
    ):
        self.entry = entry
        self.extra_env = dict(extra_env or {})
        self.spec = spec

    @classmethod
    def from_options(cls, options: LaunchOptions) -> SubmitLauncher:
        if options.rate is not None:
            raise UserError("--netns works with --launcher local, not submit")
        return cls(
            entry=options.entry,
            extra_env=options.extra_env,
            cluster=options.cluster,
            partition=options.partition,
            time_min=options.time_min,
            request_gpus=options.gpus,
            extra_slurm=dict(options.slurm),
        )

    def check(self, shapes: Sequence[tuple[int, int]]) -> None:
        try:
            import submitit  # noqa: F401  # deferred: an optional dependency
        except ImportError:
            raise UserError(
                "--launcher submit needs submitit: pip install 'scaleout[slurm]'"
            ) from None
        if resolve_cluster(self.spec.get("cluster", "auto")) != "slurm":
            big = [nnodes * nproc for nnodes, nproc in shapes if nnodes > 1]
            if big:
                raise UserError(
                    f"--launcher submit without Slurm runs one node, but world sizes {big} need "
                    "more "
                    f"than one: use --nnodes 1,... or --launcher local"
                )

    def submit(self, spec: SubmitSpec) -> list[SubmitJob]:
        """Submit ``spec`` (one job, or one per ``--array`` value) with this process's
        environment plus ``extra_env`` (submitit's executors hand this process's environment to
        the job)."""
        saved = {k: os.environ.get(k) for k in self.extra_env}
        os.environ.update(self.extra_env)
        try:
            jobs = submit(spec, self.entry)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return [SubmitJob(j, spec.gpus_per_node) for j in jobs]

    def start(
        self,
        argv: Sequence[str],
        nnodes: int,
        nproc_per_node: int,
        *,
        log: Path | None = None,
        name: str = "scaleout",
    ) -> SubmitJob:
        argv = list(argv)
        if argv[:1] != ["scaleout"]:
            raise UserError(
                f"the submit launcher runs scaleout subcommands in-process, not {argv[:1]}"
            )
        fields = dict(self.spec)
        if log is not None:  # the job's logs beside the caller's log file
            fields["folder"] = str(log.parent / "submitit" / "%j")
        spec = SubmitSpec(
            argv=argv[1:], nodes=nnodes, gpus_per_node=nproc_per_node, name=name, **fields
        )
        (job,) = self.submit(spec)
        if log is not None:
            job.log_hint = f"logs {log.parent}/submitit"
        return job


def container_srun_args(argv: Sequence[str]) -> list[str]:
    """launch.container's srun options for a ``train CONFIG [overrides]`` job (else none)."""
    if len(argv) < 2 or argv[0] != "train":
        return []
    from scaleout.config import load_config  # deferred: pydantic + the schema, only for train jobs
    from scaleout.launchers.container import srun_args  # deferred: imports the schema too

    return srun_args(load_config(argv[1], list(argv[2:])).launch.container)
