"""Start the runs of a scaling sweep, one point after another, and collect each point's report.json.

A runner turns one :class:`scaleout.sweep.SweepPoint` (nodes x ranks per node, overrides) into a finished
``scaleout train`` run and returns how it ended:

- ``LocalRunner``: launchers.local on this machine (optionally every emulated node in its own network
  namespace with a rate-limited link: launchers.netns, brought up once for the largest point);
- ``SlurmRunner``: ``sbatch -N nodes --ntasks-per-node G --wrap "srun scaleout train ..."`` and wait;
- ``SubmitRunner``: submitit (launchers.submit), Slurm when present else its local executor (one node).

Points run one at a time on purpose: two points sharing nodes (or, here, cores) would measure each other.
Each point's rank output goes to ``<point dir>/launch.log``; the sweep prints one progress line per point.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scaleout.errors import UserError
from scaleout.sweep import PointResult, SweepPoint, point_overrides, read_point
from scaleout.sweep.results import median_run

LAUNCHERS = ("local", "slurm", "submit")
POINT_FILE = "point.json"  # the command of a point's finished run (what --resume compares)
# How long a Slurm job may be unknown to scontrol before the point fails (a controller restart or a
# job record purged after MinJobAge is seconds, not minutes).
UNKNOWN_GRACE_S = 60.0


@dataclass
class PointRun:
    returncode: int
    message: str


def _tail(path: Path, lines: int = 12) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


class LocalRunner:
    """Each point with launchers.local (``scaleout launch``); ``netns_rate`` puts nodes in namespaces."""

    def __init__(
        self,
        netns_rate: str | None = None,
        timeout_s: float | None = None,
        extra_env: dict[str, str] | None = None,
    ):
        self.netns_rate = netns_rate
        self.timeout_s = timeout_s
        self.extra_env = dict(extra_env or {})  # e.g. OMP_NUM_THREADS for every rank
        self.cluster: Any = None

    def check(self, points: Sequence[SweepPoint]) -> None:
        if self.netns_rate is not None:
            from scaleout.launchers.netns import parse_rate, require_root

            require_root()
            parse_rate(self.netns_rate)

    def __enter__(self) -> LocalRunner:
        return self

    def start_cluster(self, nodes: int) -> None:
        if self.netns_rate is not None and self.cluster is None:
            from scaleout.launchers.netns import Cluster

            # One private cluster for the whole sweep, sized for the largest point; points use its first nodes.
            self.cluster = Cluster(
                nodes, self.netns_rate, name=f"sw{os.getpid() % 100000}"
            ).__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.cluster is not None:
            self.cluster.__exit__(*exc)
            self.cluster = None

    def run(self, point: SweepPoint, argv: list[str], log: Path) -> PointRun:
        from scaleout.env.base import free_port
        from scaleout.launchers.local import launch

        kwargs: dict[str, Any] = {"env": {**os.environ, **self.extra_env}}
        if self.cluster is not None:
            kwargs = dict(
                master_addr=self.cluster.addr(0),
                master_port=free_port("0.0.0.0"),
                env={**kwargs["env"], **self.cluster.rank_env()},
                node_wrapper=self.cluster.wrapper,
            )
        with open(log, "w") as out:
            res = launch(
                ["scaleout", *argv],
                point.nodes,
                point.ranks_per_node,
                out=out,
                timeout_s=self.timeout_s,
                **kwargs,
            )
        return PointRun(res.returncode, res.message)


def _scaleout_cmd() -> list[str]:
    """How a Slurm task starts scaleout: the installed entry point, else this interpreter's module."""
    exe = shutil.which("scaleout")
    return [exe] if exe else [sys.executable, "-u", "-m", "scaleout"]


