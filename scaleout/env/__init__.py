"""Launcher environments -> :class:`WorldSpec`: one file per environment, registered in
``ENVIRONMENTS``.

Each environment declares its name, its ``priority`` (the detection order: lower is tried first) and
the variables it reads; importing this package registers the built-in ones (the import line below).
Torch-free: the config schema reads the registry.
"""

from scaleout.env import horovod, local, mpi, single, slurm, torchrun  # noqa: F401  (they register)
from scaleout.env.base import Environment, WorldSpec, free_port
from scaleout.env.detect import (
    ENVIRONMENTS,
    detect_environment,
    detection_order,
    rank_variables,
    register,
)

__all__ = [
    "ENVIRONMENTS",
    "Environment",
    "WorldSpec",
    "detect_environment",
    "detection_order",
    "free_port",
    "rank_variables",
    "register",
]
