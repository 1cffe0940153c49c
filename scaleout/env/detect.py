"""The registry of launcher environments and the one detection rule: by ``priority``, first match
wins.

``launch.env`` in the config, ``--env`` on ``scaleout smoke`` or ``SCALEOUT_ENV`` names one instead.
Everything that lists the environments (the schema's choices, the CLI help, the README table,
scaleout.log's rank variables) reads this registry, so a new environment is one file that calls
:func:`register`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from scaleout.env.base import Environment
from scaleout.errors import LaunchEnvError
from scaleout.registry import Registry, RegistryError

ENVIRONMENTS: Registry[Environment] = Registry("launcher environment")


def register(cls: type[Environment]) -> type[Environment]:
    """Class decorator: register one instance of ``cls`` under ``cls.name``. Refuses a taken
    name, and a taken priority (two environments tried in an unspecified order would be a silent
    bug)."""
    for other_name, other in ENVIRONMENTS.items():
        if other.priority == cls.priority:
            raise RegistryError(
                f"launcher environment {cls.name!r}: priority {cls.priority} is already "
                f"{other_name!r}'s; choose another"
            )
    ENVIRONMENTS.register(cls.name, cls())
    return cls


def detection_order() -> tuple[str, ...]:
    """The registered environments, in the order they are tried (by priority)."""
    return tuple(sorted(ENVIRONMENTS, key=lambda name: ENVIRONMENTS.get(name).priority))


def rank_variables() -> tuple[str, ...]:
    """Where this process's global rank is, before any World exists (scaleout.log), in detection
    order."""
    return tuple(v for name in detection_order() for v in ENVIRONMENTS.get(name).rank_vars)


def detect_environment(
    env: Mapping[str, str] | None = None, explicit: str | None = None
) -> Environment:
    """The environment to read: ``explicit`` (or SCALEOUT_ENV) if given and not 'auto', else the
    first one whose ``detect`` matches, by priority."""
    env = os.environ if env is None else env
    choice = explicit if explicit not in (None, "auto") else env.get("SCALEOUT_ENV")
    if choice not in (None, "", "auto"):
        if choice not in ENVIRONMENTS:
            raise LaunchEnvError(
                f"launch.env={choice!r}: expected one of auto, {', '.join(detection_order())}"
            )
        return ENVIRONMENTS.get(choice)
    for name in detection_order():
        if ENVIRONMENTS.get(name).detect(env):
            return ENVIRONMENTS.get(name)
    raise LaunchEnvError(
        "no launcher environment matches (the 'single' environment, which always does, is missing)"
    )
