"""``World``: who this rank is, where it runs, and the process groups topology-aware code needs.

Built once by :func:`scaleout.init` and passed explicitly to whatever needs it (no module globals).
Groups are created lazily and once: every rank must touch a group kind (``intra``, ``inter``,
``torus``) in the same order, which collective code does by construction.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from scaleout.env import WorldSpec, detect_environment
from scaleout.env.addr import require_resolvable
from scaleout.env.base import DEVICE_VAR
from scaleout.env.knobs import RANK_IFNAME_VARS, check_rank_env
from scaleout.errors import TopologyError
from scaleout.startup import (
    nccl_defaults,
    process_group_options,
    raise_limits,
    warn_hidden_gpus,
)
from scaleout.topology import resolve_grid

if TYPE_CHECKING:
    from scaleout.config.schema import Config


@dataclass(frozen=True)
class TorusGroups:
    """A 2D grid of x (ranks per row) by y (rows), rows laid out by node (World.torus_rows)."""

    x: int
    y: int
    row: Any  # ProcessGroup of the x ranks in this rank's row (reduce-scatter / all-gather)
    col: Any  # ProcessGroup of the y ranks in this rank's column (all-reduce)
    row_ranks: tuple[int, ...]
    col_ranks: tuple[int, ...]


class World:
    """Rank, node and device facts plus lazily built process groups."""

    def __init__(
        self,
        spec: WorldSpec,
        device: torch.device,
        backend: str,
        node_of: tuple[int, ...],
        timeout_s: float = 600.0,
    ):
        self.spec = spec
        self.device = device
        self.backend = backend
        self.node_of = node_of  # node index of every global rank, as observed after init
        self._groups: dict[tuple[Any, ...], Any] = {}  # rank tuples; ("cpu",)
        self._by_kind: dict[str, Any] = {}
        self._close_hooks: list[Any] = []
        # Collective timeout of every group (the default group's and each subgroup's):
        # init_timeout_s until set_timeout() shortens it after the first step.
        self.timeout_s = float(timeout_s)
        # Seconds the process groups' own timeout adds to timeout_s (given timeout_s): set by the
        # hang watch on NCCL, whose verdict must run before the watchdog's abort
        # (scaleout/train/hangwatch.py); None: the groups time out at timeout_s.
        self.backend_slack: Callable[[float], float] | None = None

    # -- identity ---------------------------------------------------------------------------------
    rank = property(lambda self: self.spec.rank)
    local_rank = property(lambda self: self.spec.local_rank)
    node_rank = property(lambda self: self.spec.node_rank)
    num_nodes = property(lambda self: self.spec.num_nodes)
    local_size = property(lambda self: self.spec.local_size)
    world_size = property(lambda self: self.spec.world_size)
    master_addr = property(lambda self: self.spec.master_addr)
    master_port = property(lambda self: self.spec.master_port)
    launcher = property(lambda self: self.spec.launcher)

    @property
    def ranks_per_node(self) -> list[list[int]]:
        nodes: dict[int, list[int]] = {}
        for r, n in enumerate(self.node_of):
            nodes.setdefault(n, []).append(r)
        return [nodes[n] for n in sorted(nodes)]

    @property
    def uniform(self) -> bool:
        return len({len(r) for r in self.ranks_per_node}) == 1

    def require_uniform(self, what: str) -> None:
        if not self.uniform:
            sizes = [len(r) for r in self.ranks_per_node]
            raise TopologyError(
                f"{what} needs the same number of ranks on every node, got ranks per node {sizes}"
            )

    def __repr__(self) -> str:
        return (
            f"World(rank={self.rank}/{self.world_size}, "
            f"local_rank={self.local_rank}/{self.local_size}, "
            f"node={self.node_rank}/{self.num_nodes}, device={self.device}, "
            f"backend={self.backend}, "
            f"launcher={self.launcher})"
        )

    # -- groups -----------------------------------------------------------------------------------
    @property
    def group(self) -> Any:
        return dist.group.WORLD

    def partition(self, kind: str, parts: list[list[int]], shared: bool = True) -> Any:
        """Create (once) this rank's group of a partition of the ranks; return it.

        Only the members of a group take part in creating it (``use_local_synchronization=True``:
        hashed group names, a member-only rendezvous, no world-wide barrier), and each rank creates
        only the groups it belongs to, so building intra + inter + torus groups costs about as much
        as connecting this rank's own small meshes, not k + g world-wide rendezvous (the measurement
        is in ``scaleout bench allreduce`` -> group_creation). A group equal to the whole world is
        the world group; the same rank list reached through two kinds is one group, unless
        ``shared=False``: then the kind gets its own group (its own NCCL communicator), even for a
        rank list another kind (or the world) already has: group batch norm, whose collectives run
        from the autograd thread while bucket reductions of the same ranks may run from the comm
        thread (NCCL requires one issuing order per communicator). Every rank calls it with the
        same parts, in the same order.
        """
        if kind not in self._by_kind:
            mine = [ranks for ranks in parts if self.rank in ranks]
            if len(mine) != 1:
                raise TopologyError(
                    f"{kind} groups {parts}: rank {self.rank} must be in exactly one of them"
                )
            ranks = tuple(sorted(mine[0]))
            key: tuple[Any, ...] = ranks if shared else (kind, *ranks)
            if key not in self._groups:
                if shared and len(ranks) == self.world_size:
                    self._groups[key] = dist.group.WORLD
                else:
                    self._groups[key] = dist.new_group(
                        list(ranks),
                        timeout=self.backend_timeout(),
                        use_local_synchronization=True,
                    )
            self._by_kind[kind] = self._groups[key]
        return self._by_kind[kind]

    @property
    def intra(self) -> Any:
        """Ranks on this node."""
        self.require_uniform("the intra-node group")
        return self.partition("intra", self.ranks_per_node)

    @property
    def inter(self) -> Any:
        """Ranks with this rank's local rank, one per node."""
        self.require_uniform("the inter-node group")
        return self.partition(
            "inter", [list(col) for col in zip(*self.ranks_per_node, strict=True)]
        )

    @property
    def intra_ranks(self) -> list[int]:
        return self.ranks_per_node[self.node_of[self.rank]]

    @property
    def inter_ranks(self) -> list[int]:
        idx = self.intra_ranks.index(self.rank)
        return [node[idx] for node in self.ranks_per_node]

    def torus_shape(self, x: int | None = None, y: int | None = None) -> tuple[int, int]:
        """Resolve the X x Y grid (:func:`scaleout.topology.resolve_grid`); default X = ranks
        per node."""
        if x is None and y is None:
            self.require_uniform("the default torus grid (x = ranks per node)")
        return resolve_grid(self.world_size, len(self.ranks_per_node[0]), x, y)

    def torus_rows(self, x: int) -> list[list[int]]:
        """The grid's rows: consecutive runs of x ranks in *node* order (node by node, each
        node's ranks in rank order), each sorted. With x = ranks per node a row is exactly one
        node, whether the launcher placed ranks in blocks (node 0 = ranks 0..g-1) or cyclically
        (``srun --distribution=cyclic``, ``mpirun --map-by node``: node 0 = ranks 0, k, 2k, ...);
        x below / above it splits a node / joins consecutive nodes. Column c holds the c-th rank
        of every row (the same shard index)."""
        order = [r for node in self.ranks_per_node for r in node]
        return [sorted(order[i : i + x]) for i in range(0, len(order), x)]

    def torus(self, x: int | None = None, y: int | None = None) -> TorusGroups:
        """Row and column groups of an X x Y grid (Sony's 2D torus, arXiv 1811.05233); rows
        follow the observed node layout (:meth:`torus_rows`)."""
        self.require_uniform("the torus groups")
        x, y = self.torus_shape(x, y)
        key = f"torus{x}x{y}"
        if key not in self._by_kind:
            rows = self.torus_rows(x)
            cols = [[row[c] for row in rows] for c in range(x)]
            row = self.partition(key + "row", rows)
            col = self.partition(key + "col", cols)
            mine = next(r for r in rows if self.rank in r)
            self._by_kind[key] = TorusGroups(
                x, y, row, col, tuple(mine), tuple(next(c for c in cols if self.rank in c))
            )
        return self._by_kind[key]

    @property
    def cpu_group(self) -> Any:
        """The group for object collectives that need a process group (DCP's plans and the shard
        digests): the default group when its collectives run on the CPU (gloo), else one gloo
        group over every rank, created on first use (a collective: every rank's first use is at
        the same point) with lazy connections (:func:`lazy_gloo_group`): a rank connects only the
        peers its collectives talk to, never a world-wide mesh. Small agreements (a checkpoint's
        name, a state's structure) go through the store instead (:mod:`scaleout.store_share`)."""
        if self.device.type == "cpu":
            return dist.group.WORLD
        if ("cpu",) not in self._groups:
            self._groups[("cpu",)] = lazy_gloo_group(self.timeout_s)
        return self._groups[("cpu",)]

    # -- misc -------------------------------------------------------------------------------------
    def barrier(self) -> None:
        dist.barrier()

    def set_timeout(self, seconds: float, *, sync: bool = True) -> None:
        """Set the collective timeout of every group: the default group and every subgroup built so
        far (intra, inter, torus rows/columns, group-BN partitions); groups built later get it too.

        ``sync``: a world barrier first, under the old timeout, so that no rank starts collectives
        under a short timeout while a slower peer is still finishing work the long one allowed
        (torchtitan's ``set_pg_timeouts`` does the same). Every rank must call it with the same
        arguments.
        """

        if sync and dist.is_initialized() and self.world_size > 1:
            dist.barrier()
        self.timeout_s = float(seconds)
        if not dist.is_initialized():
            return
        td = self.backend_timeout()
        for group in {id(g): g for g in (dist.group.WORLD, *self._groups.values())}.values():
            c10d._set_pg_timeout(td, None if group is dist.group.WORLD else group)

    def backend_timeout(self) -> timedelta:
        """The process groups' own timeout: ``timeout_s`` plus ``backend_slack``'s."""
        slack = self.backend_slack(self.timeout_s) if self.backend_slack is not None else 0.0
        return timedelta(seconds=self.timeout_s + slack)

    def add_close_hook(self, fn: Any) -> None:
        """Run ``fn()`` in :meth:`close` before the process groups are destroyed (e.g. stop a
        comm thread: destroying gloo groups while the thread that issued their ops is alive
        aborts the process). A hook that returns False reports a thread it could not stop: the
        groups are then left alone."""
        self._close_hooks.append(fn)

    def close(self) -> None:
        """Orderly shutdown, idempotent: close hooks (comm thread joined), then every process
        group destroyed, which joins gloo's worker threads. :func:`init` registers it to run at
        interpreter exit (see ``_close_at_exit``); calling it explicitly is the same."""
        atexit.unregister(self._close_at_exit)
        hooks, self._close_hooks = self._close_hooks, []
        stopped = True
        for fn in reversed(hooks):
            stopped = fn() is not False and stopped
        if dist.is_initialized() and stopped:
            _release_captured_groups([dist.group.WORLD, *self._groups.values()])
            dist.destroy_process_group()
        self._groups.clear()
        self._by_kind.clear()

    def _close_at_exit(self) -> None:
        """At interpreter exit a script that never called close() still shuts down in order.

        Why: a torch future's done-callbacks run on the thread that completes it (a gloo worker, or
        the scaleout comm thread), after ``wait()`` has already returned to the caller. If the
        script ends while such a callback still has Python to run, that thread meets a finalizing
        interpreter, is unwound through C++ frames that cannot unwind, and the process dies with
        SIGABRT ("terminate called without an active exception"). Destroying the groups joins those
        threads first. ``atexit`` runs handlers last-registered-first, so this runs before the
        handlers torch registered at import (DataLoader, dynamo) and before multiprocessing reaps
        its children.
        """
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 -- at exit: one line, never a traceback over the user's output
            print(
                f"scaleout: rank {self.rank}: shutdown at exit failed: {exc}",
                file=sys.stderr,
                flush=True,
            )

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _release_captured_groups(groups: list[Any]) -> None:
    """Let destroy_process_group really destroy the groups: drop the references torch's own modules
    took.

    ``torch.distributed.nn.functional`` writes ``group=group.WORLD`` as default arguments, evaluated
    when it is imported. Imported after init -- torch.optim imports it through dynamo, so every
    training script does -- its functions keep the default group alive after destroy_process_group:
    the group's worker threads are never joined, and one still running a future's Python callback at
    interpreter exit aborts the process. Replacing such defaults by None keeps their meaning (None
    is the default group).
    """
    ids = {id(g) for g in groups if g is not None}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("torch.distributed"):
            continue
        for fn in list(vars(module).values()):
            # not isinstance: deprecated torch names warn on that
            if type(fn) is not types.FunctionType:
                continue
            defaults = fn.__defaults__
            if defaults and any(id(d) in ids for d in defaults):
                fn.__defaults__ = tuple(None if id(d) in ids else d for d in defaults)


