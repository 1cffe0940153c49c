"""The hang verdict's line: what a rank whose collective failed prints, and what a launcher reads
back from the ranks' output to name the root cause in its own last line.

A rank prints ``scaleout: rank 1 (node 0, local rank 1): verdict: <sentence>``
(scaleout/train/liveness.py says how the sentence is found); every failing rank prints the same
sentence. The launcher (launchers/local.py, and netns through it) keeps the first one it sees and
puts it in front of "rank 1 ... exited with code 1": the rank that exited first is usually one that
merely timed out waiting for the culprit. A rank the peers can only call silent ("sent no
heartbeat: stopped, hung or dead") but the launcher saw end (its exit code; srun's "task 3:
Killed" in an sbatch job's output) crashed: :func:`with_exits` says so, and how. Standard library
only: the launcher imports no torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

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


_NO_BEAT = re.compile(r"^(?P<who>.+?) sent no heartbeat for (?P<s>\d+) s: stopped, hung or dead$")
_NAMED = re.compile(r"\brank (\d+) \(node ")


def with_exits(text: str, exits: Mapping[int, str]) -> str:
    """A "sent no heartbeat" verdict completed with what the launcher knows: ``exits`` maps the
    ranks that ended on their own (before the launcher stopped any) to how ("exited with code 1",
    "was killed by SIGKILL"). A named rank among them did not hang: it crashed, and the sentence
    says so instead of "stopped, hung or dead". Any other verdict is returned as it is."""
    m = _NO_BEAT.match(text)
    if m is None:
        return text
    named = [int(r) for r in _NAMED.findall(m.group("who"))]
    ended = [r for r in named if r in exits]
    if not ended:
        return text
    how = ", ".join(f"rank {r} {exits[r]}" for r in ended)
    if len(ended) == len(named) and " more" not in m.group("who"):
        return f"{m.group('who')} crashed ({how}): its heartbeat ended with it"
    return (
        f"{m.group('who')} sent no heartbeat for {m.group('s')} s: {how} (crashed), the others "
        "stopped, hung or dead"
    )


# srun's report of a task that ended badly ("srun: error: n2: task 3: Killed", "srun: error: n1:
# tasks 0-1: Exited with exit code 1"), and srun ending the step itself (what it kills after that
# line is its own doing)
_SRUN_TASK = re.compile(r"^srun: error: (?P<host>\S+): tasks? (?P<tasks>[\d,-]+): (?P<how>.+)$")
_SRUN_TERMINATING = re.compile(r"Terminat(ing|ed) StepId|Job step aborted", re.IGNORECASE)


def srun_exits(lines: Iterable[str]) -> dict[int, str]:
    """Rank -> how it ended, from srun's lines in a job's output, up to srun ending the step:
    the ``exits`` of :func:`with_exits` (an sbatch job's launcher knows no exit codes itself)."""
    out: dict[int, str] = {}
    for line in lines:
        if _SRUN_TERMINATING.search(line):
            break
        m = _SRUN_TASK.match(line.strip())
        if m is None:
            continue
        for part in m.group("tasks").split(","):
            lo, _, hi = part.partition("-")
            if lo.isdigit() and (not hi or hi.isdigit()):
                for r in range(int(lo), int(hi or lo) + 1):
                    out.setdefault(r, f"ended on {m.group('host')}: {m.group('how')}")
    return out
