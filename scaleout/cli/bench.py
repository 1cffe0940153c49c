"""scaleout bench <name>: the lab group -- the benchmarks, discovered from scaleout/bench/*.py, and
the lab tools among the CLI's modules (``GROUP = "bench"``: the emulated netns cluster)."""

from __future__ import annotations

import argparse
from types import ModuleType

NAME = "bench"
ORDER = 60
HELP = (
    "benchmarks (allreduce, overlap, optim, packing, ttt, ...) and lab tools (cluster: the "
    "emulated netns cluster)"
)


def benches() -> list[ModuleType]:
    """Every benchmark module (scaleout/bench/<name>.py; helpers are ``_``-prefixed), by name."""
    import scaleout.bench as pkg
    from scaleout.cli import discover

    return sorted(discover(pkg), key=lambda m: m.NAME)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from scaleout.cli import grouped

    sub = p.add_subparsers(dest="bench", metavar="<benchmark>", parser_class=type(p))
    for mod in sorted([*benches(), *grouped(NAME)], key=lambda m: m.NAME):
        bp = sub.add_parser(
            mod.NAME,
            help=mod.HELP,
            description=getattr(mod, "DESCRIPTION", mod.HELP),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        mod.add_arguments(bp)
        bp.set_defaults(_bench_run=mod.run, _name=f"{NAME} {mod.NAME}")  # errors name it
    p.set_defaults(_bench_parser=p)


def run(args: argparse.Namespace) -> int:
    if not getattr(args, "bench", None):
        args._bench_parser.print_help()
        return 2
    return int(args._bench_run(args) or 0)
