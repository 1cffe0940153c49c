"""The hang verdict's line: what a rank whose collective failed prints, and what a launcher reads
back from the ranks' output to name the root cause in its own last line.

A rank prints ``scaleout: rank 1 (node 0, local rank 1): verdict: <sentence>``
(scaleout/train/liveness.py says how the sentence is found); every failing rank prints the same
sentence. The launcher (launchers/local.py, and netns through it) keeps the first one it sees and
puts it in front of "rank 1 ... exited with code 1": the rank that exited first is usually one that
merely timed out waiting for the culprit. Standard library only: the launcher imports no torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_LINE = re.compile(r"^scaleout: rank \d+ \([^)]*\): verdict: (?P<text>.+?)\s*$")


def verdict_line(where: str, text: str) -> str:
    """The line a rank prints: ``where`` is this rank (liveness.describe_rank), ``text`` the
    verdict."""
    return f"scaleout: {where}: verdict: {text}"


def read_verdict(line: str) -> str | None:
    """The verdict in one line of a rank's output (without the launcher's ``[rank N]`` prefix),
    or None when the line is not one."""
    m = _LINE.match(line)
    return m.group("text") if m else None


def first_verdict(lines: Iterable[str]) -> str | None:
    """The first verdict among a job's output lines (e.g. a Slurm job's output file)."""
    for line in lines:
        text = read_verdict(line)
        if text is not None:
            return text
    return None