class SlurmRunner:
    """One sbatch job per point (``-N nodes --ntasks-per-node G``), waited for before the next."""

    def __init__(
        self,
        partition: str | None = None,
        time_min: int = 30,
        gpus: bool = True,
        env: dict[str, str] | None = None,
        timeout_s: float | None = None,
        extra: Sequence[str] = (),
        extra_env: dict[str, str] | None = None,
    ):
        self.partition, self.time_min, self.gpus = partition, time_min, gpus
        self.env = (
            env  # None: this process's environment at submission (sbatch exports it to the job)
        )
        self.extra_env = dict(extra_env or {})
        self.timeout_s = timeout_s
        self.extra = list(extra)

    def check(self, points: Sequence[SweepPoint]) -> None:
        if shutil.which("sbatch") is None:
            raise UserError(
                "--launcher slurm: sbatch is not on PATH (is this a Slurm login node? for the local "
                "cluster: scaleout slurm up; export SLURM_CONF=/tmp/scaleout-slurm/etc/slurm.conf)"
            )

    def __enter__(self) -> SlurmRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def sbatch_args(self, point: SweepPoint, argv: list[str], log: Path) -> list[str]:
        srun = ["srun", "--kill-on-bad-exit=1", *_scaleout_cmd(), *argv]
        args = [
            "-N",
            str(point.nodes),
            "--ntasks-per-node",
            str(point.ranks_per_node),
            "--job-name",
            f"sweep-{point.name}",
            "--output",
            str(log),
            "--time",
            str(self.time_min),
            "--chdir",
            os.getcwd(),
        ]
        if self.gpus:  # every rank sees its node's GPUs: per-task device cgroups would block CUDA IPC / NVLink P2P
            args.append(f"--gpus-per-node={point.ranks_per_node}")
        if self.partition:
            args += ["--partition", self.partition]
        return [*args, *self.extra, "--wrap", shlex.join(srun)]

    def run(self, point: SweepPoint, argv: list[str], log: Path) -> PointRun:
        import subprocess

        from scaleout.launchers.slurm import FINAL_STATES, job_info, job_state, sbatch

        env = {**(os.environ if self.env is None else self.env), **self.extra_env}
        job = sbatch(self.sbatch_args(point, argv, log), env=env)
        # Queue wait included: up to 10x the time limit unless --timeout says otherwise.
        deadline = time.monotonic() + (self.timeout_s or 10 * 60 * self.time_min)
        unknown_since: float | None = None
        try:
            while (state := job_state(job, env)) not in FINAL_STATES:
                now = time.monotonic()
                # UNKNOWN = scontrol cannot answer: the controller is gone or has forgotten the job.
                unknown_since = (unknown_since or now) if state == "UNKNOWN" else None
                if unknown_since is not None and now - unknown_since > UNKNOWN_GRACE_S:
                    return PointRun(
                        1,
                        f"Slurm job {job}: no answer from scontrol for {UNKNOWN_GRACE_S:.0f} s "
                        f"(controller down?)",
                    )
                if now > deadline:
                    subprocess.run(["scancel", str(job)], env=env, check=False, capture_output=True)
                    return PointRun(124, f"Slurm job {job} still {state} at the timeout; cancelled")
                time.sleep(0.5)
        except BaseException:  # Ctrl-C / SIGTERM of the sweep: do not leave the job running
            subprocess.run(["scancel", str(job)], env=env, check=False, capture_output=True)
            raise
        code = job_info(job, env=env).get("ExitCode", "?")
        return PointRun(0 if state == "COMPLETED" else 1, f"Slurm job {job} {state} (exit {code})")


