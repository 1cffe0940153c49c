"""Exchange the torch rendezvous port through horovodrun's HTTP key-value store.

horovodrun --gloo starts an HTTP server (HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT) whose handler stores request
bodies under ``/<scope>/<key>`` on PUT and returns them on GET (404 until set). Rank 0 picks a free port
and PUTs it; the others poll GET until it appears.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request

from scaleout.env.base import free_port
from scaleout.errors import EnvironmentError_

_SCOPE = "scaleout"


def exchange_port(addr: str, kv_port: int, rank: int, key: str = "master_port", timeout_s: float = 120.0) -> int:
    url = f"http://{addr}:{kv_port}/{_SCOPE}/{key}"
    if rank == 0:
        port = free_port("0.0.0.0")
        req = urllib.request.Request(url, data=str(port).encode(), method="PUT")
        urllib.request.urlopen(req, timeout=10).read()
        return port
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return int(resp.read().decode())
        except (urllib.error.HTTPError, urllib.error.URLError, ValueError):
            time.sleep(0.2)
    raise EnvironmentError_(f"horovod environment: no rendezvous port published at {url} within {timeout_s:.0f} s")
