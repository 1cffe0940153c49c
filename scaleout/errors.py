"""Errors that reach the user as one line.

``UserError`` is for bad input (config, CLI flag, histogram file, nodelist, grid): the CLI prints
``scaleout <command>: error: <message>`` and exits 2 without a traceback. Anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import reprlib


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


# How much of an offending value a one-line error echoes: enough to recognise it, never megabytes.
EXCERPT_CHARS = 80


def excerpt(value: object, limit: int = EXCERPT_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters, on one line (a long string says its length)."""
    size = len(value) if isinstance(value, (str, bytes)) else None
    # reprlib bounds the work too: a nested value is cut at depth and width, never walked whole
    shown = reprlib.Repr()
    shown.maxlevel, shown.maxlist, shown.maxdict = 3, 8, 8
    shown.maxstring = shown.maxother = shown.maxlong = limit - 6  # the quotes and the ellipsis
    text = shown.repr(value).replace("\n", "\\n")
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    if size is not None and size > limit:
        text += f" ({size:,} chars)"
    return text


# The longest one-line error the CLI prints: the longest written messages (an unknown key with the
# section's keys) are ~400 characters; past this a message holds a value, not words.
MESSAGE_CHARS = 600


def one_line(message: str, limit: int = MESSAGE_CHARS) -> str:
    """``message`` on one line and at most ``limit`` characters: the net under every error the CLI
    prints, for a value some message echoes whole (its head and tail stay, the middle goes)."""
    text = " ".join(message.split("\n"))
    if len(text) <= limit:
        return text
    cut = f" ...({len(text):,} chars in all)... "
    head = (limit - len(cut)) * 2 // 3
    return text[:head] + cut + text[-(limit - len(cut) - head) :]
