"""Launcher environments -> :class:`WorldSpec`. See ``readers`` for the detection order."""

from scaleout.env.base import Environment, WorldSpec, free_port
from scaleout.env.readers import DETECTION_ORDER, ENVIRONMENTS, detect_environment

__all__ = [
    "Environment",
    "WorldSpec",
    "free_port",
    "ENVIRONMENTS",
    "DETECTION_ORDER",
    "detect_environment",
]
