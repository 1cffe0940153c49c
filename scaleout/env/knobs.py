"""Environment variables every rank reads at start, checked before they are used: the interfaces
that gloo, NCCL and tensorpipe are told to use exist on this machine, and thread counts are
thread counts. A wrong one was gloo's "Unable to find address" traceback from every rank, or a
silent fallback. The launcher checks its own environment before spawning (``scaleout launch``);
every rank checks again (its node may differ: ``srun``, ``mpirun``), naming itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from scaleout.env.addr import interfaces
from scaleout.errors import LaunchEnvError, excerpt

# Variables that name network interfaces (gloo, NCCL, tensorpipe) and thread counts the ranks read.
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
# Read by the process group the rank builds (a wrong one fails its init): checked in every rank.
# NCCL's is only read by a GPU's first collective; `scaleout doctor` reports it per node.
RANK_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
# A thread count above this is a typo, not a setting: far above any machine's hardware threads.
MAX_THREADS = 1 << 16


def check_rank_env(
    env: Mapping[str, str], who: str = "", ifname_vars: Sequence[str] = IFNAME_VARS
) -> None:
    """Interface names and thread counts the ranks will read: the interfaces exist here, the
    counts are positive integers (OpenMP's comma list of nesting levels included). ``who`` starts
    the message (``rank 3: ``)."""
    present = [name for name, _, _ in interfaces()]
    for var in ifname_vars:
        value = env.get(var)
        if value is None:
            continue
        if not value.strip():
            raise LaunchEnvError(
                f"{who}{var}='': expected an interface name ({', '.join(present)})"
            )
        if value.startswith("^"):  # NCCL: exclude these; a name that is absent excludes nothing
            continue
        prefix = var.startswith("NCCL") and not value.startswith("=")
        for name in (n.strip() for n in value.lstrip("=").split(",")):
            ok = any(p.startswith(name) for p in present) if prefix else name in present
            if not name or not ok:
                raise LaunchEnvError(
                    f"{who}{var}={excerpt(value)}: no interface {excerpt(name)} on this machine; "
                    f"expected one of {', '.join(present)}"
                )
    for var in THREAD_VARS:
        value = env.get(var)
        if value is None:
            continue
        parts = value.split(",")
        if not all(p.strip().isdigit() and 1 <= int(p) <= MAX_THREADS for p in parts):
            raise LaunchEnvError(
                f"{who}{var}={excerpt(value)}: expected a thread count from 1 to {MAX_THREADS} "
                "(or a comma list of them)"
            )
