"""Addresses of this host: which one other hosts can reach, and which interface is the loopback.

Debian's default /etc/hosts maps the host name to 127.0.1.1, so ``gethostbyname(gethostname())`` is
a loopback address there: a rendezvous at it is unreachable from every other node and the job hangs
until the init timeout. :func:`reachable_address` prefers the address of the interface that routes
to another node of the job, then a non-loopback address of the host name, then any non-loopback
interface address.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
import threading
from collections.abc import Callable, Sequence

from scaleout.errors import LaunchEnvError

# <linux/sockios.h> and <net/if.h>: ioctl request numbers and the loopback flag (stable Linux ABI).
_SIOCGIFFLAGS = 0x8913
_SIOCGIFADDR = 0x8915
_IFF_LOOPBACK = 0x8


def is_loopback(addr: str) -> bool:
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return addr == "localhost"
    return ip.is_loopback or (
        isinstance(ip, ipaddress.IPv6Address)
        and bool(ip.ipv4_mapped and ip.ipv4_mapped.is_loopback)
    )


def resolve(host: str) -> list[str]:
    """IPv4 addresses of a host name (resolver order), [] if it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return []
    return list(dict.fromkeys(info[4][0] for info in infos))


def address_toward(peer: str) -> str | None:
    """The local address the kernel would use to reach ``peer`` (a UDP connect sends no packet)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def interfaces() -> list[tuple[str, str | None, bool]]:
    """(name, IPv4 address or None, is loopback) for every interface, in the kernel's index
    order."""
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack_from("H", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req), 16)[0]
            except OSError:
                continue
            try:
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
            except OSError:
                addr = None
            out.append((name, addr, bool(flags & _IFF_LOOPBACK)))
    return out


def loopback_interface() -> str | None:
    """The loopback interface's name (``lo`` on Linux), found by its flag rather than assumed."""
    return next((name for name, _, loop in interfaces() if loop), None)


def reachable_address(
    peers: Sequence[str],
    hostname: str | None = None,
    *,
    resolve_fn: Callable[[str], list[str]] = resolve,
    toward_fn: Callable[[str], str | None] = address_toward,
    interfaces_fn: Callable[[], list[tuple[str, str | None, bool]]] = interfaces,
) -> str:
    """A non-loopback address of this host for peers on other hosts (names as MPI reports them)."""
    for peer in peers:
        for addr in resolve_fn(peer):
            if is_loopback(addr):
                continue
            local = toward_fn(addr)
            if local and not is_loopback(local):
                return local
    host = hostname or socket.gethostname()
    for addr in resolve_fn(host):
        if not is_loopback(addr):
            return addr
    for _, addr, loop in interfaces_fn():
        if addr and not loop and not is_loopback(addr):
            return addr
    raise LaunchEnvError(
        f"no non-loopback address found for host {host!r} (it resolves to "
        f"{resolve_fn(host) or 'nothing'}): "
        "set MASTER_ADDR to an address the other nodes can reach"
    )


# A resolver that has not answered in this long will not answer a rank either: a working one
# answers in milliseconds, and glibc's own default for an unreachable server is 5 s per try.
LOOKUP_TIMEOUT_S = 5.0


def resolve_within(host: str, timeout_s: float = LOOKUP_TIMEOUT_S) -> list[str] | None:
    """IPv4/IPv6 addresses of ``host``; [] when it does not resolve, None when the resolver did not
    answer within ``timeout_s`` (the lookup runs in a daemon thread, so a hung resolver never holds
    the caller)."""
    found: list[list[str]] = []

    def lookup() -> None:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            found.append([])
            return
        found.append(list(dict.fromkeys(str(i[4][0]) for i in infos)))

    t = threading.Thread(target=lookup, name=f"resolve {host}", daemon=True)
    t.start()
    t.join(timeout_s)
    return found[0] if found else None


def require_resolvable(host: str, what: str, timeout_s: float = LOOKUP_TIMEOUT_S) -> None:
    """One line, at once, when the rendezvous host does not resolve: torch's store would retry
    the lookup until the init timeout (600 s by default) in every rank."""
    found = resolve_within(host, timeout_s)
    if found is None:
        raise LaunchEnvError(
            f"{what}={host!r}: no answer from the name resolver in {timeout_s:g} s; expected a "
            "host name that resolves (or set MASTER_ADDR to an address)"
        )
    if not found:
        raise LaunchEnvError(
            f"{what}={host!r}: does not resolve; expected a host name of this job's nodes "
            "(or set MASTER_ADDR to an address)"
        )
