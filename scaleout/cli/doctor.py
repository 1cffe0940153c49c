"""scaleout doctor: a preflight that names the bad node, NIC or link (scaleout/doctor.py)."""

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
`stride` back, for strides 1, 2, 4, ... (sized from a first round to take --target-s on the slowest
pair), and every node group runs one all-reduce (intra-node, inter-node). A node whose inter-node
bandwidth or intra-node all-reduce is below --threshold x the median of the other nodes' is named.
With two nodes a slow pair is pinned on the end whose link reports the lower speed (a tc limit, else
/sys/class/net/<if>/speed).
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
        "--target-s on the slowest pair, 1 MiB to 64 MiB)",
    )
    p.add_argument(
        "--target-s",
        type=_positive(float, "seconds in (0, 10]", 10.0),
        default=0.25,
        help="seconds one probe should take on the slowest pair (default 0.25)",
    )
    p.add_argument(
        "--repeats",
        type=_positive(int, "an integer from 1 to 10", 10),
        default=2,
        help="probes per stride and all-reduces per group; the best counts (default 2)",
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
    from scaleout import quarantine

    if args.quarantine:
        quarantine.load(args.quarantine)


def _probe_pairs(world, leaders, nbytes, stride_list, repeats, timeout, buf):
    """(src node, dst node, bytes/s) for each stride: the best of ``repeats`` rounds."""
    import torch.distributed as dist

    from scaleout import doctor

    k = len(leaders)
    me = leaders.index(world.rank) if world.rank in leaders else None
    server = None
    if me is not None:
        server = doctor.listen(doctor.route_to(world.master_addr or "127.0.0.1")["addr"])
        server.settimeout(timeout)
    addrs: list = [None] * world.world_size
    dist.all_gather_object(addrs, server.getsockname() if server else None)
    payload, sink = memoryview(buf)[:nbytes], memoryview(bytearray(1 << 20))
    found = []
    for s in stride_list:
        out = inc = None
        if me is not None:
            import socket  # deferred: only the probing ranks open sockets

            out = socket.create_connection(addrs[leaders[(me + s) % k]], timeout=timeout)
            out.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            inc, _ = server.accept()
            inc.settimeout(timeout)
        best = 0.0
        for _ in range(repeats):
            world.barrier()
            if me is not None:
                best = max(best, doctor.exchange(out, inc, payload, sink))
        if me is not None:
            found.append(((me - s) % k, me, best))
            out.close()
            inc.close()
    if server is not None:
        server.close()
    gathered: list = [None] * world.world_size
    dist.all_gather_object(gathered, found)
    return [p for part in gathered for p in part]


def _timed_all_reduce(world, group, numel, repeats):
    import torch
    import torch.distributed as dist

    x = torch.ones(numel, device=world.device)
    dist.all_reduce(x, group=group)  # warm-up: connections, buffers
    best = math.inf
    for _ in range(repeats):
        dist.barrier(group=group)
        if world.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        dist.all_reduce(x, group=group)
        if world.device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    import scaleout
    from scaleout import doctor, quarantine
    from scaleout.nodelist import compress_hostlist

    t_start = time.perf_counter()
    # Before init: a *_SOCKET_IFNAME naming a missing interface would fail init on this rank and
    # leave the others waiting; note it and drop it so that the check itself can go on.
    present = doctor.interfaces()
    if_problems = doctor.check_ifname_vars(os.environ, present)
    for var in doctor.IFNAME_VARS:
        if any(p.startswith(f"{var}=") for p in if_problems):
            os.environ.pop(var, None)
    t = time.perf_counter()
    world = scaleout.init(environment=args.env, timeout_s=args.timeout)
    init_s = time.perf_counter() - t
    import socket  # deferred: only here

    route = doctor.route_to(world.master_addr or "127.0.0.1")
    store = dist.distributed_c10d._get_default_store()
    record = {
        "rank": world.rank,
        "node": world.node_of[world.rank],
        "host": socket.gethostname(),
        "netns": doctor.env_netns(),
        **doctor.versions(),
        "if_problems": if_problems,
        **route,
        "link_bps": doctor.link_speed_bps(route["iface"]),
        "init_s": init_s,
        **doctor.store_probe(
            store, world.master_addr, world.master_port, f"scaleout/doctor/{world.rank}"
        ),
    }
    records: list = [None] * world.world_size
    dist.all_gather_object(records, record)

    k = world.num_nodes
    leaders = [node[0] for node in world.ranks_per_node]
    stride_list = doctor.strides(k)
    pairs: list = []
    nbytes = args.probe_bytes
    if stride_list:
        buf = bytearray(nbytes or 64 << 20)
        if nbytes is None:
            first = _probe_pairs(world, leaders, 1 << 20, [1], 1, args.timeout, buf)
            slowest = min(r for _, _, r in first)
            nbytes = int(min(max(slowest * args.target_s, 1 << 20), 64 << 20))
        pairs = _probe_pairs(world, leaders, nbytes, stride_list, args.repeats, args.timeout, buf)
        del buf

    intra_bw: list = [None] * k
    inter = None
    ar_bytes = int(min(max((nbytes or 1 << 20) // 2, 256 << 10), 16 << 20))
    numel = ar_bytes // 4
    if world.uniform and world.local_size > 1:
        n = world.local_size
        group = world.intra
        # Emulated nodes on one host share its cores: their intra-node all-reduces would compete,
        # so they run one node at a time there (real nodes run theirs together).
        shared = len({r["host"] for r in records}) < k
        t_intra = math.inf
        for i in range(k) if shared else [None]:
            if i is not None:
                world.barrier()
            if i is None or world.node_of[world.rank] == i:
                t_intra = _timed_all_reduce(world, group, numel, args.repeats + 1)
        mine = 2 * (n - 1) / n * numel * 4 / t_intra
        gathered: list = [None] * world.world_size
        dist.all_gather_object(gathered, mine)
        for i, ranks in enumerate(world.ranks_per_node):  # the last to arrive saw the op alone
            intra_bw[i] = max(gathered[r] for r in ranks)
    if world.uniform and k > 1:
        t_inter = _timed_all_reduce(world, world.inter, numel, args.repeats)
        inter = 2 * (k - 1) / k * numel * 4 / t_inter

    names, verdicts = doctor.analyse(records, pairs, intra_bw, args.threshold)
    hosts = doctor.verdict_hosts(verdicts)
    elapsed = time.perf_counter() - t_start
    if world.rank == 0:
        _report(args, world, records, names, pairs, intra_bw, inter, nbytes, ar_bytes, verdicts)
        hostlist = compress_hostlist(hosts) if hosts else ""
        if args.exclude == "-":
            print(f"scaleout doctor: exclude: {hostlist or '(none)'}", flush=True)
        elif args.exclude:
            with open(args.exclude, "w") as f:
                f.write(hostlist + ("\n" if hostlist else ""))
        if args.quarantine and verdicts:
            quarantine.record(args.quarantine, [(v.host, v.what) for v in verdicts], "doctor")
        summary = (
            f"{len(verdicts)} verdict{'s' * (len(verdicts) != 1)} on {len(hosts)} "
            f"node{'s' * (len(hosts) != 1)} ({compress_hostlist(hosts)})"
            if verdicts
            else "OK, no verdict"
        )
        print(
            f"scaleout doctor: {summary}; {world.world_size} ranks on {k} nodes in {elapsed:.1f} s",
            flush=True,
        )
    world.barrier()  # rank 0 has printed before any rank exits (a non-zero exit stops the job)
    world.close()
    return 1 if verdicts else 0


def _report(args, world, records, names, pairs, intra_bw, inter, nbytes, ar_bytes, verdicts):
    from scaleout import doctor

    k = len(names)
    speeds: list = [None] * k
    for r in records:
        speeds[r["node"]] = speeds[r["node"]] or r.get("link_bps")
    best, credit = doctor.node_bandwidth(pairs, speeds)
    rows = [("node", "host", "ranks", "store rtt", "iface", "link", "inter-node", "intra a-r")]
    for i, name in enumerate(names):
        mine = [r for r in records if r["node"] == i]
        rtt = [r["store_rtt_s"] for r in mine if r.get("store_rtt_s") is not None]
        rows.append(
            (
                str(i),
                name,
                doctor._ranks([r["rank"] for r in mine]),
                f"{max(rtt) * 1e3:.1f} ms" if rtt else "failed",
                str(mine[0].get("iface")),
                doctor._bits(speeds[i]) if speeds[i] else "-",
                doctor._mbs(best[i]) if best[i] else "-",
                doctor._mbs(intra_bw[i]) if intra_bw[i] else "-",
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    r0 = records[0]
    lines = [
        f"scaleout doctor: {world.world_size} ranks on {k} nodes, launcher {world.launcher}, "
        f"backend {world.backend}; python {r0['python']}, torch {r0['torch']}, scaleout "
        f"{r0['scaleout']}, cuda {r0['cuda']}, nccl {r0['nccl']}",
    ]
    lines += [
        "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    if pairs:
        lines.append(
            f"  pairs ({nbytes / 2**20:.2f} MiB each way, best of {args.repeats}): "
            + ", ".join(f"{s}->{d} {doctor._mbs(r)}" for s, d, r in sorted(pairs))
        )
    if inter:
        lines.append(
            f"  inter-node all-reduce {ar_bytes / 2**20:.2f} MiB: {doctor._mbs(inter)} bus "
            "bandwidth"
        )
    lines += [f"verdict: {v.line()}" for v in verdicts]
    print("\n".join(lines), flush=True)
