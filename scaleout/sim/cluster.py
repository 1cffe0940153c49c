"""Clusters for the cost model: link constants (alpha, beta, gamma) plus node shape, and presets.

The model is the classic alpha-beta-gamma one (Hockney; Thakur, Rabenseifner & Gropp 2005,
"Optimization of collective communication operations in MPICH"): a message of m bytes over a link
costs ``alpha + m * beta`` and reducing m bytes costs ``m * gamma``. We keep separate constants for
the two kinds of link a data-parallel job sees, and one per-call overhead:

    base         s      fixed cost of one collective call (kernel launch / gloo dispatch)
    alpha_intra  s      per ring step between two ranks of one node (NVLink, loopback)
    alpha_inter  s      per ring step that crosses nodes (NIC, switch, software stack)
    beta_intra   s/B    per byte sent by one rank to a peer in its node (1 / achievable bandwidth)
    beta_inter   s/B    per byte through ONE NIC (1 / achievable NIC bandwidth)
    gamma        s/B    per byte reduced (CPU add for gloo; ~0 on GPUs, where NCCL fuses the add
    into the
                        copy kernel and it hides under link time)
    alpha_sharp  s      one in-network (SHARP) reduction between nodes: up the switch aggregation
    tree and
                        back, whatever the number of nodes (used only on clusters with
                        ``sharp=True``)

``Constants`` is also the vector that calibration fits (same order as ``PARAMS``).

Preset numbers and where they come from (every one is an assumption you can override on the CLI):
- NVLink per-link *achievable* bandwidth is NCCL's own topology model (src/graph/topo.h):
  SM80_NVLINK_BW = 20 GB/s of the nominal 25 GB/s (80 %), SM90_NVLINK_BW = 20.6 GB/s. A100 has 12
  NVLink3 links (600 GB/s bidirectional = 300 GB/s each way), H100/H200 18 NVLink4 links (900 GB/s
  bidirectional).
- NIC achievable bandwidth: NCCL's NET_BW = 12 GB/s for a 100 Gbit/s NIC (12.5 GB/s nominal, 96 %).
  DGX A100: 8 x HDR 200 Gb/s ConnectX-6 for compute; DGX H100 / H200: 8 x NDR 400 Gb/s ConnectX-7.
- Latencies: NCCL's tuning model (src/graph/tuning.cc) for the Simple protocol ring: baseLat 8.4 us
  per call, hwLat 3.4 us per NVLink step and 14 us per network step.
- SHARP (Graham et al. 2016, "Scalable Hierarchical Aggregation Protocol (SHArP)", COMHPC; NVIDIA
  SHARP docs: the switches reduce, so data is not sent several times between endpoints): NCCL's
  CollNet algorithms. tuning.cc charges one network latency per call,
  hwLat[NET][CollNetDirect][Simple] = 31 us, instead of 2 log2(k) tree or 2(k-1) ring steps, and
  scales CollNetDirect's bandwidth by 0.85 on compute capability >= 9.0 (Hopper), which
  ``sharp_efficiency`` carries. Each node sends its data once and receives the result once, so a
  node's NICs carry ~1 x n each way instead of 2(k-1)/k x n (ring) or 2 x n (double binary tree).
  Off unless asked for (``cluster.sharp=true``): it needs SHARP-capable InfiniBand switches, the
  NCCL SHARP plugin and ``NCCL_COLLNET_ENABLE=1`` (MLPerf BERT jobs ran with
  ``SBATCH_NETWORK=sharp``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from scaleout.errors import ConfigError
from scaleout.sim.cost import PARAMS  # the constants vector's order (the cost algebra's)

GB = 1e9


@dataclass(frozen=True)
class Constants:
    base: float = 0.0
    alpha_intra: float = 0.0
    alpha_inter: float = 0.0
    beta_intra: float = 0.0
    beta_inter: float = 0.0
    gamma: float = 0.0
    alpha_sharp: float = 0.0

    def vector(self) -> list[float]:
        return [getattr(self, k) for k in PARAMS]

    @classmethod
    def from_vector(cls, values: Any) -> Constants:
        return cls(**{k: float(v) for k, v in zip(PARAMS, values, strict=True)})

    def describe(self) -> dict[str, str]:
        """Human units: microseconds and GB/s."""
        bw = lambda beta: f"{1 / beta / GB:.3g} GB/s" if beta > 0 else "inf"  # noqa: E731
        return {
            "base": f"{self.base * 1e6:.3g} us",
            "alpha_intra": f"{self.alpha_intra * 1e6:.3g} us",
            "alpha_inter": f"{self.alpha_inter * 1e6:.3g} us",
            "beta_intra": bw(self.beta_intra),
            "beta_inter": bw(self.beta_inter) + " per NIC",
            "gamma": bw(self.gamma) + " reduce" if self.gamma > 0 else "0 (hidden)",
            "alpha_sharp": f"{self.alpha_sharp * 1e6:.3g} us"
            if self.alpha_sharp > 0
            else "no in-network reduction",
        }


@dataclass(frozen=True)
class Device:
    """One accelerator: peak dense half-precision FLOP/s, HBM bandwidth (for the optimizer
    step) and HBM capacity in bytes (the planner's fit check; 0: unknown, not checked)."""

    name: str
    peak_flops: float
    mem_bw: float
    mem_bytes: float = 0.0


@dataclass(frozen=True)
class Cluster:
    """Per-node shape and link constants; the number of nodes is chosen per query."""

    name: str
    gpus_per_node: int
    nics_per_node: int
    constants: Constants
    # How many NICs one logical ring/tree can drive at once. NCCL splits a collective into channels,
    # at least one per NIC on DGX systems, so it is nics_per_node; a gloo process drives one socket
    # stream.
    streams_per_ring: int = 1
    # Fraction of one NIC a single stream fills. 1 for RDMA (one QP saturates a NIC); < 1 for TCP,
    # where one socket cannot fill a fast link (why NCCL 2.4 added NCCL_NSOCKS_PERTHREAD).
    stream_fraction: float = 1.0
    device: Device | None = None
    # "nccl": textbook primitives. "gloo": torch's CPU gloo path, measured on this machine (2 ranks,
    # 8 MiB): reduce_scatter costs a full all_reduce (the whole input is all-reduced, then sliced),
    # reduce ~ all_reduce, and all_gather into a list adds a copy of the whole output.
    backend: str = "nccl"
    # In-network reduction (SHARP via NCCL CollNet) for the inter-node all-reduce of tree,
    # hierarchical and torus2d (see the module docstring); sharp_efficiency: fraction of the NIC
    # rate it reaches.
    sharp: bool = False
    sharp_efficiency: float = 1.0
    description: str = ""
    sources: tuple[str, ...] = field(default_factory=tuple)

    def with_constants(self, **changes: float) -> Cluster:
        return replace(self, constants=replace(self.constants, **changes))

    def inter_streams(self, rings_crossing: int) -> float:
        """NIC-equivalents busy when ``rings_crossing`` rings leave a node at once
        (streams_per_ring each)."""
        return max(
            self.stream_fraction,
            min(self.nics_per_node, rings_crossing * self.streams_per_ring * self.stream_fraction),
        )

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        d["constants"] = self.constants.describe()
        return d


def _nvlink(links: int, per_link_gbs: float) -> float:
    return 1.0 / (links * per_link_gbs * GB)


def _nic(gbits: float, efficiency: float = 0.96) -> float:
    return 1.0 / (gbits / 8 * efficiency * GB)


# tuning.cc, ring / Simple protocol
_NCCL_LAT = dict(base=8.4e-6, alpha_intra=3.4e-6, alpha_inter=14e-6)
# tuning.cc hwLat[NET][CollNetDirect][Simple]: one network latency per in-network reduction
_SHARP_LAT = 31e-6
_SHARP_HOPPER = 0.85  # tuning.cc: CollNetDirect busBw *= .85 when minCompCap >= 90

# A100 datasheet: fp16/bf16 dense
A100 = Device("A100-SXM4-80GB", peak_flops=312e12, mem_bw=2.039e12, mem_bytes=80e9)
H100 = Device(
    "H100-SXM5-80GB", peak_flops=989e12, mem_bw=3.35e12, mem_bytes=80e9
)  # H100 datasheet: bf16 dense
H200 = Device(
    "H200-SXM-141GB", peak_flops=989e12, mem_bw=4.8e12, mem_bytes=141e9
)  # same GH100 die, faster HBM3e
V100 = Device("V100-SXM2-16GB", peak_flops=125e12, mem_bw=0.9e12, mem_bytes=16e9)

PRESETS: dict[str, Cluster] = {
    "dgx-a100": Cluster(
        "dgx-a100",
        8,
        8,
        Constants(
            **_NCCL_LAT, beta_intra=_nvlink(12, 20.0), beta_inter=_nic(200), alpha_sharp=_SHARP_LAT
        ),
        streams_per_ring=8,
        device=A100,
        description=(
            "DGX A100 SuperPOD: 8 x A100, NVLink3 (12 links) via NVSwitch, 8 x HDR 200 Gb/s"
        ),
        sources=(
            "NCCL topo.h SM80_NVLINK_BW=20 GB/s/link",
            "NCCL NET_BW=12 GB/s per 100 Gb/s",
            "NCCL tuning.cc ring Simple latencies",
            "NCCL tuning.cc CollNetDirect NET latency (SHARP)",
        ),
    ),
    "dgx-h100": Cluster(
        "dgx-h100",
        8,
        8,
        Constants(
            **_NCCL_LAT, beta_intra=_nvlink(18, 20.6), beta_inter=_nic(400), alpha_sharp=_SHARP_LAT
        ),
        streams_per_ring=8,
        device=H100,
        sharp_efficiency=_SHARP_HOPPER,
        description=(
            "DGX H100 SuperPOD: 8 x H100, NVLink4 (18 links) via NVSwitch, 8 x NDR 400 Gb/s"
        ),
        sources=(
            "NCCL topo.h SM90_NVLINK_BW=20.6 GB/s/link",
            "NCCL NET_BW=12 GB/s per 100 Gb/s",
            "NCCL tuning.cc CollNetDirect NET latency and Hopper factor (SHARP)",
        ),
    ),
    "h200-superpod": Cluster(
        "h200-superpod",
        8,
        8,
        Constants(
            **_NCCL_LAT, beta_intra=_nvlink(18, 20.6), beta_inter=_nic(400), alpha_sharp=_SHARP_LAT
        ),
        streams_per_ring=8,
        device=H200,
        sharp_efficiency=_SHARP_HOPPER,
        description="DGX H200 SuperPOD-like: 8 x H200, NVLink4 (900 GB/s bidir), 8 x NDR 400 Gb/s",
        sources=("same fabric as DGX H100; H200 differs in HBM (141 GB, 4.8 TB/s)",),
    ),
    # The emulated cluster of /work/shared/notes/netns-cluster.md: ranks of one node talk over
    # loopback (~33 Gbit/s), nodes over a tc-shaped 1 Gbit/s veth (Python sockets measured ~118 MB/s
    # each way). alpha/gamma/base are rough starting values; `scaleout simulate calibrate` fits the
    # real ones.
    "netns-1g": Cluster(
        "netns-1g",
        2,
        1,
        Constants(
            base=100e-6,
            alpha_intra=30e-6,
            alpha_inter=120e-6,
            beta_intra=1 / 4.1e9,
            beta_inter=1 / 118e6,
            gamma=1 / 2.0e9,
        ),
        streams_per_ring=1,
        device=None,
        backend="gloo",
        description="emulated netns cluster: gloo on CPU, loopback inside a node, 1 Gbit/s between "
        "nodes",
        sources=("/work/shared/notes/netns-cluster.md",),
    ),
    # A 2018 Horovod-era cluster for the issue #542 comparison (assumptions, see
    # scaleout.sim.validate): 8 x V100 per node over NVLink (V100: 6 links; NCCL topo.h
    # SM70_NVLINK_BW = 20 GB/s per link), ONE 25 Gbit/s Ethernet NIC per node driven over TCP
    # sockets (90 % of line rate), a 30 us network step, and one TCP stream filling half the NIC
    # (NCCL <= 2.3 opened one socket per ring).
    "horovod-2018": Cluster(
        "horovod-2018",
        8,
        1,
        Constants(
            base=20e-6,
            alpha_intra=5e-6,
            alpha_inter=30e-6,
            beta_intra=_nvlink(6, 20.0),
            beta_inter=_nic(25, 0.9),
        ),
        streams_per_ring=1,
        stream_fraction=0.5,
        device=V100,
        description="2018 cluster: 8 x V100 NVLink per node, one 25 Gbit/s NIC per node, TCP/RoCE",
        sources=("assumed; horovod issue #542 reports only the efficiencies",),
    ),
}


def get_cluster(name: str) -> Cluster:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown cluster preset {name!r}; expected one of {', '.join(PRESETS)}"
        ) from None