class SubmitRunner:
    """One submitit job per point (Slurm when sbatch is on PATH, else submitit's local executor)."""

    def __init__(
        self,
        cluster: str = "auto",
        partition: str | None = None,
        time_min: int = 30,
        gpus: bool = True,
        timeout_s: float | None = None,
        extra_env: dict[str, str] | None = None,
        slurm: dict[str, Any] | None = None,
        entry: Callable[[list[str]], int] | None = None,
    ):
        self.cluster, self.partition, self.time_min, self.gpus = cluster, partition, time_min, gpus
        self.entry = (
            entry  # what each task runs with the point's argv: the CLI's main (given by the CLI)
        )
        self.slurm = dict(slurm or {})  # extra sbatch options (--slurm KEY=VAL)
        self.timeout_s = timeout_s
        self.extra_env = dict(extra_env or {})

    def check(self, points: Sequence[SweepPoint]) -> None:
        from scaleout.launchers.submit import resolve_cluster

        try:
            import submitit  # noqa: F401
        except ImportError:
            raise UserError(
                "--launcher submit needs submitit: pip install 'scaleout[slurm]'"
            ) from None
        if resolve_cluster(self.cluster) != "slurm":
            big = [p.world for p in points if p.nodes > 1]
            if big:
                raise UserError(
                    f"--launcher submit without Slurm runs one node, but world sizes {big} need more "
                    f"than one: use --nodes 1,... or --launcher local"
                )

    def __enter__(self) -> SubmitRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def run(self, point: SweepPoint, argv: list[str], log: Path) -> PointRun:
        from scaleout.launchers.submit import SubmitSpec, submit

        spec = SubmitSpec(
            argv=argv,
            nodes=point.nodes,
            gpus_per_node=point.ranks_per_node,
            request_gpus=self.gpus,
            partition=self.partition,
            time_min=self.time_min,
            cluster=self.cluster,
            folder=str(log.parent / "submitit" / "%j"),
            name=f"sweep-{point.name}",
            extra_slurm=self.slurm,
        )
        saved = {k: os.environ.get(k) for k in self.extra_env}
        os.environ.update(
            self.extra_env
        )  # submitit's executors hand this process's environment to the job
        try:
            (job,) = submit(spec, self.entry)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        try:
            while not job.done():
                if deadline is not None and time.monotonic() > deadline:
                    job.cancel()
                    return PointRun(124, f"submitit job {job.job_id} timed out; cancelled")
                time.sleep(0.5)
        except BaseException:  # Ctrl-C / SIGTERM of the sweep: do not leave the job running
            job.cancel(check=False)
            raise
        try:
            job.results()
        except Exception as exc:  # noqa: BLE001 -- one line: the failing rank's error
            lines = [ln for ln in str(exc).splitlines() if ln.strip()] or [type(exc).__name__]
            return PointRun(
                1,
                f"submitit job {job.job_id} failed: {lines[-1].strip()} (logs {log.parent}/submitit)",
            )
        return PointRun(0, f"submitit job {job.job_id} completed")


def _finished(point: SweepPoint, pdir: Path, argv: list[str]) -> PointResult | None:
    """The result of an earlier run of exactly ``argv`` in ``pdir`` if it finished well, else None."""
    try:
        done = json.loads((pdir / POINT_FILE).read_text())
    except (OSError, ValueError):
        return None
    if done.get("argv") != argv:
        return None
    res = read_point(point, pdir / "report.json", float(done.get("wall_s", 0.0)))
    return res if res.ok else None


def make_runner(launcher: str, **kwargs: Any) -> LocalRunner | SlurmRunner | SubmitRunner:
    slurm = kwargs.get("slurm") or {}
    if launcher == "local":
        if slurm:
            raise UserError(
                f"--slurm {', '.join(slurm)}: sbatch options need --launcher slurm or submit"
            )
        return LocalRunner(
            netns_rate=kwargs.get("netns_rate"),
            timeout_s=kwargs.get("timeout_s"),
            extra_env=kwargs.get("extra_env"),
        )
    if kwargs.get("netns_rate") is not None:
        raise UserError(f"--netns works with --launcher local, not {launcher}")
    common = dict(
        partition=kwargs.get("partition"),
        time_min=kwargs.get("time_min", 30),
        gpus=kwargs.get("gpus", True),
        timeout_s=kwargs.get("timeout_s"),
        extra_env=kwargs.get("extra_env"),
    )
    if launcher == "slurm":
        from scaleout.launchers.submit import sbatch_flags

        return SlurmRunner(env=kwargs.get("env"), extra=sbatch_flags(slurm), **common)
    if launcher == "submit":
        return SubmitRunner(
            cluster=kwargs.get("cluster", "auto"), slurm=slurm, entry=kwargs.get("entry"), **common
        )
    raise UserError(f"--launcher={launcher!r}: expected one of {', '.join(LAUNCHERS)}")


