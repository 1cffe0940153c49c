"""Exchange the torch rendezvous address and port through horovodrun's HTTP key-value store.

horovodrun --gloo starts an HTTP server (HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT) whose handler stores
request bodies under ``/<scope>/<key>`` on PUT and returns them on GET (404 until set). Rank 0
publishes its own address and a free port as JSON; the others poll GET until it appears. Rank 0's
address, not horovodrun's: the driver may run on a login node that hosts no rank.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from scaleout.env.base import free_port
from scaleout.errors import LaunchEnvError

_SCOPE = "scaleout"


def _parse(body: bytes, url: str) -> tuple[str, int]:
    try:
        value = json.loads(body.decode())
        addr, port = str(value["addr"]), int(value["port"])
    except (ValueError, KeyError, TypeError):
        raise LaunchEnvError(
            f"horovod environment: {url} holds {body[:80]!r}, expected {{addr, port}}"
        ) from None
    if not addr or not 1 <= port <= 65535:
        raise LaunchEnvError(
            f"horovod environment: {url} holds addr={addr!r} port={port}, expected a port 1-65535"
        )
    return addr, port


def exchange_master(
    kv_addr: str,
    kv_port: int,
    rank: int,
    addr: str | None = None,
    port: int | None = None,
    key: str = "master",
    timeout_s: float = 120.0,
) -> tuple[str, int]:
    """Rank 0 PUTs (addr, port or a free one) and returns it; the other ranks GET it (polling)."""
    url = f"http://{kv_addr}:{kv_port}/{_SCOPE}/{key}"
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        if addr is None:
            raise LaunchEnvError("horovod environment: rank 0 needs its own address to publish")
        port = port or free_port("127.0.0.1" if addr.startswith("127.") else "0.0.0.0")
        body = json.dumps({"addr": addr, "port": port}).encode()
        while True:
            try:
                urllib.request.urlopen(
                    urllib.request.Request(url, data=body, method="PUT"), timeout=10
                ).read()
                return addr, port
            except (urllib.error.URLError, OSError) as exc:
                if time.monotonic() > deadline:
                    raise LaunchEnvError(
                        f"horovod environment: cannot publish the rendezvous at {url}: {exc}"
                    ) from None
                time.sleep(0.2)
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return _parse(resp.read(), url)
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    raise LaunchEnvError(
        f"horovod environment: no rendezvous published at {url} within {timeout_s:.0f} s"
    )
