"""scaleout mlperf rcp: the real mlperf_logging RCP checker over seed logs."""

from __future__ import annotations

import argparse

NAME = "mlperf"
ORDER = 65
HELP = "MLPerf log checks: RCP convergence over seed runs"
DESCRIPTION = """\
scaleout mlperf rcp LOG_OR_DIR [...] [--benchmark B] [--ruleset V] [--rcp-file JSON]

rcp: mlperf_logging.rcp_checker over N seed runs (a closed-division result needs 5 for ResNet):
each argument is an mlperf.log, or a directory whose mlperf.log files (one run directory per seed)
and result_*.txt files are taken; the last attempt of each log counts. Passes when the seeds'
olympic mean of epochs to converge is no faster than the reference convergence point at their
global batch allows (interpolated between RCP batches). --rcp-file replaces the package's table
(e.g. RCPs measured for a CPU stand-in). Exit 0 = passed, 1 = failed.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="<action>", parser_class=type(p))
    rcp = sub.add_parser("rcp", help="RCP check of N seed logs (mlperf_logging.rcp_checker)")
    rcp.add_argument("logs", nargs="+", help="mlperf.log files or directories holding them")
    rcp.add_argument("--benchmark", default=None, help="default: the logs' submission_benchmark")
    rcp.add_argument("--ruleset", default=None, help="default: the newest with the benchmark")
    rcp.add_argument("--rcp-file", default=None, help="an RCP JSON file instead of the package's")
    p.set_defaults(_mlperf_parser=p)


def run(args: argparse.Namespace) -> int:
    if args.action != "rcp":
        args._mlperf_parser.print_help()
        return 2
    from scaleout.telemetry.mlperf import check_rcp

    result = check_rcp(args.logs, args.benchmark, args.ruleset, args.rcp_file)
    print(result.render())
    return 0 if result.passed else 1
