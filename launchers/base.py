"""The one launcher interface: start ranks, wait, get a result that names the failed rank.

torch.distributed.elastic's agent and ``RunResult`` / ``WorkerState``, cut down::

    launcher = LAUNCHERS.get("local")()            # or make_launcher("slurm", LaunchOptions(...))
    with launcher:                                 # holds what several starts share (netns'
    cluster)
        job = launcher.start(["scaleout", "train", "cfg.yaml"], nnodes=2, nproc_per_node=2)
        result = job.wait(timeout_s=600)           # LaunchResult(returncode, failed, message,
        state)

Implementations register in :data:`LAUNCHERS` (``local``: processes as emulated nodes; ``netns``:
the same inside network namespaces; ``slurm``: sbatch + srun; ``submit``: submitit). ``scaleout
launch``, ``scaleout submit``, the sweep and ``scaleout bench ttt`` start ranks only through them.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

from scaleout.errors import UserError
from scaleout.registry import Registry

# How a launch ended: every rank exited 0; one rank failed (named in ``failed`` when the launcher
# knows it); the launcher was told to stop (a signal, a cancelled job); or the wait's timeout
# expired.
LaunchState = Literal["succeeded", "failed", "stopped", "timed_out"]
EXIT_TIMED_OUT = 124  # timeout(1)'s code, which the launchers return when a wait times out


@dataclass(frozen=True)
class RankExit:
    """The first rank that failed: where it ran and how it ended (a negative code: killed by a
    signal)."""

    rank: int
    node: int
    local_rank: int
    returncode: int

    @classmethod
    def of(cls, rank: int, nproc_per_node: int, returncode: int) -> RankExit:
        node, local = divmod(rank, nproc_per_node)
        return cls(rank, node, local, returncode)

    def describe(self) -> str:
        return f"rank {self.rank} (node {self.node}, local rank {self.local_rank}) {self.how()}"

    def how(self) -> str:
        """How it ended: "exited with code N" or "was killed by SIGNAL"."""
        if self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            return f"was killed by {name}"
        return f"exited with code {self.returncode}"


@dataclass(frozen=True)
class LaunchResult:
    """How a launch ended: the launcher's exit code, the failed rank (None when all succeeded or the
    launcher cannot tell which), one line for the user, the state, and the ranks' verdict."""

    returncode: int
    failed: RankExit | None
    message: str
    state: LaunchState = "succeeded"
    # the failing ranks' hang verdict (scaleout/goodput/verdict.py) when they printed one: the root
    # cause,
    # which ``message`` names first (``failed`` is only the first rank to exit)
    verdict: str | None = None

    @property
    def ok(self) -> bool:
        return self.state == "succeeded"


class Job(Protocol):
    """Ranks that a launcher started."""

    def wait(self, timeout_s: float | None = None) -> LaunchResult:
        """Block until every rank has exited (or ``timeout_s``: stop them, state "timed_out")."""
        ...

    def stop(self) -> None:
        """Stop every rank now (SIGTERM then SIGKILL, scancel, job.cancel)."""
        ...


@dataclass
class LaunchOptions:
    """What a tool (the sweep, bench ttt) may ask of any launcher. Each launcher takes what
    applies to it and refuses, in one line, an option it cannot honour (sbatch options for a
    local launch...)."""

    extra_env: dict[str, str] = field(default_factory=dict)  # added to every rank's environment
    rate: str | None = None  # netns: each emulated node's link rate (tc units)
    partition: str | None = None  # slurm, submit
    time_min: int = 30  # slurm, submit: the job's time limit
    gpus: bool = True  # slurm, submit: ask for one GPU per rank
    slurm: dict[str, Any] = field(default_factory=dict)  # slurm, submit: extra sbatch options
    cluster: str = "auto"  # submit: submitit's executor (auto, slurm, local, debug)
    entry: Callable[[list[str]], int] | None = None  # submit: what a task runs (the CLI's main)
    env: Mapping[str, str] | None = None  # slurm: the environment sbatch exports (None: this one's)


class Launcher:
    """Start ``nnodes`` x ``nproc_per_node`` ranks of one command. Subclasses set ``name``,
    implement :meth:`start` and :meth:`from_options`; ``prepare``/``close`` hold resources across
    starts."""

    name: ClassVar[str] = "base"

    @classmethod
    def from_options(cls, options: LaunchOptions) -> Launcher:
        raise NotImplementedError

    def check(self, shapes: Sequence[tuple[int, int]]) -> None:
        """One-line errors, before anything starts, for (nnodes, nproc_per_node) shapes this
        launcher cannot run here."""

    def prepare(self, max_nnodes: int) -> None:
        """Set up what the coming starts share, sized for the largest (netns: its cluster)."""

    def close(self) -> None:
        """Release what :meth:`prepare` set up."""

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(
        self,
        argv: Sequence[str],
        nnodes: int,
        nproc_per_node: int,
        *,
        log: Path | None = None,
        name: str = "scaleout",
    ) -> Job:
        """Start every rank of ``argv`` (``scaleout ...``, a ``.py`` file or a program). ``log``:
        where the ranks' output goes (None: this process's stdout, or the launcher's own log
        files); ``name``: the job's name where the launcher has one."""
        raise NotImplementedError


LAUNCHERS: Registry[type[Launcher]] = Registry("launcher")


def register(cls: type[Launcher]) -> type[Launcher]:
    """Class decorator: register ``cls`` under ``cls.name`` (a taken name is refused)."""
    return LAUNCHERS.register(cls.name, cls)


def make_launcher(name: str, options: LaunchOptions | None = None) -> Launcher:
    """The registered launcher ``name``, configured from ``options``."""
    try:
        cls = LAUNCHERS.get(name)
    except UserError:
        raise UserError(f"--launcher={name!r}: expected one of {', '.join(LAUNCHERS)}") from None
    return cls.from_options(options or LaunchOptions())
