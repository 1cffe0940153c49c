"""Every `examples:` line of every `scaleout ... --help` pastes: joined where it continues with a
trailing backslash, it parses with the real parser (usability review §2: examples split in the
middle of a command, or naming flags that no longer exist, fail here in milliseconds)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import shlex

import pytest

from scaleout.cli import build_parser

pytestmark = pytest.mark.unit


def parsers(
    parser: argparse.ArgumentParser, command: str = ""
) -> list[tuple[str, argparse.ArgumentParser]]:
    out = [(command, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += parsers(sub, f"{command} {name}".strip())
    return out


def examples(text: str) -> list[str]:
    """The command lines under an ``examples:`` heading (to the next blank-line-separated
    paragraph that does not start with a command), continuation lines joined."""
    lines, out, on = text.splitlines(), [], False
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip().lower().startswith("examples"):
            on = True
        elif on and line.strip() and not line.startswith(" "):
            on = False
        elif on and line.strip():
            cmd = line.strip()
            while cmd.endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd = cmd[:-1].rstrip() + " " + lines[i].strip()
            out.append(cmd)
        i += 1
    return out


def argv_of(line: str) -> list[str] | None:
    """The words after the first `scaleout` of a command line (srun/sbatch prefixes, `# ...`
    comments and `VAR=value` prefixes dropped); None when it runs no `scaleout`."""
    words = shlex.split(line, comments=True)
    if "scaleout" not in words:
        return None
    return words[words.index("scaleout") + 1 :]


@functools.cache
def parser() -> argparse.ArgumentParser:
    """One parser for every case: parse_args keeps no state between calls."""
    return build_parser()


def all_examples() -> list[tuple[str, str]]:
    out = []
    for command, p in parsers(parser()):
        for ex in examples((p.description or "") + "\n" + (p.epilog or "")):
            out.append((command or "scaleout", ex))
    return out


def test_there_are_examples_to_check() -> None:
    got = all_examples()
    assert len(got) >= 30 and {c for c, _ in got} >= {"train", "launch", "plan"}


@pytest.mark.parametrize(("command", "line"), all_examples())
def test_each_help_example_parses(command: str, line: str) -> None:
    argv = argv_of(line)
    if argv is None:
        return  # a shell line around the commands (e.g. `sbatch slurm/x.sh`)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            parser().parse_args(argv)
        except SystemExit as e:
            pytest.fail(
                f"`scaleout {command} --help` example does not parse: {line!r}: "
                f"{err.getvalue().strip().splitlines()[-1:]} (exit {e.code})"
            )
