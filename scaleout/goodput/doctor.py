"""``scaleout doctor``: a preflight that names the bad node, NIC or link (the CLI is
``scaleout/cli/doctor.py``).

Every rank runs it (under ``scaleout launch``, ``srun``, the netns cluster, ...):

1. **Record**: each rank's versions (python, torch, scaleout, CUDA, NCCL), its ``*_SOCKET_IFNAME``
   variables (does each interface exist here?), the interface, address and subnet it reaches the
   rendezvous on, that interface's link speed (a tc rate limit if one is set, as on the emulated
   cluster, else ``/sys/class/net/<if>/speed``) and a timed TCP connect and round trip to the
   store. One all-gather of these small records; a value that differs from the majority is named.
2. **Pairwise bandwidth** between nodes: one rank per node (its first) streams a message over raw
   TCP to the node ``stride`` further on while receiving one from the node ``stride`` back, for
   strides 1, 2, 4, ... < nodes (every link busy in both directions, as in a ring all-reduce). The
   message is sized from a first 1 MiB round to take ~``TARGET_S`` on the slowest pair.
3. **One all-reduce per group**: intra-node (each node alone) and inter-node (one rank per node).
4. **Verdicts** (:func:`analyse`, pure: unit tests feed it synthetic figures): a node whose figure
   is below ``threshold`` x the median of the other nodes' is named, one line each.

How a slow pair is pinned on one node: a pair runs at the slower of its two ends, so a node's
inter-node figure is its *best* pair (a healthy node has at least one fast peer when there are 3+
nodes). With 2 nodes both ends of the one slow pair look alike; when the two ends report different
link speeds, the pair's rate is credited to the end with the slower link and scaled by the speed
ratio for the other end (the faster end was held back by its peer). Equal or unknown link speeds
credit nothing: the figures are then the measurements alone.
"""

from __future__ import annotations

import math
import platform
import socket
import statistics
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from scaleout import __version__
from scaleout.env.nodelist import (  # noqa: F401  (doctor's own API)
    compress_hostlist,
    link_record,
    node_names,
)
from scaleout.netinfo import (  # noqa: F401  (doctor's own API)
    env_netns,
    interfaces,
    link_speed_bps,
    route_to,
)

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
VERSION_FIELDS = ("python", "torch", "scaleout", "cuda", "nccl")
CHECKED_FIELDS = ("subnet",)  # compared across ranks like the versions
TARGET_S = 0.25  # one probe should take about this long on the slowest pair
REPEATS = 2  # probes per stride and all-reduces per group; the best counts (intra: 2x + 1)
STORE_SLOW_S = 0.25  # a store round trip slower than this and 10x the median is named


@dataclass(frozen=True)
class Verdict:
    node: int
    host: str
    kind: str  # version | interface | store | bandwidth | intra
    what: str

    def line(self) -> str:
        return f"node {self.node} ({self.host}): {self.what}"


# -- what one rank records ----------------------------------------------------------------------
def versions() -> dict[str, str | None]:
    nccl = None
    if torch.cuda.is_available():
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 -- a torch without NCCL
            nccl = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "scaleout": __version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
    }


def check_ifname_vars(env: Mapping[str, str], present: Sequence[str]) -> list[str]:
    """Problems with the ``*_SOCKET_IFNAME`` variables: a named interface that does not exist here.
    NCCL's syntax is understood: ``^`` excludes (not checked), ``=`` means an exact name, else a
    prefix; gloo and tensorpipe take exact names (comma lists)."""
    problems = []
    for var in IFNAME_VARS:
        value = env.get(var)
        if not value or value.startswith("^"):
            continue
        nccl = var.startswith("NCCL")
        exact = value.startswith("=")
        for name in value.lstrip("=").split(","):
            name = name.strip()
            if not name:
                continue
            ok = any(p.startswith(name) for p in present) if nccl and not exact else name in present
            if not ok:
                problems.append(
                    f"{var}={value} names no interface here (interfaces: {', '.join(present)})"
                )
                break
    return problems


