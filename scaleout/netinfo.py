"""What a process can learn about its own network without sending a packet: its interfaces, the
route (address, interface, subnet) to a host, and a link's rate. Standard library only (Linux
ioctls and ``tc``): doctor and the trainer's start-up link exchange both read it."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import socket
import struct
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from scaleout.units import parse_rate

SIOCGIFADDR, SIOCGIFNETMASK = 0x8915, 0x891B


def interfaces() -> list[str]:
    return sorted(name for _, name in socket.if_nameindex())


def _ioctl_addr(name: str, request: int) -> str | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        res = fcntl.ioctl(s.fileno(), request, struct.pack("256s", name[:15].encode()))
        return socket.inet_ntoa(res[20:24])
    except OSError:
        return None
    finally:
        s.close()


def route_to(host: str) -> dict[str, Any]:
    """The address, interface and subnet this process reaches ``host`` from (no packet sent)."""
    out: dict[str, Any] = {"addr": None, "iface": None, "subnet": None}
    try:
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            probe.connect((host, 9))
            out["addr"] = probe.getsockname()[0]
        finally:
            probe.close()
    except OSError:
        return out
    for name in interfaces():
        if _ioctl_addr(name, SIOCGIFADDR) == out["addr"]:
            out["iface"] = name
            mask = _ioctl_addr(name, SIOCGIFNETMASK)
            if mask:
                bits = bin(struct.unpack("!I", socket.inet_aton(mask))[0]).count("1")
                net = struct.unpack("!I", socket.inet_aton(out["addr"]))[0]
                net &= struct.unpack("!I", socket.inet_aton(mask))[0]
                out["subnet"] = f"{socket.inet_ntoa(struct.pack('!I', net))}/{bits}"
            break
    return out


def link_speed_bps(iface: str | None) -> float | None:
    """The link's rate in bit/s: a tc rate limit on it (the emulated cluster's NIC), else the
    negotiated speed in /sys/class/net/<if>/speed; None when neither is known (loopback)."""
    if not iface:
        return None
    if shutil.which("tc"):
        try:
            q = subprocess.run(
                ["tc", "qdisc", "show", "dev", iface], capture_output=True, text=True, timeout=5
            ).stdout
            m = re.search(r"\brate (\S+)", q)
            if m:
                return parse_rate(m.group(1), "tc rate")
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
    try:
        mbit = int(Path(f"/sys/class/net/{iface}/speed").read_text().strip())
        return mbit * 1e6 if mbit > 0 else None
    except (OSError, ValueError):
        return None


def env_netns(env: Mapping[str, str] = os.environ) -> str | None:
    return env.get("SCALEOUT_NETNS") or None
