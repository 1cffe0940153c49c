"""scaleout config show: print a config after overrides and validation."""

from __future__ import annotations

import argparse

NAME = "config"
ORDER = 20
HELP = "show a config (YAML + a.b=c overrides) after validation"
DESCRIPTION = """\
scaleout config show CONFIG [key=value ...] [--world N --nproc-per-node G]

Loads CONFIG (a path, or a name in configs/), applies overrides such as optim.lr=2e-3 or
comm.algorithm=torus2d, validates every key and prints the resolved tree. With --world it also runs
the checks that need the world size (global batch divisibility, torus grid, group-BN size).
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["show"], help="what to do (show)")
    p.add_argument(
        "config",
        nargs="?",
        default=None,
        help="config file or name in configs/ (default: built-in defaults)",
    )
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. optim.lr=2e-3")
    p.add_argument("--world", type=int, default=None, help="also check against this world size")
    p.add_argument(
        "--nproc-per-node", type=int, default=None, help="ranks per node for the --world checks"
    )


def run(args: argparse.Namespace) -> int:
    from scaleout.config import format_config, load_config

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:
        overrides.insert(0, config)
        config = None
    cfg = load_config(config, overrides)
    if args.world is not None:
        cfg.check_world(args.world, args.nproc_per_node)
    print(format_config(cfg), end="")
    return 0