# torch's switch for ProcessGroupGloo's lazy connections, read when a group is constructed
GLOO_LAZY_INIT = "TORCH_GLOO_LAZY_INIT"


def lazy_gloo_group(timeout_s: float) -> Any:
    """A gloo group over every rank whose pairs connect on first use (a collective).

    An eager gloo group connects a full mesh at creation: world - 1 sockets per rank, and every
    rank fetches every other rank's address record from the store (rank 0's store serves world
    squared records: ~69 GB at 2,048 ranks, review gpu-day-two §1). Lazily, a rank connects only
    the peers its collectives use: a broadcast's tree, or the coordinator of a gather. The
    variable is set only while this group is built, so the training backend is unaffected.
    """
    before = os.environ.get(GLOO_LAZY_INIT)
    os.environ[GLOO_LAZY_INIT] = "1"
    try:
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    finally:
        if before is None:
            os.environ.pop(GLOO_LAZY_INIT, None)
        else:
            os.environ[GLOO_LAZY_INIT] = before


def device_index(spec: WorldSpec, env: Mapping[str, str], count: int) -> int:
    """This rank's CUDA device index among the ``count`` visible here (one GPU per rank).

    ``SCALEOUT_DEVICE`` (env.base.DEVICE_VAR) when set: scaleout's launchers give every rank of this
    host its own index across the emulated nodes; an index beyond the visible GPUs is refused (more
    ranks on this host than GPUs). Otherwise the local rank, as torchrun and Slurm give it on real
    nodes. Where each task sees fewer GPUs than there are local ranks (Slurm
    ``--gpus-per-task``/``--gpu-bind`` give each task its own ``CUDA_VISIBLE_DEVICES``), the local
    rank wraps onto the visible ones; whether that shares a physical GPU is what
    :func:`claim_device` checks across ranks.
    """
    given = env.get(DEVICE_VAR, "").strip()
    if not given:
        return spec.local_rank % count
    try:
        index = int(given)
    except ValueError:
        raise TopologyError(f"{DEVICE_VAR}={given!r}: expected a device index >= 0") from None
    if not 0 <= index < count:
        raise TopologyError(
            f"rank {spec.rank}: {DEVICE_VAR}={index} but {count} CUDA device(s) are visible on "
            f"{socket.gethostname()}: {spec.world_size} ranks here would share a GPU (one GPU per "
            "rank: "
            f"at most {count} ranks, or set CUDA_VISIBLE_DEVICES)"
        )
    return index


