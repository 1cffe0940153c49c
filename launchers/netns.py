"""An emulated multi-node cluster on one machine: one network namespace per node, joined by a
bridge, with a tc token-bucket rate limit on both ends of every node's link (a full-duplex NIC of
that rate).

Layout (../shared/notes/netns-cluster.md): node i = namespace ``<name>-n<i>`` with ``veth0`` =
``<subnet>.(i+1)/24``, loopback up and **no default route**; the root-side peer ``<name>-v<i>`` is
enslaved to the bridge ``<name>-br``, which has no address. Ranks of one node talk over that
namespace's loopback (unshaped); only cross-node traffic meets the rate limit. netem is not in this
kernel, so only bandwidth is emulated, not delay.

Processes that use the cluster's addresses must run *inside* its namespaces
(:meth:`Cluster.wrapper`); from the root namespace those addresses would be routed off the machine.

    with Cluster(nodes=2, rate="1gbit") as c:      # up; always torn down, also on error or SIGTERM
        subprocess.run(c.wrapper(0) + ["ip", "addr"])

``node_rates`` gives single nodes another link rate (``Cluster(4, "1gbit", node_rates={1:
"100mbit"})``, on the command line ``--node-rate 1=100mbit``): a slow NIC or link, which ``scaleout
doctor`` should name.

``down()`` is idempotent and removes whatever a previous, crashed run left behind.

What scaleout creates is recorded before it is created, one JSON file per cluster in ``state_dir()``
(``/run/scaleout/netns``; $SCALEOUT_NETNS_STATE overrides): namespaces, links, /etc/netns folders
and, for a launch's private cluster, the launcher's pid. ``down()`` removes only what a record
lists, so it never touches a namespace or link that something else created under a similar name, and
``down_all()`` (``scaleout bench cluster down --all``) cleans every cluster whose owner is gone,
e.g.
after a SIGKILLed ``launch --netns``. /run is a tmpfs: records vanish at reboot together with the
namespaces they describe.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scaleout.errors import UserError
from scaleout.fsutil import atomic_write
from scaleout.launchers.watchdog import start_time
from scaleout.units import parse_rate

# tbf needs a bucket of at least rate/HZ; 256 kB and 50 ms queueing are what the notes measured
# (iperf3 957 Mbit/s through a 1gbit limit).
TBF_BURST = "256kb"
TBF_LATENCY = "50ms"

_NAME = re.compile(r"^[a-z][a-z0-9]{0,7}$")
MAX_NODES = 250  # node i is <subnet>.(i+1) in one /24, next to the bridge side


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return (
        subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
        if not check
        else _checked(["ip", *args])
    )


def _checked(cmd: list[str]) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise UserError(
            f"emulated cluster: `{' '.join(cmd)}` failed: {p.stderr.strip() or p.stdout.strip()}"
        )
    return p


def state_dir() -> Path:
    return Path(os.environ.get("SCALEOUT_NETNS_STATE") or "/run/scaleout/netns")


def read_records() -> dict[str, dict[str, Any]]:
    """Every recorded cluster: name -> record. Unreadable files are skipped (never guessed from)."""
    out = {}
    for f in sorted(state_dir().glob("*.json")):
        try:
            rec = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and rec.get("name") == f.stem and _NAME.match(f.stem):
            out[f.stem] = rec
    return out


def owner_alive(rec: dict[str, Any]) -> bool:
    """A launch's private cluster is in use while its launcher (same pid and start time) runs."""
    pid = rec.get("owner_pid")
    return (
        isinstance(pid, int)
        and start_time(pid) is not None
        and start_time(pid) == rec.get("owner_start")
    )


def down_all() -> tuple[list[str], list[str]]:
    """Tear down every recorded cluster whose owner is gone. Returns (removed, skipped because in
    use)."""
    removed, skipped = [], []
    for name, rec in read_records().items():
        if owner_alive(rec):
            skipped.append(f"{name} (launch pid {rec['owner_pid']} is running)")
            continue
        Cluster(int(rec.get("nodes", 1)), None, name=name).down()
        removed.append(name)
    return removed, skipped


def parse_node_rates(spec: Any, nodes: int | None = None) -> dict[int, str]:
    """``"1=100mbit,3=10mbit"`` (or a dict) -> {1: "100mbit", 3: "10mbit"}: per-node link rates
    that override the cluster's ``--rate``. Each rate is checked (tc units or 'none'); with
    ``nodes``, each node index must be one of the cluster's."""
    if spec is None or spec == "" or spec == {}:
        return {}
    if isinstance(spec, dict):
        items = [(str(k), str(v)) for k, v in spec.items()]
    else:
        items = []
        for part in str(spec).split(","):
            node, eq, rate = part.strip().partition("=")
            if not eq or not node.strip() or not rate.strip():
                raise UserError(
                    f"--node-rate={spec!r}: expected NODE=RATE[,NODE=RATE...], e.g. 1=100mbit"
                )
            items.append((node.strip(), rate.strip()))
    out: dict[int, str] = {}
    for node, rate in items:
        if not node.isdigit():
            raise UserError(
                f"--node-rate={spec!r}: node {node!r} is not a node index (expected an integer "
                "from 0)"
            )
        i = int(node)
        if nodes is not None and i >= nodes:
            raise UserError(
                f"--node-rate={spec!r}: node {i} does not exist (the cluster has nodes "
                f"0-{nodes - 1})"
            )
        if i in out:
            raise UserError(f"--node-rate={spec!r}: node {i} is given twice")
        parse_rate(rate, f"--node-rate {i}")
        out[i] = rate
    return out


