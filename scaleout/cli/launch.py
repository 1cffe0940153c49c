"""scaleout launch: M x G local processes as M emulated nodes."""

from __future__ import annotations

import argparse
import os
import sys

NAME = "launch"
ORDER = 10
HELP = "run N processes as M emulated nodes on this machine, supervised (smoke tests, local runs)"
DESCRIPTION = """\
Start nnodes x nproc-per-node processes on this machine. Each sees its own node rank and local rank
(scaleout.init() builds the World from them; torchrun's RANK/LOCAL_RANK/WORLD_SIZE are set too).
Output lines are prefixed with [rank N]. If a rank exits non-zero or is killed, the others are
stopped (SIGTERM, then SIGKILL after --grace) and the launcher exits non-zero naming the rank.
SIGINT, SIGTERM and SIGHUP stop every rank the same way; if the launcher is killed outright
(SIGKILL, OOM), a watchdog process stops the ranks and removes a --netns launch's private cluster. A
closed stdout (| head, a dead ssh) drops the ranks' output but never blocks them.

examples:
  scaleout launch --nnodes 2 --nproc-per-node 2 -- scaleout smoke
  scaleout launch --nnodes 2 --nproc-per-node 2 -- scaleout train configs/bert_tiny_cpu.yaml
  scaleout launch --nproc-per-node 4 -- python my_script.py --lr 1e-3
  scaleout launch --nnodes 2 --nproc-per-node 2 --netns --rate 1gbit -- scaleout bench allreduce \
      --sizes 64MiB
  scaleout launch --nnodes 2 --nproc-per-node 2 --netns --node-rate 1=100mbit -- scaleout doctor

--netns (root) runs every emulated node in its own network namespace with a rate-limited link
(launchers/netns.py): a private cluster is brought up for this launch and always torn down after.
--node-rate NODE=RATE gives single nodes another link rate (node 1 at 1/10: a slow NIC to find).
--netns-cluster NAME uses one brought up by `scaleout bench cluster up --name NAME` instead.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nnodes", type=int, default=1, help="emulated nodes (default 1)")
    # torchrun's spellings too: --nproc_per_node, --master_addr, --master_port; auto | cpu | gpu | N
    p.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=nproc_value,
        default="1",
        metavar="N|auto|cpu|gpu",
        help="processes per node (default 1); as torchrun: gpu = visible CUDA devices, cpu = "
        "usable "
        "cores, auto = gpu if there is one, else cpu",
    )
    p.add_argument(
        "--master-addr",
        "--master_addr",
        default="127.0.0.1",
        help="rendezvous address (default 127.0.0.1)",
    )
    p.add_argument(
        "--master-port",
        "--master_port",
        type=int,
        default=None,
        help="rendezvous port (default: a free one)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="seconds between SIGTERM and SIGKILL when stopping ranks (default 30, as Slurm's "
        "KillWait and "
        "torchrun: time for the trainer's checkpoint)",
    )
    p.add_argument(
        "--timeout", type=float, default=None, help="stop everything after this many seconds"
    )
    p.add_argument(
        "--no-prefix", action="store_true", help="do not prefix output lines with the rank"
    )
    p.add_argument(
        "--netns",
        action="store_true",
        help="run node i's ranks in network namespace i of a private emulated cluster (root)",
    )
    p.add_argument(
        "--rate",
        default="1gbit",
        help="with --netns: per-node link rate for tc (default 1gbit; 'none' = unlimited)",
    )
    p.add_argument(
        "--node-rate",
        default=None,
        metavar="NODE=RATE[,...]",
        help="with --netns: single nodes' own link rates, e.g. 1=100mbit (a slow NIC or link)",
    )
    p.add_argument(
        "--netns-cluster",
        default=None,
        metavar="NAME",
        help="run in the existing emulated netns cluster NAME (scaleout bench cluster up)",
    )
    p.add_argument(
        "cmd",
        nargs=argparse.REMAINDER,
        metavar="command",
        help="-- then the command each rank runs",
    )


NPROC_WORDS = ("auto", "cpu", "gpu")


def nproc_value(text: str) -> str:
    """argparse type of --nproc-per-node: an integer >= 1 or one of torchrun's words (resolved in
    run)."""
    if text in NPROC_WORDS or (text.isdigit() and int(text) >= 1):
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r}: expected an integer >= 1 or one of {', '.join(NPROC_WORDS)}"
    )


def resolve_nproc(value: str | int) -> int:
    """torchrun's rule (torch.distributed.run.determine_local_world_size): gpu = CUDA devices,
    cpu = the cores this process may use, auto = gpu when there is one, else cpu."""

    from scaleout.errors import UserError

    if str(value).isdigit():
        return int(value)
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    if value == "cpu":
        return cores
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if value == "gpu" and gpus == 0:
        raise UserError(
            "--nproc-per-node gpu: no CUDA device is visible (use a number, cpu or auto)"
        )
    return gpus or cores


def run(args: argparse.Namespace) -> int:
    from scaleout.cli import resolve
    from scaleout.cli._preflight import check_local_launch, check_program
    from scaleout.errors import UserError
    from scaleout.launchers.local import LocalLauncher, check_launch_args
    from scaleout.launchers.netns_launcher import NetnsLauncher

    args.nproc_per_node = resolve_nproc(args.nproc_per_node)
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    # `smoke` -> `scaleout smoke`; the launcher runs the check before spawning
    cmd, check = resolve(cmd)
    options = dict(grace_s=args.grace, prefix_output=not args.no_prefix, preflight=check)
    if args.node_rate is not None and not args.netns:
        raise UserError(
            f"--node-rate={args.node_rate!r} goes with --netns (a private emulated cluster)"
        )
    if args.netns or args.netns_cluster:
        launcher = NetnsLauncher(
            args.rate,
            cluster_name=args.netns_cluster,
            master_port=args.master_port,
            node_rates=args.node_rate,
            **options,
        )
    else:
        launcher = LocalLauncher(
            master_addr=args.master_addr, master_port=args.master_port, **options
        )
    check_launch_args(args.nnodes, args.nproc_per_node, args.grace, args.timeout, args.master_port)
    if args.netns or args.netns_cluster:  # addresses and interfaces are the namespaces' own
        check_program(cmd)
    else:
        check_local_launch(cmd, args.master_addr, args.master_port, os.environ)
    launcher.check([(args.nnodes, args.nproc_per_node)])
    with launcher:
        result = launcher.start(cmd, args.nnodes, args.nproc_per_node).wait(args.timeout)
    stream = sys.stdout if result.returncode == 0 else sys.stderr
    try:
        print(f"scaleout launch: {result.message}", file=stream, flush=True)
    except OSError:  # the reader is gone (| head, a closed terminal): the exit code still tells
        pass
    return result.returncode
