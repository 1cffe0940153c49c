"""scaleout launch: M x G local processes as M emulated nodes."""

from __future__ import annotations

import argparse
import sys

NAME = "launch"
ORDER = 10
HELP = "run N processes as M emulated nodes on this machine, supervised (smoke tests, local runs)"
DESCRIPTION = """\
Start nnodes x nproc-per-node processes on this machine. Each sees its own node rank and local rank
(scaleout.init() builds the World from them; torchrun's RANK/LOCAL_RANK/WORLD_SIZE are set too).
Output lines are prefixed with [rank N]. If a rank exits non-zero or is killed, the others are stopped
(SIGTERM, then SIGKILL after --grace) and the launcher exits non-zero naming the rank.

examples:
  scaleout launch --nnodes 2 --nproc-per-node 2 -- scaleout smoke
  scaleout launch --nnodes 2 --nproc-per-node 2 -- scaleout train configs/bert_tiny_cpu.yaml
  scaleout launch --nproc-per-node 4 -- python my_script.py --lr 1e-3
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nnodes", type=int, default=1, help="emulated nodes (default 1)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="processes per node (default 1)")
    p.add_argument("--master-addr", default="127.0.0.1", help="rendezvous address (default 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: a free one)")
    p.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL when stopping ranks")
    p.add_argument("--timeout", type=float, default=None, help="stop everything after this many seconds")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with the rank")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="command", help="-- then the command each rank runs")


def run(args: argparse.Namespace) -> int:
    from launchers.local import launch

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    result = launch(
        cmd,
        args.nnodes,
        args.nproc_per_node,
        master_addr=args.master_addr,
        master_port=args.master_port,
        grace_s=args.grace,
        prefix_output=not args.no_prefix,
        timeout_s=args.timeout,
    )
    stream = sys.stdout if result.returncode == 0 else sys.stderr
    print(f"scaleout launch: {result.message}", file=stream, flush=True)
    return result.returncode