def require_root() -> None:
    if os.geteuid() != 0:
        raise UserError(
            "the emulated cluster (network namespaces + tc) needs root: run as root or with sudo"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise UserError(
                f"the emulated cluster needs `{tool}` (Debian: apt-get install iproute2)"
            )


@dataclass
class Cluster:
    """N namespaces on a bridge with a per-node rate limit. Names must fit Linux's 15-char
    interfaces."""

    nodes: int
    rate: str | None = "1gbit"
    name: str = "so"
    subnet: str = "10.77.0"
    node_rates: dict[int, str] | None = None  # node index -> its own link rate (tc units)
    _owned: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, int) or not 1 <= self.nodes <= MAX_NODES:
            raise UserError(f"--nnodes={self.nodes!r}: expected an integer from 1 to {MAX_NODES}")
        if not _NAME.match(self.name):
            raise UserError(
                f"cluster name {self.name!r}: expected 1-8 lowercase letters/digits starting with "
                "a letter"
            )
        if not re.match(r"^\d{1,3}\.\d{1,3}\.\d{1,3}$", self.subnet):
            raise UserError(f"cluster subnet {self.subnet!r}: expected three octets like 10.77.0")
        self.rate_bps = parse_rate(self.rate)
        self.node_rates = parse_node_rates(self.node_rates, self.nodes)

    def rate_of(self, i: int) -> str | None:
        """Node i's link rate: its ``node_rates`` entry, else the cluster's ``rate``."""
        return (self.node_rates or {}).get(i, self.rate)

    # -- names ------------------------------------------------------------------------------------
    def ns(self, i: int) -> str:
        return f"{self.name}-n{i}"

    def addr(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    @property
    def bridge(self) -> str:
        return f"{self.name}-br"

    def wrapper(self, i: int) -> list[str]:
        """Prefix that runs a command inside node i's namespace."""
        return ["ip", "netns", "exec", self.ns(i)]

    def rank_env(self) -> dict[str, str]:
        """Variables every rank needs: gloo must bind veth0, the rendezvous is node 0's address."""
        env = {
            "GLOO_SOCKET_IFNAME": "veth0",
            "TP_SOCKET_IFNAME": "veth0",
            "MASTER_ADDR": self.addr(0),
            "SCALEOUT_NETNS": self.name,
        }
        # The slowest link of the cluster: the floor a ring over every node runs at.
        limited = [b for b in (parse_rate(self.rate_of(i)) for i in range(self.nodes)) if b]
        if limited:
            env["SCALEOUT_LINK_RATE_BPS"] = str(int(min(limited)))
        return env

    # -- lifecycle --------------------------------------------------------------------------------
    def existing(self) -> list[str]:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        names = [line.split()[0] for line in out.splitlines() if line.strip()]
        return sorted(
            (n for n in names if re.fullmatch(rf"{self.name}-n\d+", n)),
            key=lambda n: int(n.rsplit("n", 1)[1]),
        )

    def record_path(self) -> Path:
        return state_dir() / f"{self.name}.json"

    def _write_record(self, owned: bool) -> None:
        """Written before anything is created, so that a kill at any point leaves a record of it."""
        rec = {
            "name": self.name,
            "nodes": self.nodes,
            "namespaces": [self.ns(i) for i in range(self.nodes)],
            "links": [self.bridge] + [f"{self.name}-v{i}" for i in range(self.nodes)],
            "etc_netns": [f"/etc/netns/{self.ns(i)}" for i in range(self.nodes)],
            "rates": [self.rate_of(i) for i in range(self.nodes)],
            "owner_pid": os.getpid() if owned else None,
            "owner_start": start_time(os.getpid()) if owned else None,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        path = self.record_path()
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write(path, json.dumps(rec, indent=1))

    def up(self, owned: bool = False) -> Cluster:
        """Create the cluster. ``owned``: it belongs to this process (a launch's private
        cluster), so ``cluster down --all`` leaves it alone while this process runs."""
        require_root()
        rec = read_records().get(self.name)
        if rec is not None and owner_alive(rec) and rec.get("owner_pid") != os.getpid():
            raise UserError(
                f"emulated cluster {self.name!r} is in use by launch pid {rec['owner_pid']}"
            )
        self.down()  # idempotent: clear leftovers of a crashed run with the same name (as recorded)
        foreign = [n for n in self.existing() if int(n.rsplit("n", 1)[1]) < self.nodes]
        if foreign:
            raise UserError(
                f"network namespace {foreign[0]} exists but scaleout has no record of creating it "
                f"(in {state_dir()}): remove it yourself (ip netns del {foreign[0]}) or pick "
                "another --name"
            )
        self._write_record(owned)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            # c10d's TCPStore listens on an IPv6 socket, so peers show up as ::ffff:a.b.c.d: list
            # both forms.
            hosts = "127.0.0.1 localhost\n::1 localhost\n" + "".join(
                f"{self.addr(i)} {self.ns(i)}\n::ffff:{self.addr(i)} {self.ns(i)}\n"
                for i in range(self.nodes)
            )
            for i in range(self.nodes):
                ns, peer = self.ns(i), f"{self.name}-v{i}"
                _ip("netns", "add", ns)
                _ip("link", "add", peer, "type", "veth", "peer", "name", "veth0", "netns", ns)
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "veth0")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", "veth0", "up")
                _ip("link", "set", peer, "master", self.bridge)
                _ip("link", "set", peer, "up")
                # both ends: egress of the node (veth0) and ingress to it (peer's egress)
                if parse_rate(self.rate_of(i)):
                    tbf = [
                        "root",
                        "tbf",
                        "rate",
                        str(self.rate_of(i)),
                        "burst",
                        TBF_BURST,
                        "latency",
                        TBF_LATENCY,
                    ]
                    _checked(["tc", "-n", ns, "qdisc", "add", "dev", "veth0", *tbf])
                    _checked(["tc", "qdisc", "add", "dev", peer, *tbf])
                # `ip netns exec` bind-mounts this over /etc/hosts: c10d's reverse lookups then
                # succeed.
                os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
                with open(f"/etc/netns/{ns}/hosts", "w") as f:
                    f.write(hosts)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Remove what this cluster's record lists: namespaces (their veth0 and its root-side
        peer go with them), the bridge, the /etc/netns folders; then the record. Nothing without
        a record."""
        if os.geteuid() != 0:
            return
        rec = read_records().get(self.name)
        if rec is None:
            return
        present = set(self.existing())
        for ns in rec.get("namespaces", []):
            if ns in present and re.fullmatch(rf"{re.escape(self.name)}-n\d+", ns):
                _ip("netns", "del", ns, check=False)
        for path in rec.get("etc_netns", []):
            if re.fullmatch(rf"/etc/netns/{re.escape(self.name)}-n\d+", path):
                shutil.rmtree(path, ignore_errors=True)
        links = set(
            re.findall(
                r"^\d+: ([^:@\s]+)[@:]", _ip("-o", "link", "show", check=False).stdout, re.MULTILINE
            )
        )
        for link in rec.get("links", []):
            if link in links and re.fullmatch(rf"{re.escape(self.name)}-(?:v\d+|br)", link):
                _ip("link", "del", link, check=False)
        self.record_path().unlink(missing_ok=True)

    def status(self) -> dict[str, Any]:
        present = self.existing()
        rates = {}
        for ns in present:
            q = subprocess.run(
                ["tc", "-n", ns, "qdisc", "show", "dev", "veth0"], capture_output=True, text=True
            ).stdout
            m = re.search(r"rate (\S+)", q)
            rates[ns] = m.group(1) if m else "unlimited"
        subnet = self.live_subnet() if present else None
        return {"name": self.name, "namespaces": present, "rates": rates, "subnet": subnet}

    def live_subnet(self) -> str | None:
        """The subnet the existing cluster was brought up with (node 0's veth0 address), or None
        when its namespace or address is missing."""
        out = subprocess.run(
            ["ip", "-n", self.ns(0), "-4", "-o", "addr", "show", "dev", "veth0"],
            capture_output=True,
            text=True,
        ).stdout
        m = re.search(r"inet (\d{1,3}\.\d{1,3}\.\d{1,3})\.\d{1,3}/", out)
        return m.group(1) if m else None

    def check_ready(self, nodes: int) -> None:
        present = set(self.existing())
        missing = [self.ns(i) for i in range(nodes) if self.ns(i) not in present]
        if missing:
            raise UserError(
                f"emulated cluster {self.name!r} lacks namespaces {missing}: run `scaleout bench "
                f"cluster up --nnodes {nodes} --name {self.name}`"
            )

    # -- context manager: teardown always runs (exception, SIGTERM, interpreter exit)
    # ---------------
    def __enter__(self) -> Cluster:
        self.up(owned=True)
        self._owned = True
        atexit.register(self._teardown)
        self._old: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._old[sig] = signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through __exit__ -> down()

    def _teardown(self) -> None:
        if self._owned:
            self._owned = False
            self.down()

    def __exit__(self, *exc: object) -> None:
        for sig, h in getattr(self, "_old", {}).items():
            signal.signal(sig, h)
        self._teardown()
        atexit.unregister(self._teardown)