def store_probe(store: Any, addr: str | None, port: int | None, key: str) -> dict[str, Any]:
    """A timed TCP connect to the store's address and a set + get round trip through it."""
    out: dict[str, Any] = {"store_connect_s": None, "store_rtt_s": None, "store_error": None}
    try:
        t = time.perf_counter()
        socket.create_connection((addr or "127.0.0.1", int(port or 0)), timeout=10).close()
        out["store_connect_s"] = time.perf_counter() - t
        t = time.perf_counter()
        store.set(key, b"1")
        store.get(key)
        out["store_rtt_s"] = time.perf_counter() - t
    except Exception as exc:  # noqa: BLE001 -- any failure to reach the store is the finding
        out["store_error"] = f"{type(exc).__name__}: {exc}"
    return out


# -- pairwise bandwidth over raw TCP ------------------------------------------------------------
def strides(nodes: int) -> list[int]:
    out, s = [], 1
    while s < nodes:
        out.append(s)
        s *= 2
    return out


def listen(addr: str) -> socket.socket:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind((addr, 0))
    server.listen(4)
    return server


def receive_rate(sock: socket.socket, nbytes: int, sink: memoryview) -> float:
    """Read nbytes; bytes/s from the first chunk's arrival to the last (not counting the first
    chunk, so neither start-up skew nor a token bucket's burst inflates it)."""
    t0 = time.perf_counter()
    got = sock.recv_into(sink, min(nbytes, len(sink)))
    if got == 0:
        raise ConnectionError("peer closed the probe connection")
    t = time.perf_counter()
    left = after = nbytes - got
    while left:
        n = sock.recv_into(sink, min(left, len(sink)))
        if n == 0:
            raise ConnectionError("peer closed the probe connection")
        left -= n
    dt = time.perf_counter() - t
    if after and dt > 0:
        return after / dt
    return nbytes / max(time.perf_counter() - t0, 1e-9)  # one chunk held it all


def exchange(
    out: socket.socket, inc: socket.socket, payload: memoryview, sink: memoryview
) -> float:
    """Send payload on ``out`` while receiving as much on ``inc``; the receive rate (bytes/s)."""
    box: list[Any] = [None]

    def rx() -> None:
        try:
            box[0] = receive_rate(inc, len(payload), sink)
        except BaseException as exc:  # noqa: BLE001 -- re-raised in the caller
            box[0] = exc

    thread = threading.Thread(target=rx, daemon=True)
    thread.start()
    out.sendall(payload)
    thread.join()
    if isinstance(box[0], BaseException):
        raise box[0]
    return float(box[0])


