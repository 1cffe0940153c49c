"""An emulated multi-node cluster on one machine: one network namespace per node, joined by a bridge,
with a tc token-bucket rate limit on both ends of every node's link (a full-duplex NIC of that rate).

Layout (../shared/notes/netns-cluster.md): node i = namespace ``<name>-n<i>`` with ``veth0`` =
``<subnet>.(i+1)/24``, loopback up and **no default route**; the root-side peer ``<name>-v<i>`` is
enslaved to the bridge ``<name>-br``, which has no address. Ranks of one node talk over that
namespace's loopback (unshaped); only cross-node traffic meets the rate limit. netem is not in this
kernel, so only bandwidth is emulated, not delay.

Processes that use the cluster's addresses must run *inside* its namespaces
(:meth:`Cluster.wrapper`); from the root namespace those addresses would be routed off the machine.

    with Cluster(nodes=2, rate="1gbit") as c:      # up; always torn down, also on error or SIGTERM
        subprocess.run(c.wrapper(0) + ["ip", "addr"])

``down()`` is idempotent and removes whatever a previous, crashed run left behind.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from typing import Any

from scaleout.errors import UserError

# tbf needs a bucket of at least rate/HZ; 256 kB and 50 ms queueing are what the notes measured
# (iperf3 957 Mbit/s through a 1gbit limit).
TBF_BURST = "256kb"
TBF_LATENCY = "50ms"

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps)$", re.IGNORECASE)
_UNIT_BPS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12, "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}
_NAME = re.compile(r"^[a-z][a-z0-9]{0,7}$")


def parse_rate(rate: str | None) -> float | None:
    """'1gbit' -> 1e9 bits/s (tc's units: bit = bits/s, bps = bytes/s); None/'none' -> unlimited."""
    if rate is None or str(rate).lower() in ("none", "0", "unlimited"):
        return None
    m = _RATE.match(str(rate).strip())
    if not m:
        raise UserError(f"--rate={rate!r}: expected a tc rate like 1gbit, 100mbit, 500kbit or 'none'")
    return float(m.group(1)) * _UNIT_BPS[m.group(2).lower()]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=False) if not check else _checked(["ip", *args])


def _checked(cmd: list[str]) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise UserError(f"emulated cluster: `{' '.join(cmd)}` failed: {p.stderr.strip() or p.stdout.strip()}")
    return p


def require_root() -> None:
    if os.geteuid() != 0:
        raise UserError("the emulated cluster (network namespaces + tc) needs root: run as root or with sudo")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise UserError(f"the emulated cluster needs `{tool}` (Debian: apt-get install iproute2)")


@dataclass
class Cluster:
    """N namespaces on a bridge with a per-node rate limit. Names must fit Linux's 15-char interfaces."""

    nodes: int
    rate: str | None = "1gbit"
    name: str = "so"
    subnet: str = "10.77.0"
    _owned: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, int) or not 1 <= self.nodes <= 250:
            raise UserError(f"--nodes={self.nodes!r}: expected an integer from 1 to 250")
        if not _NAME.match(self.name):
            raise UserError(f"cluster name {self.name!r}: expected 1-8 lowercase letters/digits starting with a letter")
        if not re.match(r"^\d{1,3}\.\d{1,3}\.\d{1,3}$", self.subnet):
            raise UserError(f"cluster subnet {self.subnet!r}: expected three octets like 10.77.0")
        self.rate_bps = parse_rate(self.rate)

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
        env = {"GLOO_SOCKET_IFNAME": "veth0", "TP_SOCKET_IFNAME": "veth0", "MASTER_ADDR": self.addr(0), "SCALEOUT_NETNS": self.name}
        if self.rate_bps:
            env["SCALEOUT_LINK_RATE_BPS"] = str(int(self.rate_bps))
        return env

    # -- lifecycle --------------------------------------------------------------------------------
    def existing(self) -> list[str]:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        names = [line.split()[0] for line in out.splitlines() if line.strip()]
        return sorted((n for n in names if re.fullmatch(rf"{self.name}-n\d+", n)), key=lambda n: int(n.rsplit("n", 1)[1]))

    def up(self) -> Cluster:
        require_root()
        self.down()  # idempotent: clear leftovers of a crashed run with the same name
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            # c10d's TCPStore listens on an IPv6 socket, so peers show up as ::ffff:a.b.c.d: list both forms.
            hosts = "127.0.0.1 localhost\n::1 localhost\n" + "".join(
                f"{self.addr(i)} {self.ns(i)}\n::ffff:{self.addr(i)} {self.ns(i)}\n" for i in range(self.nodes)
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
                if self.rate_bps:  # both ends: egress of the node (veth0) and ingress to it (peer's egress)
                    tbf = ["root", "tbf", "rate", str(self.rate), "burst", TBF_BURST, "latency", TBF_LATENCY]
                    _checked(["tc", "-n", ns, "qdisc", "add", "dev", "veth0", *tbf])
                    _checked(["tc", "qdisc", "add", "dev", peer, *tbf])
                # `ip netns exec` bind-mounts this over /etc/hosts: c10d's reverse lookups then succeed.
                os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
                with open(f"/etc/netns/{ns}/hosts", "w") as f:
                    f.write(hosts)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Remove the namespaces (their veth0 and its root-side peer go with them) and the bridge."""
        if os.geteuid() != 0:
            return
        for ns in self.existing():
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        for m in re.finditer(rf"^\d+: ({re.escape(self.name)}-(?:v\d+|br))[@:]", links, re.MULTILINE):
            _ip("link", "del", m.group(1), check=False)

    def status(self) -> dict[str, Any]:
        present = self.existing()
        rates = {}
        for ns in present:
            q = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", "veth0"], capture_output=True, text=True).stdout
            m = re.search(r"rate (\S+)", q)
            rates[ns] = m.group(1) if m else "unlimited"
        return {"name": self.name, "namespaces": present, "rates": rates}

    def check_ready(self, nodes: int) -> None:
        present = set(self.existing())
        missing = [self.ns(i) for i in range(nodes) if self.ns(i) not in present]
        if missing:
            raise UserError(
                f"emulated cluster {self.name!r} lacks namespaces {missing}: run `scaleout cluster up --nodes {nodes} --name {self.name}`"
            )

    # -- context manager: teardown always runs (exception, SIGTERM, interpreter exit) ---------------
    def __enter__(self) -> Cluster:
        self.up()
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