def run_sweep(
    runner: LocalRunner | SlurmRunner | SubmitRunner,
    points: Sequence[SweepPoint],
    config: str,
    overrides: Sequence[str],
    steps: int,
    warmup: int,
    out_dir: str | Path,
    extra_overrides: Sequence[str] = (),
    progress: Callable[[str], None] = print,
    repeats: int = 1,
    resume: bool = False,
) -> list[PointResult]:
    """Run every point in order, ``repeats`` rounds; a failed run is recorded (with its log's tail) and the
    sweep goes on. Returns one result per point: the median-step-time run of its rounds.

    ``resume``: a run whose folder already holds a good report of the very same command (``point.json``
    records it) is read instead of run again, so an interrupted sweep continues where it stopped."""
    if repeats < 1:
        raise UserError(f"--repeats={repeats}: expected an integer >= 1")
    out = Path(out_dir).resolve()
    runs: dict[SweepPoint, list[PointResult]] = {p: [] for p in points}
    total = len(points) * repeats
    with runner:
        if isinstance(runner, LocalRunner):
            runner.start_cluster(max(p.nodes for p in points))
        for k, (rnd, p) in enumerate(((r, p) for r in range(repeats) for p in points), 1):
            i = f"{k}/{total}"
            pdir = out / "points" / p.name / (f"round{rnd + 1}" if repeats > 1 else "")
            pdir.mkdir(parents=True, exist_ok=True)
            report = pdir / "report.json"
            argv = [
                "train",
                config,
                *overrides,
                *extra_overrides,
                *point_overrides(p, steps, warmup, str(pdir)),
            ]
            done = _finished(p, pdir, argv) if resume else None
            if done is not None:
                progress(
                    f"[{i}] world {p.world}: done before (--resume), {done.step_s * 1e3:.1f} ms/step, "
                    f"{done.samples_per_s:.1f} samples/s ({report})"
                )
                runs[p].append(done)
                continue
            report.unlink(missing_ok=True)  # never read a previous sweep's report as this one's
            (pdir / POINT_FILE).unlink(missing_ok=True)
            progress(
                f"[{i}] world {p.world} = {p.nodes} node(s) x {p.ranks_per_node}, global batch "
                f"{p.global_batch} ({p.per_rank_batch}/rank), {steps} steps: running (log {pdir / 'launch.log'})"
            )
            t0 = time.perf_counter()
            run = runner.run(p, argv, pdir / "launch.log")
            wall = time.perf_counter() - t0
            if run.returncode != 0:
                res = PointResult(p, f"failed: {run.message}", wall)
                tail = _tail(pdir / "launch.log")
                progress(
                    f"[{i}] world {p.world}: FAILED after {wall:.1f} s: {run.message}"
                    + (f"\n{tail}" if tail else "")
                )
            else:
                res = read_point(p, report, wall)
                if res.ok:
                    (pdir / POINT_FILE).write_text(json.dumps({"argv": argv, "wall_s": wall}))
                    progress(
                        f"[{i}] world {p.world}: done in {wall:.1f} s: {res.step_s * 1e3:.1f} "
                        f"ms/step, {res.samples_per_s:.1f} samples/s"
                    )
                else:
                    progress(f"[{i}] world {p.world}: {res.status}")
            runs[p].append(res)
    return [median_run(runs[p]) for p in points]
