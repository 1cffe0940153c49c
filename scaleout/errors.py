"""Errors that reach the user as one line.

``UserError`` is for bad input (config, CLI flag, histogram file, nodelist, grid): the CLI prints
``scaleout <command>: error: <message>`` and exits 2 without a traceback. Anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input, reported as a single line that names the offending value and what was expected."""


class ConfigError(UserError):
    """A config key is unknown, has the wrong type or an impossible value."""


class NodelistError(UserError):
    """A Slurm nodelist that does not follow the hostlist grammar."""


class LaunchEnvError(UserError):
    """Launcher variables that are missing or inconsistent."""


class TopologyError(UserError):
    """A process-group layout that the world cannot have (grid size, unequal ranks per node)."""
