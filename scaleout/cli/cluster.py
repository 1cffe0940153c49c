"""scaleout bench cluster up|down|status: the emulated multi-node cluster (network namespaces +
tc)."""

from __future__ import annotations

import argparse
import json

NAME = "cluster"
# A lab tool: the emulated cluster the benchmarks and netns tests run on (scaleout bench cluster).
GROUP = "bench"
ORDER = 15
HELP = "bring an emulated multi-node cluster (netns + bridge + tc rate limit) up or down (root)"
DESCRIPTION = """\
One network namespace per node (<name>-n<i>, veth0 = <subnet>.(i+1)/24, no default route), joined by
a bridge, with a tc token-bucket limit of --rate on both ends of every node's link. Ranks of one
node talk over loopback; only cross-node traffic is limited. Needs root. `down` is idempotent.

Everything scaleout creates is recorded first (/run/scaleout/netns/<name>.json), and `down` removes
only what a record lists. `down --all` removes every recorded cluster whose owner is gone:
persistent ones from `bench cluster up` and the private clusters of `launch --netns` runs that were
killed (a running launch's cluster is left alone).

examples:
  scaleout bench cluster up --nnodes 4 --rate 1gbit
  scaleout bench cluster up --nnodes 4 --rate 1gbit --node-rate 1=100mbit
  scaleout launch --netns-cluster so --nnodes 4 --nproc-per-node 2 -- scaleout bench allreduce \
      --sizes 64MiB
  scaleout bench cluster status
  scaleout bench cluster down
  scaleout bench cluster down --all
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["up", "down", "status"])
    p.add_argument("--nnodes", type=int, default=2, help="nodes (namespaces) to create (default 2)")
    p.add_argument(
        "--rate",
        default="1gbit",
        help="per-node link rate, tc units (default 1gbit; 'none' = unlimited)",
    )
    p.add_argument(
        "--node-rate",
        default=None,
        metavar="NODE=RATE[,...]",
        help="single nodes' own link rates, e.g. 1=100mbit (overrides --rate for those nodes)",
    )
    p.add_argument(
        "--name", default="so", help="cluster name, prefix of namespaces and links (default so)"
    )
    p.add_argument(
        "--subnet",
        default="10.77.0",
        help="first three octets of the node addresses (default 10.77.0)",
    )
    p.add_argument(
        "--all", action="store_true", help="down: every recorded cluster whose owner is gone"
    )


def run(args: argparse.Namespace) -> int:
    from scaleout.errors import UserError
    from scaleout.launchers.netns import Cluster, down_all, owner_alive, read_records, require_root

    if args.all and args.action != "down":
        raise UserError(f"--all goes with `down`, not `{args.action}`")
    if args.action == "down" and args.all:
        require_root()
        removed, skipped = down_all()
        print(
            f"scaleout bench cluster: removed {len(removed)} ({', '.join(removed) or 'none'})"
            + (f"; left running: {', '.join(skipped)}" if skipped else "")
        )
        return 0
    if args.node_rate is not None and args.action != "up":
        raise UserError(f"--node-rate goes with `up`, not `{args.action}`")
    cluster = Cluster(
        args.nnodes, args.rate, name=args.name, subnet=args.subnet, node_rates=args.node_rate
    )
    if args.action == "up":
        cluster.up()
        print(
            f"scaleout bench cluster: {args.nnodes} nodes up "
            f"({', '.join(cluster.ns(i) + '=' + cluster.addr(i) for i in range(args.nnodes))}), "
            f"rate {args.rate}"
            + "".join(f", node {i} {r}" for i, r in sorted(cluster.node_rates.items()))
        )
    elif args.action == "down":
        require_root()
        rec = read_records().get(args.name)
        if rec is not None and owner_alive(rec):
            raise UserError(
                f"cluster {args.name!r} belongs to the running launch pid {rec['owner_pid']}: stop "
                "that launch"
            )
        cluster.down()
        if rec is not None:
            print(f"scaleout bench cluster: {args.name!r} is down")
        else:
            unknown = cluster.existing()
            print(
                f"scaleout bench cluster: no cluster {args.name!r} recorded; nothing removed"
                + (
                    f" (not created by scaleout, left alone: {', '.join(unknown)})"
                    if unknown
                    else ""
                )
            )
    else:
        print(json.dumps(cluster.status(), indent=2))
    return 0