def with_sharp(cluster: Cluster, on: bool | None) -> Cluster:
    """The cluster with in-network reduction switched on or off (None: unchanged)."""
    if on is None:
        return cluster
    if on and (cluster.backend != "nccl" or cluster.constants.alpha_sharp <= 0):
        raise ConfigError(
            f"cluster {cluster.name!r} has no in-network reduction (SHARP needs NCCL over "
            f"SHARP-capable InfiniBand: dgx-a100, dgx-h100, h200-superpod)"
        )
    return replace(cluster, sharp=bool(on))


def custom_cluster(
    base: Cluster,
    gpus_per_node: int | None = None,
    nics_per_node: int | None = None,
    intra_gbs: float | None = None,
    inter_gbit: float | None = None,
    intra_lat_us: float | None = None,
    inter_lat_us: float | None = None,
) -> Cluster:
    """A preset with some facts replaced (CLI flags). Bandwidths are *achievable* values."""
    for label, v in (("gpus per node", gpus_per_node), ("NICs per node", nics_per_node)):
        if v is not None and v < 1:
            raise ConfigError(f"{label} must be >= 1, got {v}")
    for label, v in (("intra bandwidth", intra_gbs), ("inter bandwidth", inter_gbit)):
        if v is not None and not (v > 0 and math.isfinite(v)):
            raise ConfigError(f"{label} must be a positive number, got {v}")
    c = base.constants
    c = replace(
        c,
        beta_intra=1 / (intra_gbs * GB) if intra_gbs else c.beta_intra,
        beta_inter=1 / (inter_gbit / 8 * GB) if inter_gbit else c.beta_inter,
        alpha_intra=intra_lat_us * 1e-6 if intra_lat_us is not None else c.alpha_intra,
        alpha_inter=inter_lat_us * 1e-6 if inter_lat_us is not None else c.alpha_inter,
    )
    nics = nics_per_node or base.nics_per_node
    return replace(
        base,
        gpus_per_node=gpus_per_node or base.gpus_per_node,
        nics_per_node=nics,
        streams_per_ring=nics if base.streams_per_ring > 1 else 1,
        constants=c,
    )