def pick_device(index: int, backend: str = "auto") -> tuple[torch.device, str]:
    """cuda:index + NCCL when CUDA is present (unless gloo is asked for), else cpu + gloo.
    ``index`` must be a visible device (:func:`device_index` gives it): never wrapped, a wrap
    would share a GPU silently."""
    if torch.cuda.is_available() and backend in ("auto", "nccl"):
        count = torch.cuda.device_count()
        if not 0 <= index < count:
            raise TopologyError(
                f"CUDA device index {index}: only {count} device(s) are visible "
                f"(cuda:0..cuda:{count - 1})"
            )
        dev = torch.device("cuda", index)
        torch.cuda.set_device(dev)
        return dev, "nccl"
    if backend == "nccl":
        raise TopologyError("launch.backend='nccl' needs CUDA, and no CUDA device is visible")
    return torch.device("cpu"), "gloo"


def gpu_identity(device: torch.device) -> str:
    """What names the physical GPU behind ``device`` across processes: its UUID (the same whatever
    CUDA_VISIBLE_DEVICES renumbering a process sees), else host + the visible-devices entry."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if uuid:
        return f"GPU-{uuid}"
    visible = [
        v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()
    ]
    index = device.index or 0
    physical = visible[index] if index < len(visible) else str(index)
    return f"{socket.gethostname()}/{physical}"


def claim_device(store: Any, rank: int, device: torch.device, identity: str) -> None:
    """Record on the rendezvous store that ``rank`` uses the GPU ``identity``; a one-line
    TopologyError when another rank already does. Called after the rendezvous and before the
    first NCCL collective (communicators are created lazily), so NCCL never sees two ranks on one
    device ("Duplicate GPU detected"). One compare-and-set per rank: O(1) store traffic per rank
    at any scale."""
    holder = store.compare_set(f"scaleout/gpu/{identity}", "", str(rank)).decode()
    if holder != str(rank):
        raise TopologyError(
            f"ranks {holder} and {rank} both use {device} ({identity}) on {socket.gethostname()}: "
            "one GPU per rank (fewer ranks per host than visible GPUs, or one CUDA_VISIBLE_DEVICES "
            "entry per task)"
        )


def init(
    config: Config | None = None,
    *,
    env: Mapping[str, str] | None = None,
    environment: str | None = None,
    backend: str | None = None,
    timeout_s: float | None = None,
) -> World:
    """Build the World from whichever launcher started this process and initialise
    torch.distributed.

    ``config`` (a :class:`scaleout.config.Config`) supplies ``launch.env``, ``launch.backend`` and
    the initial collective timeout; explicit keyword arguments win over it.
    """
    env = os.environ if env is None else env
    nccl_defaults(os.environ)  # before CUDA enumerates its devices (CUDA_DEVICE_ORDER)
    launch = getattr(config, "launch", None)
    environment = environment or (launch.env if launch else None)
    backend = backend or (launch.backend if launch else "auto")
    if timeout_s is None:
        timeout_s = config.train.init_timeout_s if config is not None else 600.0
    reader = detect_environment(env, environment)
    spec = reader.read(env)
    # launch.master_addr / master_port, when set, win over the launcher's rendezvous
    if launch is not None:
        given = {"master_addr": launch.master_addr, "master_port": launch.master_port}
        spec = WorldSpec(**{**spec.__dict__, **{k: v for k, v in given.items() if v}})
    cuda = torch.cuda.is_available() and backend in ("auto", "nccl")
    index = device_index(spec, env, torch.cuda.device_count()) if cuda else 0
    device, backend = pick_device(index, backend)
    if device.type == "cuda":
        warn_hidden_gpus(torch.cuda.device_count(), spec.local_size, spec.local_rank)
    if backend == "nccl":
        nccl_error_handling(os.environ)
        if config is not None and config.comm.sharp:  # before the first communicator
            os.environ.setdefault("NCCL_COLLNET_ENABLE", "1")
        nccl_flight_recorder(os.environ, config.train.output_dir if config is not None else None)
    if not dist.is_initialized():
        # before the first socket: the soft open-file limit raised, a too-low hard one refused
        # (scaleout launch's emulated nodes share this host: NCCL uses no network between them)
        hosts = 1 if spec.launcher == "local" else spec.num_nodes
        raise_limits(spec.world_size, hosts, backend, os.environ)
        addr, port = reader.rendezvous(spec)
        check_rank_env(env, f"rank {spec.rank}: ", RANK_IFNAME_VARS)  # gloo's traceback otherwise
        require_resolvable(addr, f"rank {spec.rank}: rendezvous host")  # not 600 s of retries
        spec = WorldSpec(**{**spec.__dict__, "master_addr": addr, "master_port": port})
        dist.init_process_group(
            backend,
            init_method=f"tcp://{addr}:{port}",
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=timedelta(seconds=timeout_s),
            **process_group_options(device),  # CUDA: eager NCCL init, subgroups split from it
        )
    elif dist.get_world_size() != spec.world_size or dist.get_rank() != spec.rank:
        raise TopologyError(
            "torch.distributed is already initialised as rank "
            f"{dist.get_rank()}/{dist.get_world_size()}, "
            f"but the {spec.launcher} environment says {spec.rank}/{spec.world_size}"
        )
    if device.type == "cuda":  # before the first NCCL collective (_observe_topology's)
        claim_device(
            dist.distributed_c10d._get_default_store(), spec.rank, device, gpu_identity(device)
        )
    node_of = _observe_topology(spec)
    world = World(spec, device, backend, node_of, timeout_s)
    # an orderly shutdown even if the script never calls close()
    atexit.register(world._close_at_exit)
    return world


def nccl_error_handling(env: Any) -> None:
    """Make a timed-out or failed NCCL collective end the process (before the first NCCL group
    exists).

    NCCL collectives run asynchronously on the GPU; the watchdog thread of ProcessGroupNCCL notices
    a timeout. With TORCH_NCCL_ASYNC_ERROR_HANDLING=3 ("skip clean-up") it tears the process down at
    once and the launcher stops the job; with 0 the hung rank would sit there, and 1 first aborts
    the communicators, which can itself hang. torchtitan sets 3 for the same reason (and so does
    torch's own default in recent releases; older ones defaulted to no handling). An explicit value
    is respected, with a warning when it leaves hung ranks alive. TORCH_NCCL_DUMP_ON_TIMEOUT=1 with
    TORCH_FR_BUFFER_SIZE>0 additionally dumps the flight recorder on a timeout.
    """
    mode = env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    if mode.strip() in ("0", "2"):
        print(
            f"scaleout: warning: TORCH_NCCL_ASYNC_ERROR_HANDLING={mode} does not end a process "
            "whose NCCL "
            "collective timed out: a hung peer then stalls the job (unset it or use 3)",
            file=sys.stderr,
            flush=True,
        )


def nccl_flight_recorder(env: Any, output_dir: str | None) -> None:
    """Turn ProcessGroupNCCL's flight recorder on (before the first NCCL group exists): a ring
    buffer of the last collectives of every communicator (torch's default is 0: off), dumped by
    NCCL's watchdog on a timeout (TORCH_NCCL_DUMP_ON_TIMEOUT) into ``<output_dir>/
    flight-recorder/rank_<r>`` (the prefix torch appends the rank to; older torch reads the
    TORCH_NCCL_* names). scaleout's hang watch dumps the same buffer there itself before its
    verdict (scaleout/train/hangwatch.py). An explicit value of any of them is respected."""
    # one name per torch: torch >= 2.7 warns on every rank at start-up (C++, on stderr) when the
    # deprecated TORCH_NCCL_TRACE_BUFFER_SIZE is set, and a rank's stderr is a one-line channel
    new = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 7)
    env.setdefault("TORCH_FR_BUFFER_SIZE" if new else "TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    if output_dir:
        folder = os.path.join(os.path.abspath(output_dir), "flight-recorder")
        os.makedirs(folder, exist_ok=True)
        for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
            env.setdefault(name, os.path.join(folder, "rank_"))


def _observe_topology(spec: WorldSpec) -> tuple[int, ...]:
    """All-gather (node_rank, local_rank) and check the launcher's story is consistent."""
    mine = (spec.node_rank, spec.local_rank, socket.gethostname())
    gathered: list[Any] = [None] * spec.world_size
    dist.all_gather_object(gathered, mine)
    seen: dict[tuple[int, int], int] = {}
    for r, (node, local, _host) in enumerate(gathered):
        if (node, local) in seen:
            raise TopologyError(
                f"{spec.launcher} environment: ranks {seen[(node, local)]} and {r} both claim node "
                f"{node} local rank {local}"
            )
        seen[(node, local)] = r
    node_ids = sorted({node for node, _, _ in gathered})
    index = {n: i for i, n in enumerate(node_ids)}
    return tuple(index[node] for node, _, _ in gathered)
