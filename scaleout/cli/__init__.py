"""The ``scaleout`` command line.

Every subcommand is a module in this package (``scaleout/cli/<name>.py``) that defines

    NAME: str                      # the subcommand, e.g. "launch"
    HELP: str                      # one line for ``scaleout --help``
    def add_arguments(parser)      # argparse options
    def run(args) -> int           # exit code

and optionally ``ORDER: int`` (its place in ``scaleout --help``; default 50), ``DESCRIPTION: str``
(the long ``--help`` text; default HELP), ``preflight(args, world_size, ranks_per_node)`` (checks
a command line for a world before a launcher spawns any rank; raises UserError) and ``GROUP: str``:
the command it sits under instead of the top level (``"bench"``: the lab group, ``scaleout bench
cluster``; ``"data"``: ``scaleout data pack``).

The product and the lab are two surfaces: the top level holds the verbs a user runs; benchmarks and
lab tools (the emulated netns cluster) sit under ``scaleout bench``, listed apart in ``scaleout
--help`` so they do not crowd it (tests/cli/test_cli_surface.py keeps the user CLI's flag count and
one
meaning per flag name).

Modules are discovered, so adding a subcommand touches no shared file. Command modules import heavy
libraries (torch, launchers) inside ``run`` so that ``scaleout --help`` stays fast.

The CLI is the one place allowed to use both ``scaleout`` (what runs in a rank) and ``launchers``
(what starts ranks): it resolves a command and checks it (:func:`preflight`), then hands a launcher
an argv and that check; launchers never import the CLI. See README "Architecture".
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import io
import pkgutil
import sys
import textwrap
from collections.abc import Callable
from types import ModuleType

from scaleout import __version__
from scaleout.errors import UserError, excerpt, one_line


def discover(package: ModuleType) -> list[ModuleType]:
    """The modules of ``package`` that define ``NAME`` and ``run`` (names starting with ``_`` are
    private helpers), ordered by their optional ``ORDER`` (default 50), then name."""
    mods = []
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{package.__name__}.{info.name}")
        if hasattr(mod, "NAME") and hasattr(mod, "run"):
            mods.append(mod)
    return sorted(mods, key=lambda m: (getattr(m, "ORDER", 50), m.NAME))


def subcommands() -> list[ModuleType]:
    """Every top-level ``scaleout`` subcommand module (see the module docstring for what each
    defines); the lab group ``bench`` is one of them."""
    return [m for m in discover(sys.modules[__name__]) if not hasattr(m, "GROUP")]


def grouped(parent: str) -> list[ModuleType]:
    """The command modules that sit under ``parent`` (their ``GROUP``), e.g. ``bench cluster``."""
    return [m for m in discover(sys.modules[__name__]) if getattr(m, "GROUP", None) == parent]


#: The command that holds the benchmarks and lab tools, listed apart from the user's verbs.
LAB = "bench"


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``scaleout X: error: <what> (see 'scaleout X --help')``."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="scaleout",
        description="Max-scale data-parallel training: launch ranks, train to target, plan and "
        "simulate the scale.",
        epilog="lab (benchmarks and test tools, apart from the commands above):\n"
        + textwrap.fill(_lab_help(), 80, initial_indent=f"  {LAB:<10}", subsequent_indent=" " * 12)
        + "\n\nRun 'scaleout <command> --help' for a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )

    parser.add_argument("--version", action="version", version=f"scaleout {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>", parser_class=_Parser)
    for mod in subcommands():
        # The lab group gets no help= here: argparse then leaves it out of the command list, and
        # the epilog names it in its own section.
        shown = {} if mod.NAME == LAB else {"help": mod.HELP}
        p = sub.add_parser(
            mod.NAME,
            **shown,
            description=getattr(mod, "DESCRIPTION", mod.HELP),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run, _name=mod.NAME)
    return parser


def _lab_help() -> str:
    return next(m.HELP for m in subcommands() if m.NAME == LAB)


def resolve(cmd: list[str]) -> tuple[list[str], Callable[[int, int], None] | None]:
    """A rank command as a launcher takes it: a bare subcommand (``smoke``) becomes ``scaleout
    smoke``; with the check of a ``scaleout`` command line for a world (:func:`preflight`), else
    None."""
    cmd = list(cmd)
    if cmd and cmd[0] in {m.NAME for m in subcommands()}:
        cmd = ["scaleout", *cmd]
    elif cmd[:1] in (["python"], ["python3"]) and cmd[1:3] == ["-m", "scaleout"]:
        cmd = ["scaleout", *cmd[3:]]
    if not cmd or cmd[0] != "scaleout":
        return cmd, None
    return cmd, functools.partial(preflight, cmd[1:])


def preflight(argv: list[str], world_size: int, ranks_per_node: int) -> None:
    """Validate a ``scaleout <subcommand> ...`` command line for a world before any rank is spawned.

    Launchers call this so that a bad config or flag is one line on the launcher's stderr instead of
    the same error from every rank. A subcommand opts in by defining
    ``preflight(args, world_size, ranks_per_node)``; it raises UserError on bad input.
    """
    if not argv:
        return
    mods = {m.NAME: m for m in subcommands()}
    mod = mods.get(argv[0])
    if mod is None:  # every rank would print argparse's error: say it once, here
        raise UserError(
            f"command 'scaleout {excerpt(argv[0])[1:-1]}': no such subcommand; expected one of "
            f"{', '.join(sorted(mods))}"
        )
    # Every subcommand's flags are parsed here, once, so a bad flag is one line from the launcher
    # rather than argparse's usage error from each rank; argparse's own line is kept as the cause.
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            args = build_parser().parse_args(argv)
    except SystemExit as exc:
        if not exc.code:  # --help: nothing wrong
            return
        cause = said.getvalue().strip().splitlines()[-1:] or ["invalid arguments"]
        raise UserError(f"rank command: {cause[0]}") from exc
    if hasattr(mod, "preflight"):
        mod.preflight(args, world_size, ranks_per_node)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args._argv = list(
        sys.argv[1:] if argv is None else argv
    )  # for commands that re-launch themselves
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except UserError as exc:
        print(f"scaleout {args._name}: error: {one_line(str(exc))}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
