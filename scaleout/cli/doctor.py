"""scaleout doctor: a preflight that names the bad node, NIC or link
(scaleout/goodput/doctor.py)."""

from __future__ import annotations

import argparse
import math
import os
import time

from scaleout.argtypes import parse_size

NAME = "doctor"
ORDER = 16
HELP = "preflight under any launcher: versions, interfaces, store, bandwidth; names the bad node"
DESCRIPTION = """\
Run as the ranks of a job (scaleout launch, srun, the netns cluster) before training; takes seconds,
at most --timeout. Every rank records its versions (python, torch, scaleout, CUDA, NCCL), checks its
*_SOCKET_IFNAME variables name interfaces that exist, times a connect and a round trip to the store;
one all-gather compares them (a rank that differs from the majority is named). Then one rank per
node streams a message over raw TCP to the node `stride` further on while receiving from the node
`stride` back, for strides 1, 2, 4, ... (sized from a first round to take 0.25 s on the slowest
pair), and every node group runs one all-reduce (intra-node, inter-node). A node whose inter-node
bandwidth or intra-node all-reduce is below --threshold x the median of the other nodes' is named.
With two nodes a slow pair is pinned on the end whose link reports the lower speed (a tc limit, else
/sys/class/net/<if>/speed). Emulated nodes that share one host (scaleout launch, netns) share its
cores: their intra-node figures are shown, not judged.

Rank 0 prints a table, one line per verdict ("node 1 (n1): inter-node bandwidth 11.8 MB/s, 0.10x
the median 118 MB/s: slow link or NIC") and a summary; every rank exits 1 when there is a verdict,
else 0.

examples:
  scaleout launch --nnodes 2 --nproc-per-node 2 -- scaleout doctor
  scaleout launch --nnodes 2 --nproc-per-node 2 --netns --node-rate 1=100mbit -- scaleout doctor
  srun -N 16 --ntasks-per-node 8 scaleout doctor --exclude bad.txt --quarantine q.json
  sbatch --exclude "$(cat bad.txt)" slurm/bert_256node.sh
"""


def _positive(kind: type, what: str, upper: float | None = None):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {what}") from None
        if not math.isfinite(value) or value <= 0 or (upper is not None and value > upper):
            raise argparse.ArgumentTypeError(f"{text!r}: expected {what}")
        return value

    parse.__name__ = what
    return parse


def _size(text: str) -> int:
    try:
        value = parse_size(text, "--probe-bytes")
    except Exception as exc:  # noqa: BLE001 -- UserError / ValueError: argparse's one line
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not 4096 <= value <= 1 << 30:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size from 4KiB to 1GiB")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threshold",
        type=_positive(float, "a number in (0, 1]", 1.0),
        default=0.5,
        help="name a node whose bandwidth is below this x the other nodes' median (default 0.5)",
    )
    p.add_argument(
        "--probe-bytes",
        type=_size,
        default=None,
        metavar="SIZE",
        help="message of the pairwise probe, e.g. 8MiB (default: sized from a 1 MiB round to take "
        "0.25 s on the slowest pair, 1 MiB to 64 MiB)",
    )
    p.add_argument(
        "--timeout",
        type=_positive(float, "seconds in (0, 3600]", 3600.0),
        default=60.0,
        help="collective and socket timeout: a peer silent this long fails the check (default 60)",
    )
    p.add_argument(
        "--exclude",
        default=None,
        metavar="FILE|-",
        help="write the named nodes as a Slurm hostlist (for sbatch --exclude) to FILE, or print "
        "it with -",
    )
    p.add_argument(
        "--quarantine",
        default=None,
        metavar="FILE",
        help='append each verdict to this JSON quarantine file ({"nodes": {host: [...]}})',
    )
    p.add_argument("--env", default=None, help="force a launcher environment (default: detect)")


def preflight(args: argparse.Namespace, world_size: int, ranks_per_node: int) -> None:
    """Flags were checked by argparse; a quarantine file must be readable before any rank
    starts."""
    from scaleout.goodput import (
        quarantine,  # deferred: the parser is built without the command's modules
    )

    if args.quarantine:
        quarantine.load(args.quarantine)


def run(args: argparse.Namespace) -> int:
    from scaleout.goodput import (
        quarantine,  # deferred: the parser is built without the command's modules
    )

    t_start = time.perf_counter()
    if args.quarantine:  # a corrupt quarantine file fails here, before torch loads and init
        quarantine.load(args.quarantine)
    import scaleout  # deferred: torch and the rank-side modules load when the command runs
    from scaleout.env.nodelist import compress_hostlist  # deferred: as above
    from scaleout.goodput import doctor  # deferred: as above

    # Before init: a *_SOCKET_IFNAME naming a missing interface would fail init on this rank and
    # leave the others waiting; note it and drop it so that the check itself can go on.
    if_problems = doctor.check_ifname_vars(os.environ, doctor.interfaces())
    for var in doctor.IFNAME_VARS:
        if any(p.startswith(f"{var}=") for p in if_problems):
            os.environ.pop(var, None)
    t = time.perf_counter()
    world = scaleout.init(environment=args.env, timeout_s=args.timeout)
    result = doctor.diagnose(
        world, args, if_problems=if_problems, init_s=time.perf_counter() - t, t_start=t_start
    )
    if world.rank == 0:
        print(result.text, flush=True)
        hostlist = compress_hostlist(result.hosts) if result.hosts else ""
        if args.exclude == "-":
            print(f"scaleout doctor: exclude: {hostlist or '(none)'}", flush=True)
        elif args.exclude:
            with open(args.exclude, "w") as f:
                f.write(hostlist + ("\n" if hostlist else ""))
        if args.quarantine and result.verdicts:
            verdicts = [(v.host, v.what) for v in result.verdicts]
            quarantine.record(args.quarantine, verdicts, "doctor")
        print(result.summary, flush=True)
    world.barrier()  # rank 0 has printed before any rank exits (a non-zero exit stops the job)
    world.close()
    return 1 if result.verdicts else 0