# -- the verdicts (pure) ------------------------------------------------------------------------
def _ranks(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def field_verdicts(
    records: Sequence[Mapping[str, Any]], names: Sequence[str], fields: Sequence[str]
) -> list[Verdict]:
    """A value held by fewer ranks than the most common one names those ranks' nodes (a tie
    takes rank 0's value as the reference)."""
    out = []
    for f in fields:
        counts = Counter(r.get(f) for r in records)
        if len(counts) < 2:
            continue
        top = max(counts.values())
        leaders = [v for v, c in counts.items() if c == top]
        ref = records[0].get(f) if len(leaders) > 1 else leaders[0]
        ref_ranks = [r["rank"] for r in records if r.get(f) == ref]
        odd: dict[int, list[Mapping[str, Any]]] = {}
        for r in records:
            if r.get(f) != ref:
                odd.setdefault(int(r["node"]), []).append(r)
        kind = "version" if f in VERSION_FIELDS else "interface"
        for node, rs in sorted(odd.items()):
            vals = sorted({str(r.get(f)) for r in rs})
            out.append(
                Verdict(
                    node,
                    names[node],
                    kind,
                    f"{f} {' / '.join(vals)} on rank {_ranks([r['rank'] for r in rs])} differs "
                    f"from {'the majority' if len(leaders) == 1 else 'rank 0'}'s {ref} "
                    f"(ranks {_ranks(ref_ranks)}): mismatched "
                    f"{'install' if kind == 'version' else 'network'}",
                )
            )
    return out


def interface_verdicts(records: Sequence[Mapping[str, Any]], names: Sequence[str]) -> list[Verdict]:
    out = []
    seen: set[tuple[int, str]] = set()
    for r in records:
        for problem in r.get("if_problems", []):
            node = int(r["node"])
            if (node, problem) in seen:
                continue
            seen.add((node, problem))
            ranks = [q["rank"] for q in records if problem in q.get("if_problems", [])]
            out.append(Verdict(node, names[node], "interface", f"{problem} (rank {_ranks(ranks)})"))
    return out


def store_verdicts(records: Sequence[Mapping[str, Any]], names: Sequence[str]) -> list[Verdict]:
    out = []
    rtts = [r["store_rtt_s"] for r in records if r.get("store_rtt_s") is not None]
    median = statistics.median(rtts) if rtts else None
    for r in records:
        node = int(r["node"])
        if r.get("store_error"):
            out.append(
                Verdict(
                    node,
                    names[node],
                    "store",
                    f"rank {r['rank']} cannot reach the store: {r['store_error']}",
                )
            )
        elif (
            median is not None
            and r.get("store_rtt_s") is not None
            and r["store_rtt_s"] > max(STORE_SLOW_S, 10 * median)
        ):
            out.append(
                Verdict(
                    node,
                    names[node],
                    "store",
                    f"rank {r['rank']}: store round trip {r['store_rtt_s'] * 1e3:.0f} ms, "
                    f"{r['store_rtt_s'] / median:.0f}x the median {median * 1e3:.1f} ms: slow "
                    "path to the rendezvous",
                )
            )
    return out


def node_bandwidth(
    pairs: Sequence[tuple[int, int, float]], speeds: Sequence[float | None]
) -> tuple[list[float | None], list[float | None]]:
    """Per node: (measured best pair, credited figure) in bytes/s from (src, dst, bytes/s) pairs.
    See the module docstring for how link speeds credit a pair to its slower end."""
    k = len(speeds)
    best: list[float | None] = [None] * k
    credit: list[float | None] = [None] * k
    for src, dst, rate in pairs:
        for me, other in ((src, dst), (dst, src)):
            best[me] = max(best[me] or 0.0, rate)
            scale = 1.0
            if speeds[me] and speeds[other] and speeds[me] > speeds[other]:
                scale = speeds[me] / speeds[other]
            credit[me] = max(credit[me] or 0.0, rate * scale)
    return best, credit


def _loo_median(values: Sequence[float | None], i: int) -> float | None:
    others = [v for j, v in enumerate(values) if j != i and v]
    return statistics.median(others) if others else None


def _mbs(bps: float) -> str:
    mb = bps / 1e6
    return f"{mb:.0f} MB/s" if mb >= 100 else f"{mb:.1f} MB/s" if mb >= 1 else f"{mb:.3f} MB/s"


def _bits(bps: float) -> str:
    for unit, div in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= div:
            return f"{bps / div:.3g} {unit}"
    return f"{bps:.0f} bit/s"


def bandwidth_verdicts(
    pairs: Sequence[tuple[int, int, float]],
    speeds: Sequence[float | None],
    names: Sequence[str],
    threshold: float,
) -> list[Verdict]:
    """A node whose inter-node figure is below ``threshold`` x the median of the others'."""
    best, credit = node_bandwidth(pairs, speeds)
    out = []
    for i in range(len(names)):
        ref = _loo_median(credit, i)
        if credit[i] is None or best[i] is None or not ref:
            continue
        ratio = credit[i] / ref
        if ratio < threshold:
            why = ""
            known = [s for j, s in enumerate(speeds) if j != i and s]
            if speeds[i] and known and speeds[i] < statistics.median(known):
                why = f" (its link {_bits(speeds[i])}, the others' "
                why += f"{_bits(statistics.median(known))})"
            out.append(
                Verdict(
                    i,
                    names[i],
                    "bandwidth",
                    f"inter-node bandwidth {_mbs(best[i])}, {ratio:.2f}x the median "
                    f"{_mbs(ref)}: slow link or NIC{why}",
                )
            )
    return out


def intra_verdicts(
    intra_bw: Sequence[float | None], names: Sequence[str], threshold: float
) -> list[Verdict]:
    """A node whose intra-node all-reduce bus bandwidth is below ``threshold`` x the others'
    median."""
    out = []
    for i, bw in enumerate(intra_bw):
        ref = _loo_median(intra_bw, i)
        if bw and ref and bw / ref < threshold:
            out.append(
                Verdict(
                    i,
                    names[i],
                    "intra",
                    f"intra-node all-reduce {_mbs(bw)}, {bw / ref:.2f}x the median {_mbs(ref)}: "
                    "slow host, device or node-local link",
                )
            )
    return out


def analyse(
    records: Sequence[Mapping[str, Any]],
    pairs: Sequence[tuple[int, int, float]],
    intra_bw: Sequence[float | None],
    threshold: float,
    failures: Sequence[tuple[int, int, str]] = (),
) -> tuple[list[str], list[Verdict]]:
    """(node names, verdicts) from every rank's record, the pair rates, the per-node intra
    all-reduce figures and the pairs that could not be measured (src, dst, error: named on the
    receiving node, the one the stream could not reach)."""
    names = node_names(records)
    speeds: list[float | None] = [None] * len(names)
    for r in sorted(records, key=lambda r: r["rank"], reverse=True):
        speeds[int(r["node"])] = r.get("link_bps") or speeds[int(r["node"])]
    verdicts = (
        interface_verdicts(records, names)
        + field_verdicts(records, names, VERSION_FIELDS + CHECKED_FIELDS)
        + store_verdicts(records, names)
        + [
            Verdict(
                dst,
                names[dst],
                "link",
                f"no stream from node {src} ({names[src]}) arrived: {error}: unreachable or "
                "broken link",
            )
            for src, dst, error in failures
        ]
        + bandwidth_verdicts(pairs, speeds, names, threshold)
    )
    # Emulated nodes on one host share its cores, memory and devices: their intra-node figures
    # differ by scheduling noise, not hardware, so they are shown but not judged there.
    if len({str(r["host"]) for r in records}) == len(names):
        verdicts += intra_verdicts(intra_bw, names, threshold)
    return names, sorted(verdicts, key=lambda v: v.node)


def verdict_hosts(verdicts: Sequence[Verdict]) -> list[str]:
    return sorted({v.host for v in verdicts})


# -- the whole check, in every rank ---------------------------------------------------------------
@dataclass
class Diagnosis:
    verdicts: list[Verdict]
    hosts: list[str]  # the nodes named, sorted
    text: str  # the table and one line per verdict (rank 0; "" elsewhere)
    summary: str


def diagnose(
    world: Any,
    args: Any,
    *,
    if_problems: Sequence[str] = (),
    init_s: float | None = None,
    t_start: float | None = None,
) -> Diagnosis:
    """Run every check on an initialised World (all ranks call it); ``args`` carries the options
    of ``scaleout doctor`` (threshold, probe_bytes, timeout)."""
    t_start = time.perf_counter() if t_start is None else t_start
    route = route_to(world.master_addr or "127.0.0.1")
    store = dist.distributed_c10d._get_default_store()
    record = {
        "rank": world.rank,
        "node": world.node_of[world.rank],
        "host": socket.gethostname(),
        "netns": env_netns(),
        **versions(),
        "if_problems": list(if_problems),
        **route,
        "link_bps": link_speed_bps(route["iface"]),
        "init_s": init_s,
        **store_probe(store, world.master_addr, world.master_port, f"scaleout/doctor/{world.rank}"),
    }
    records: list = [None] * world.world_size
    dist.all_gather_object(records, record)

    k = world.num_nodes
    leaders = [node[0] for node in world.ranks_per_node]
    stride_list = strides(k)
    pairs: list = []
    failures: list = []
    nbytes = args.probe_bytes
    if stride_list:
        buf = bytearray(nbytes or 64 << 20)
        if nbytes is None:
            first, _ = _probe_pairs(world, leaders, 1 << 20, [1], 1, args.timeout, buf)
            slowest = min((r for _, _, r in first), default=1e6)
            nbytes = int(min(max(slowest * TARGET_S, 1 << 20), 64 << 20))
        pairs, failures = _probe_pairs(
            world, leaders, nbytes, stride_list, REPEATS, args.timeout, buf
        )
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
                t_intra = _timed_all_reduce(world, group, numel, 2 * REPEATS + 1)
        mine = 2 * (n - 1) / n * numel * 4 / t_intra
        gathered: list = [None] * world.world_size
        dist.all_gather_object(gathered, mine)
        for i, ranks in enumerate(world.ranks_per_node):  # the last to arrive saw the op alone
            intra_bw[i] = max(gathered[r] for r in ranks)
    if world.uniform and k > 1:
        t_inter = _timed_all_reduce(world, world.inter, numel, REPEATS)
        inter = 2 * (k - 1) / k * numel * 4 / t_inter

    names, verdicts = analyse(records, pairs, intra_bw, args.threshold, failures)
    hosts = verdict_hosts(verdicts)
    text = ""
    if world.rank == 0:
        text = _report(
            args, world, records, names, pairs, intra_bw, inter, nbytes, ar_bytes, verdicts
        )
    summary = (
        f"{len(verdicts)} verdict{'s' * (len(verdicts) != 1)} on {len(hosts)} "
        f"node{'s' * (len(hosts) != 1)} ({compress_hostlist(hosts)})"
        if verdicts
        else "OK, no verdict"
    )
    elapsed = time.perf_counter() - t_start
    summary = (
        f"scaleout doctor: {summary}; {world.world_size} ranks on {k} nodes in {elapsed:.1f} s"
    )
    return Diagnosis(verdicts, hosts, text, summary)


def _probe_pairs(world, leaders, nbytes, stride_list, repeats, timeout, buf):
    """([(src node, dst node, bytes/s)], [(src node, dst node, error)]) for each stride: the best
    of ``repeats`` rounds, or why the pair could not be measured (connect refused, timed out)."""
    k = len(leaders)
    me = leaders.index(world.rank) if world.rank in leaders else None
    server, mine = None, None
    if me is not None:
        addr = route_to(world.master_addr or "127.0.0.1")["addr"]
        server = listen(addr or "")
        server.settimeout(timeout)
        mine = (addr or socket.gethostname(), server.getsockname()[1])
    addrs: list = [None] * world.world_size
    dist.all_gather_object(addrs, mine)
    payload, sink = memoryview(buf)[:nbytes], memoryview(bytearray(256 << 10))
    found, failed = [], []
    for s in stride_list:
        out = inc = None
        error = None
        if me is not None:
            try:
                out = socket.create_connection(addrs[leaders[(me + s) % k]], timeout=timeout)
                out.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                inc, _ = server.accept()
                inc.settimeout(timeout)
            except OSError as exc:
                error = f"{type(exc).__name__}: {exc}"
        best = 0.0
        for _ in range(repeats):
            world.barrier()
            if me is not None and error is None:
                try:
                    best = max(best, exchange(out, inc, payload, sink))
                except OSError as exc:
                    error = f"{type(exc).__name__}: {exc}"
        if me is not None:
            if error is None:
                found.append(((me - s) % k, me, best))
            else:
                failed.append(((me - s) % k, me, error))
            for sock in (out, inc):
                if sock is not None:
                    sock.close()
    if server is not None:
        server.close()
    gathered: list = [None] * world.world_size
    dist.all_gather_object(gathered, (found, failed))
    return [p for part in gathered if part for p in part[0]], [
        f for part in gathered if part for f in part[1]
    ]


def _timed_all_reduce(world, group, numel, repeats):
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


def _report(args, world, records, names, pairs, intra_bw, inter, nbytes, ar_bytes, verdicts) -> str:
    k = len(names)
    speeds: list = [None] * k
    for r in records:
        speeds[r["node"]] = speeds[r["node"]] or r.get("link_bps")
    best, credit = node_bandwidth(pairs, speeds)
    head = ("node", "host", "ranks", "store rtt", "iface", "link", "inter-node", "judged as")
    rows = [(*head, "intra a-r")]
    for i, name in enumerate(names):
        mine = [r for r in records if r["node"] == i]
        rtt = [r["store_rtt_s"] for r in mine if r.get("store_rtt_s") is not None]
        rows.append(
            (
                str(i),
                name,
                _ranks([r["rank"] for r in mine]),
                f"{max(rtt) * 1e3:.1f} ms" if rtt else "failed",
                str(mine[0].get("iface")),
                _bits(speeds[i]) if speeds[i] else "-",
                _mbs(best[i]) if best[i] else "-",
                _mbs(credit[i]) if credit[i] else "-",
                _mbs(intra_bw[i]) if intra_bw[i] else "-",
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
            f"  pairs ({nbytes / 2**20:.2f} MiB each way, best of {REPEATS}): "
            + ", ".join(f"{s}->{d} {_mbs(r)}" for s, d, r in sorted(pairs))
        )
        lines.append(
            "  inter-node = the node's best pair; judged as = that, or, where the pair's other end "
            "reports a slower link, the pair's rate x the speed ratio"
        )
    if inter:
        lines.append(
            f"  inter-node all-reduce {ar_bytes / 2**20:.2f} MiB: {_mbs(inter)} bus bandwidth"
        )
    lines += [f"verdict: {v.line()}" for v in verdicts]
    return "\n".join(lines)
