"""scaleout config show | resnet-rcp: print a config after overrides and validation, or write a
ResNet config from MLPerf's RCP hyper-parameter table."""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "config"
ORDER = 20
HELP = "show a config (YAML + a.b=c overrides) after validation; write RCP-backed ResNet configs"
DESCRIPTION = """\
scaleout config list
scaleout config show CONFIG [key=value ...] [--world N --nproc-per-node G]
scaleout config resnet-rcp --global-batch N --nnodes N --nproc-per-node G [--out FILE]

list: the shipped configs (name, family, nodes x GPUs per node, global batch, what it is); any of
them is a CONFIG for show, train, launch and the slurm/ scripts. Recipes: docs/recipes.md.

show: loads CONFIG (a path, or a name in configs/), applies overrides such as optim.lr=2e-3 or
comm.algorithm=torus2d, validates every key and prints the resolved tree. With --world it also runs
the checks that need the world size (global batch divisibility, torus grid, group-BN size).

resnet-rcp: the flagship ResNet-50 config (configs/resnet50_128x8.yaml) with the hyper-parameters of
MLPerf's reference convergence point at that global batch (mlperf_logging's rcps_resnet.json: LARS
lr, warm-up, momentum, weight decay, decay steps, BN span); a batch without an RCP is refused with
the list of those that have one. See scaleout/families/resnet/rcp.py.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="<action>", parser_class=type(p))
    sub.add_parser("list", help="the shipped configs: family, nodes x GPUs, batch, description")
    show = sub.add_parser("show", help="print a config after overrides and validation")
    show.add_argument(
        "config",
        nargs="?",
        default=None,
        help="config file or name in configs/ (default: built-in defaults)",
    )
    show.add_argument("overrides", nargs="*", help="key=value overrides, e.g. optim.lr=2e-3")
    show.add_argument("--world", type=int, default=None, help="also check against this world size")
    show.add_argument(
        "--nproc-per-node", type=int, default=None, help="ranks per node for the --world checks"
    )
    rcp = sub.add_parser(
        "resnet-rcp", help="write a ResNet-50 config from MLPerf's RCP table for a global batch"
    )
    rcp.add_argument("--global-batch", type=int, required=True, help="an RCP batch, e.g. 32768")
    rcp.add_argument("--nnodes", type=int, required=True, help="nodes")
    rcp.add_argument(
        "--nproc-per-node", type=int, required=True, help="ranks per node, one GPU each"
    )
    rcp.add_argument("--out", default=None, help="write the YAML here (default: stdout)")
    p.set_defaults(_config_parser=p)


def run(args: argparse.Namespace) -> int:
    if args.action == "resnet-rcp":
        return _resnet_rcp(args)
    if args.action == "list":
        from scaleout.config.catalog import shipped, table_rows
        from scaleout.output import format_table

        headers = ["config", "family", "nodes x GPUs", "global batch", "description"]
        print(format_table(headers, table_rows(shipped())))
        return 0
    if args.action != "show":
        args._config_parser.print_help()
        return 2
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


def _resnet_rcp(args: argparse.Namespace) -> int:
    import yaml

    from scaleout.config.load import _read_yaml, resolve_config_path
    from scaleout.config.schema import Config
    from scaleout.families.resnet.rcp import rcp_config, rcp_header

    base = _read_yaml(resolve_config_path("resnet50_128x8"))
    tree = rcp_config(args.global_batch, args.nnodes, args.nproc_per_node, base)
    cfg = Config.model_validate(tree)  # the generated tree is a valid config
    cfg.check_world(args.nnodes * args.nproc_per_node, args.nproc_per_node)
    text = rcp_header(args.global_batch, args.nnodes, args.nproc_per_node, tree)
    text += yaml.safe_dump(tree, sort_keys=False)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0
