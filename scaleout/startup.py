"""What a rank settles before it joins the world: its resource limits, the NCCL environment's
defaults and the options of ``init_process_group``.

Limits. Slurm applies the submitting shell's soft limits to every task (``PropagateResourceLimits``
defaults to ALL), so a login shell's ``ulimit -n`` of 1,024 reaches every rank. Rank 0 hosts the
rendezvous store: every rank's process-group client and its heartbeat client connect to it (2 x
world sockets), and on gloo every rank also holds the world group's full mesh (world - 1). The soft
limit is raised to the hard one (an unprivileged process may); a hard limit below the need is one
line naming both numbers, before any socket is opened, on every rank alike. NCCL over InfiniBand or
RoCE registers (pins) its buffers: a locked-memory limit below unlimited makes that registration
fail at the first inter-node collective, so a multi-node NCCL world checks it too.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import MutableMapping
from typing import Any

import torch

from scaleout.errors import TopologyError

# File descriptors a rank uses besides sockets (libraries, logs, data files, loader pipes,
# inductor's workers): a margin, not a measurement of any one machine.
FD_MARGIN = 512


def open_files_needed(world_size: int, backend: str) -> int:
    """File descriptors a rank may need at start (the store host's, so every rank asks alike)."""
    mesh = world_size - 1 if backend == "gloo" else 0  # the gloo world group's own pairs
    return 2 * world_size + mesh + FD_MARGIN


def raise_limits(
    world_size: int,
    num_nodes: int,
    backend: str,
    env: MutableMapping[str, str],
    rlimit: Any = resource,
) -> dict[str, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit; a one-line TopologyError when the hard
    limit is too low for ``world_size`` ranks, or when a NCCL world over ``num_nodes`` > 1 hosts
    (InfiniBand not disabled) may not lock unlimited memory. Returns the soft limits in force
    afterwards."""
    need = open_files_needed(world_size, backend)
    soft, hard = rlimit.getrlimit(rlimit.RLIMIT_NOFILE)
    unlimited = rlimit.RLIM_INFINITY
    if hard != unlimited and hard < need:
        raise TopologyError(
            f"open-file limit (ulimit -n) hard {hard} < {need} needed for {world_size} ranks "
            f"(2 x world store clients{' + the gloo mesh' if backend == 'gloo' else ''} + "
            f"{FD_MARGIN}): raise nofile in /etc/security/limits.conf or the Slurm node's limits"
        )
    if soft != hard:
        rlimit.setrlimit(rlimit.RLIMIT_NOFILE, (hard, hard))
    locked, locked_hard = rlimit.getrlimit(rlimit.RLIMIT_MEMLOCK)
    if backend == "nccl" and num_nodes > 1 and env.get("NCCL_IB_DISABLE", "0").strip() != "1":
        if locked_hard != unlimited:
            raise TopologyError(
                f"locked-memory limit (ulimit -l) hard {locked_hard} bytes, expected unlimited: "
                "NCCL over InfiniBand/RoCE pins its buffers (set memlock unlimited for the nodes, "
                "or NCCL_IB_DISABLE=1 on a cluster without them)"
            )
        if locked != unlimited:
            rlimit.setrlimit(rlimit.RLIMIT_MEMLOCK, (unlimited, unlimited))
    return {
        "nofile": rlimit.getrlimit(rlimit.RLIMIT_NOFILE)[0],
        "memlock": rlimit.getrlimit(rlimit.RLIMIT_MEMLOCK)[0],
    }


# The NCCL/CUDA environment scaleout sets when a variable is unset (docs/scale.md has the table and
# the ones left to the site). Each is a default: a value the user exported wins.
NCCL_DEFAULTS = {
    # CUDA's own order is fastest-first; nvidia-smi, NVML and Slurm's GPU binding use the PCI bus
    # order. Pinned, device index k is the same GPU for all of them on mixed or odd parts.
    "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
}


def nccl_defaults(env: MutableMapping[str, str]) -> dict[str, str]:
    """Set :data:`NCCL_DEFAULTS` where unset (before the first CUDA call); returns what was set."""
    set_now = {k: v for k, v in NCCL_DEFAULTS.items() if k not in env}
    env.update(set_now)
    return set_now


def process_group_options(device: torch.device) -> dict[str, Any]:
    """Extra ``init_process_group`` arguments for ``device``: on CUDA its ``device_id``, which makes
    NCCL create the world communicator eagerly (a hang surfaces at init, not inside step 0's
    backward) and lets ``new_group`` split subgroups from it (``ncclCommSplit``: shared resources,
    no extra full ``ncclCommInitRank`` per intra/inter/torus group)."""
    return {"device_id": device} if device.type == "cuda" else {}


def hidden_gpus_warning(visible: int, local_size: int) -> str | None:
    """The warning when a task sees fewer GPUs than its node runs ranks: per-task device cgroups
    (``srun --gpus-per-task`` under ``ConstrainDevices``) hide the peers' GPUs, and NCCL silently
    falls back from NVLink peer-to-peer to shared memory between the ranks of a node."""
    if 0 < visible < local_size:
        return (
            f"scaleout: warning: this task sees {visible} GPU(s) but its node runs {local_size} "
            "ranks: per-task device cgroups keep NCCL off NVLink peer-to-peer between them "
            "(ask Slurm for --gpus-per-node, not --gpus-per-task)"
        )
    return None


def warn_hidden_gpus(visible: int, local_size: int, local_rank: int) -> None:
    """Print :func:`hidden_gpus_warning` once per node (local rank 0)."""
    text = hidden_gpus_warning(visible, local_size)
    if text and local_rank == 0:
        print(text, file=sys.stderr, flush=True)
