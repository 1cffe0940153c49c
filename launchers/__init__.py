"""What runs outside the ranks and starts them. Depends on ``scaleout``; never the other way round.

Every launcher implements :class:`launchers.base.Launcher` and registers in :data:`LAUNCHERS`:
importing this package registers local, netns, slurm and submit.
"""

from scaleout.launchers import local, netns_launcher, slurm, submit  # noqa: F401 (they register)
from scaleout.launchers.base import (
    LAUNCHERS,
    Job,
    Launcher,
    LaunchOptions,
    LaunchResult,
    RankExit,
    make_launcher,
    register,
)

__all__ = [
    "LAUNCHERS",
    "Job",
    "LaunchOptions",
    "LaunchResult",
    "Launcher",
    "RankExit",
    "make_launcher",
    "register",
]
