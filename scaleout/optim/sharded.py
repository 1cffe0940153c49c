"""Sharded LAMB (ZeRO stage 1, the pattern of apex's DistributedFusedLAMB): each rank keeps 1/world
of the state.

Layout: the DataParallel reducer's buckets (:mod:`scaleout.parallel.buckets`: parameters in reverse
order, a bucket closed once it reaches ``bucket_mb``; ``overlap=False``: one bucket). Each bucket is
one flat buffer padded to a multiple of the world size, every parameter a view of it (``p.data``
re-pointed once, as in apex), so the all-gather writes the weights in place; this rank owns slice
``scaleout.comm.shard_index`` of each.

Per step every rank issues the same collectives in the same order (c10d matches them by order):

1. Gradients go into each bucket's fp32 buffer, which is reduce-scattered with the configured
   algorithm of ``scaleout.comm`` (flat, hierarchical, torus2d), in bucket order. ``overlap=True``
   works as the reducer: a post-accumulate-grad hook marks a parameter ready and a complete bucket
   goes out at once (strictly in index order); at the end of backward (an autograd callback) every
   parameter it gave no gradient is marked ready with its ``.grad`` or zero, the rest is launched
   and all are waited for. So every rank sends every bucket once per synchronising backward
   whichever parameters it used, and nothing is in flight after backward (a skipped step is just
   ``zero_grad()``). ``overlap=False``: sent in :meth:`step`.
2. LAMB on this rank's slices, in cache-sized chunks; the per-tensor ||w||^2 and ||u||^2 are partial
   sums, made whole by one all-reduce of a [4, tensors] vector whose third row is the reducer's
   usage (which parameters got a gradient on some rank) and whose [3, 0] counts the non-finite
   elements of the reduced gradient shards, riding on a collective that runs anyway. The norms
   are computed from the moments the step *would* write (out of place, chunk by chunk), so a
   non-finite count skips the step on every rank with nothing written (:attr:`skipped`; the
   trainer then needs no agreement of its own after the gradients). A parameter no rank used is
   an error naming it unless ``allow_unused=True`` (then its gradient is zero, as in
   DataParallel). Global clipping all-reduces one scalar first.
3. Each bucket's update is applied and its all-gather starts at once (gathers overlap later
   updates). Built with ``module`` (the factory passes the model), step() returns without waiting
   for them: a forward pre-hook on every module holding parameters waits for that module's
   buckets only (``Handle.wait()``: a stream wait on CUDA, no host sync), so the gathers overlap
   the next forward; :meth:`wait_params` waits for all (state_dict, sharded_state, the next step,
   and the trainer before a checkpoint or an evaluation). Without ``module`` step() waits.

Shard modes (``optim.shard``): ``world`` (above: each rank keeps 1/W of the state) and ``node``
(NVIDIA's DistributedFusedLAMB): each rank keeps 1/g of the state, g = ranks per node; the
gradients are reduce-scattered within the node, the slice all-reduced over the same-local-rank
peers of the other nodes (which hold the same slice and make the same update), the parameters
all-gathered within the node. The norm all-reduce stays within the node too (the other nodes hold
the same slices and sum the same values); only the usage crosses the nodes, as its own world
all-reduce issued with the last bucket (done by the time the reduce-scatters are), and not at all
with ``allow_unused=True``.

Wire dtype (``compression`` = ``comm.compression``): none = fp32 reduce-scatter (sum, then / W).
bf16/fp16: each rank's bucket is divided by W in fp32 and rounded once to the wire dtype, moved
by all-to-all (the bytes of a reduce-scatter, half of fp32's) and every received slice summed in
fp32 (:meth:`_compressed` gives the exact arithmetic). The parameters are all-gathered in their
own dtype. With ``shard=world`` compression needs ``algorithm='flat'``.

Equal to LAMB on the rank-averaged gradient (sums in another order). Accumulation: :meth:`no_sync`.

**Under CUDA graphs** (:meth:`use_graphs`, set by the trainer's ``model.cuda_graphs``): a graph
replays device work only, so step() then reads nothing on the host and keeps no per-step value
in Python arguments, and the captured step is the whole step (scaleout/train/capture.py):

- the per-group scalars that change with the step (learning rate, the bias corrections folded into
  eps', wd/k and k) are a small device tensor copied in from a pinned host buffer that the host
  writes before every run of the step (:meth:`stage`: step() itself when not capturing, the step
  graphs before each replay), so a replay reads this step's values, not the capture's;
- the global clip factor is computed on the device and applied to the reduced gradient shard;
- a non-finite reduced gradient does not skip on the host: its count still rides in the norm
  all-reduce, the shard is zeroed where non-finite, and the update is blended with a 0/1 device
  weight (``lerp`` with weight 1 is exactly the new value, with weight 0 exactly the old one), so a
  skipped step writes the state it read. :meth:`nonfinite_flag` is that device verdict; the trainer
  reads it with the step's agreement and calls :meth:`settle`, which counts the step;
- unused parameters: the usage is still summed on the device; :meth:`unused_flag` answers it, read
  with the agreement, and :meth:`check_unused` names them (a graph replays the backward it
  captured, so the usage is the capture's);
- the all-gathers are waited for inside step() (a capture must join every stream it forked), still
  overlapping the later buckets' updates.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from torch.autograd import Variable

from scaleout.comm.api import WorkHandle, dispatch
from scaleout.comm.collective import Collective
from scaleout.comm.grid import all_gather_tensor, reduce_scatter_tensor
from scaleout.config.schema import check_sharded_wire
from scaleout.errors import ConfigError, UserError
from scaleout.optim.base import CheckedGroups, check_hparams, clip_factor, scalars, sq_norms
from scaleout.optim.chunks import default_chunk, pieces, plan_chunks
from scaleout.optim.lamb import LambCoeffs, direction, new_moments, trust_ratios, update_moments
from scaleout.parallel.buckets import MiB, assign, fingerprint, layout_hash
from scaleout.parallel.reducer import compression_dtype
from scaleout.units import DEFAULT_BUCKET_MB

if TYPE_CHECKING:
    from scaleout.world import World

# sharded_state()'s format: per-parameter pieces, the same for optim.shard=world and node (so a
# checkpoint of either layout loads into the other); state_dict()'s layout names the shard mode.
FORMAT = "scaleout.ShardedLAMB/2"
SHARDS = ("world", "node")


class Piece(NamedTuple):
    """This rank's part of one parameter's optimizer state, in the parameter's own coordinates."""

    tensor: torch.Tensor  # a view of the moment shard (loading writes into it)
    offset: int  # first element of the flattened parameter it holds
    numel: int  # the parameter's element count (the global size)
    # optim.shard=node: a copy of what the same local rank of node 0 holds; loaded, never written
    # (a sharded checkpoint stores every element once)
    replica: bool = False


@dataclass
class _Work:
    """One group's part of one bucket slice, cut into cache-sized chunks (lists of views)."""

    group: int
    P: list[list[torch.Tensor]]
    G: list[list[torch.Tensor]]
    M: list[list[torch.Tensor]]
    V: list[list[torch.Tensor]]
    owner: list[torch.Tensor]  # per chunk: index in the group of each piece's tensor


@dataclass
class ShardBucket:
    index: int
    members: list[int]  # parameter indices (optimizer order), in buffer order
    flat_param: torch.Tensor  # padded; the members' .data are views of it
    flat_grad: torch.Tensor
    p_shard: torch.Tensor  # this rank's slice of flat_param
    g_shard: torch.Tensor  # the reduce-scatter's output (a view of ShardedLAMB.g_shard)
    work: list[_Work]


class ShardedLAMB(CheckedGroups, torch.optim.Optimizer):
    """LAMB whose moments are sharded over ``world`` (same hyper-parameters and rules as
    :class:`LAMB`).

    Call :meth:`step` after backward on every rank with the rank's *local* (unreduced) gradients:
    the optimizer averages them itself, so do not also all-reduce them. All parameters must share
    one dtype and device. ``algorithm`` (+ ``x``/``y`` for torus2d) picks the reduce-scatter /
    all-gather of :mod:`scaleout.comm`. ``param_order`` (e.g. ``model.parameters()``): the
    registration order whose reverse fills the buckets (default: the groups' order, which
    interleaves layers when groups split weights from biases). Checkpoints: :meth:`sharded_state`
    (any world size, via ``torch.distributed.checkpoint``); ``state_dict`` is this rank's shard for
    the same layout only.
    """

    HPARAMS = ("lr", "betas", "eps", "weight_decay", "trust_clamp")

    def __init__(
        self,
        params: Any,
        world: World,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = True,
        trust_clamp: float | None = None,
        trust_ratio: bool | None = None,
        clip_grad_norm: float | None = None,
        chunk: int | None | str = "auto",
        *,
        overlap: bool = False,
        bucket_mb: float = DEFAULT_BUCKET_MB,
        algorithm: str | Collective = "flat",
        allow_unused: bool = False,
        param_order: Any = None,
        profile: bool = False,
        shard: str = "world",
        compression: Any = None,
        module: torch.nn.Module | None = None,
        **algorithm_options: Any,
    ):
        check_hparams("ShardedLAMB", clip_grad_norm=clip_grad_norm)
        if world is None:
            raise ConfigError(
                "ShardedLAMB needs the World (optim.sharded=true needs a distributed run)"
            )
        if not (isinstance(bucket_mb, int | float) and bucket_mb > 0 and math.isfinite(bucket_mb)):
            raise ConfigError(
                f"ShardedLAMB bucket_mb={bucket_mb!r} must be a positive number of MiB"
            )
        if shard not in SHARDS:
            raise ConfigError(f"ShardedLAMB shard={shard!r}: expected one of {', '.join(SHARDS)}")
        self.wire = compression_dtype(compression) if compression not in (None, "none") else None
        self.world, self.size, self.shard = world, world.world_size, shard
        name = algorithm if isinstance(algorithm, str) else algorithm.name
        # the world reduce-scatter / all-gather, resolved once (node: the node's own groups)
        self.comm: Collective | None = None
        if shard == "node":  # NVIDIA DistributedFusedLAMB: shard over the node, replicate across
            self.intra, self.inter = world.intra, world.inter
            self.local = len(world.intra_ranks)  # slices per bucket
            self.slot = world.intra_ranks.index(world.rank)
            self.node_index = world.inter_ranks.index(world.rank)
        else:  # the schema's rule (Config.check_world), for callers that bypass the config
            wire = None if self.wire is None else compression
            check_sharded_wire(name, wire, shard, self.size)
            self.local, self.node_index = self.size, 0
            self.comm = Collective.resolve(world, algorithm, "shard_index", **algorithm_options)
            self.slot = self.comm.shard_index()  # the slice owned here
        # (the averaging of the gradients: after the sum in fp32, or before the wire cast)
        self._post_divide = self.wire is None
        # the all-gathers of the last step() not waited for yet (module: waited per bucket by the
        # next forward's pre-hooks; without one, step() waits for them itself)
        self._gathers: list[Any] = []
        self._defer = module is not None
        self.overlap, self.bucket_mb, self.allow_unused = overlap, float(bucket_mb), allow_unused
        self.clip_grad_norm, self.profile = clip_grad_norm, profile
        self.timings: dict[str, float] = {}
        self.last_stats: dict[str, Any] = {}
        # For the heartbeat (scaleout/train/liveness.py Progress.watch): collectives issued so far
        # and whether the gradients' reduce-scatters are being waited for. Plain writes only.
        self.issued, self.waiting = 0, False
        self._built, self._sync, self._in_backward = False, True, False
        self._unscale = 1.0  # fp16: 1/S for the reduced gradients of the next step (unscale_)
        # the last step() found a non-finite reduced gradient and left everything as it was
        self.skipped = False
        # optim.shard=node over several nodes: the norm all-reduce stays within the node, so the
        # usage goes over the world on its own (_launch_usage)
        self._world_usage = shard == "node" and self.size > self.local and not allow_unused
        self._usage_work: Any = None
        self.graphed = False  # use_graphs(): step() runs on the device only (module docstring)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            trust_clamp=trust_clamp,
            trust_ratio=trust_ratio,
        )
        super().__init__(params, defaults)
        self._build(chunk, None if param_order is None else list(param_order))
        if module is not None:
            self._attach(module)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._built:
            raise ConfigError(
                "ShardedLAMB: pass every parameter group at construction (the flat layout is fixed)"
            )
        super().add_param_group(param_group)

    # -- layout -----------------------------------------------------------------------------------
    def _build(self, chunk: int | None | str, param_order: list[torch.Tensor] | None) -> None:
        groups = self.param_groups
        self.params = [p for g in groups for p in g["params"]]
        self._where = [(gi, i) for gi, g in enumerate(groups) for i in range(len(g["params"]))]
        names = [g.get("names") for g in groups]
        full = all(
            n is not None and len(n) == len(g["params"]) for n, g in zip(names, groups, strict=True)
        )
        self.keys = [names[gi][i] if full else f"group{gi}.{i}" for gi, i in self._where]
        kinds = {(p.dtype, p.device) for p in self.params}
        if len(kinds) != 1:
            raise ConfigError(
                "ShardedLAMB needs one dtype and device for all parameters, got "
                f"{sorted(map(str, kinds))}"
            )
        dtype, device = kinds.pop()
        gdtype = torch.float32 if dtype != torch.float64 else dtype
        order = list(range(len(self.params)))[::-1]  # backward meets the last parameters first
        if (
            param_order is not None
        ):  # the module's registration order approximates the forward order better
            rank = {id(p): i for i, p in enumerate(param_order)}
            order.sort(key=lambda k: -rank.get(id(self.params[k]), -1))
        sizes = [
            self.params[k].numel() * torch.empty((), dtype=gdtype).element_size() for k in order
        ]
        cap = max(1, int(self.bucket_mb * MiB)) if self.overlap else max(1, sum(sizes))
        members = [[order[m] for m in ms] for ms in assign(sizes, [0] * len(order), cap)]
        # a bucket is W * c elements (padded), cut into `local` slices of s = c * W / local: world:
        # W slices of c; node: g slices of c * nodes (the inter-node phase splits a slice again)
        W, L = self.size, self.local
        slices = [
            max(1, math.ceil(sum(self.params[k].numel() for k in ms) / W)) * (W // L)
            for ms in members
        ]
        self.numel = sum(p.numel() for p in self.params)
        self.shard_numel = sum(slices)
        self.flat_param = torch.zeros(sum(s * L for s in slices), dtype=dtype, device=device)
        self.flat_grad = torch.zeros_like(self.flat_param, dtype=gdtype)
        self.g_shard = torch.zeros(self.shard_numel, dtype=gdtype, device=device)
        self.exp_avg = torch.zeros_like(self.g_shard)
        self.exp_avg_sq = torch.zeros_like(self.g_shard)
        self._chunk = default_chunk(device) if chunk == "auto" else chunk
        self._bucket_of = [0] * len(self.params)
        self._gview: list[torch.Tensor] = [None] * len(self.params)  # type: ignore[list-item]
        self._pieces: dict[str, Piece] = {}
        self.buckets: list[ShardBucket] = []
        a0 = shard_off = 0
        for b, (ms, s) in enumerate(zip(members, slices, strict=True)):
            self.buckets.append(self._bucket(b, ms, a0, s, shard_off))
            a0, shard_off = a0 + s * L, shard_off + s
        self._hooks = (
            [
                p.register_post_accumulate_grad_hook(self._hook_for(k))
                for k, p in enumerate(self.params)
            ]
            if self.overlap
            else []
        )
        self._used = [False] * len(self.params)
        self._reset_step()
        self._built = True

    def _bucket(self, b: int, ms: list[int], a0: int, s: int, shard_off: int) -> ShardBucket:
        lo = a0 + self.slot * s
        segs: dict[int, list[tuple[int, int, int]]] = {}
        off = a0
        for k in ms:
            p, (gi, i) = self.params[k], self._where[k]
            n = p.numel()
            view = self.flat_param[off : off + n].view(p.shape)
            with torch.no_grad():
                view.copy_(p.detach())
            p.data = view  # parameters live in the flat buffer
            self._gview[k], self._bucket_of[k] = self.flat_grad[off : off + n].view(p.shape), b
            x, y = max(off, lo), min(off + n, lo + s)
            if x < y:
                segs.setdefault(gi, []).append((i, x - lo, y - lo))
                at = shard_off + x - lo
                for name, state in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
                    self._pieces[f"{name}/{self.keys[k]}"] = Piece(
                        state[at : at + y - x], x - off, n, self.node_index > 0
                    )
            off += n
        sl = slice(shard_off, shard_off + s)
        P, G, M, V = (
            self.flat_param[lo : lo + s],
            self.g_shard[sl],
            self.exp_avg[sl],
            self.exp_avg_sq[sl],
        )
        work = []
        for gi, sg in segs.items():
            plan = plan_chunks([y - x for _, x, y in sg], self._chunk, device=P.device)
            seg_owner = torch.tensor([i for i, _, _ in sg], dtype=torch.long, device=P.device)

            def cut(buf: torch.Tensor, sg: list = sg, plan: Any = plan) -> list[list[torch.Tensor]]:
                return pieces([buf[x:y] for _, x, y in sg], plan)

            work.append(
                _Work(gi, cut(P), cut(G), cut(M), cut(V), [seg_owner[o] for o in plan.owner])
            )
        a1 = a0 + s * self.local
        return ShardBucket(b, ms, self.flat_param[a0:a1], self.flat_grad[a0:a1], P, G, work)

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank (the two moment shards)."""
        return self.exp_avg.numel() * self.exp_avg.element_size() * 2

    # -- gradients in (hooks, end of backward, or step) --------------------------------------------
    def _reset_step(self) -> None:
        work = getattr(self, "_usage_work", None)
        if work is not None:  # a collective on the wire is finished, never abandoned
            work.wait()
        self._usage_work = None
        self._unscale = 1.0
        self._ready = [False] * len(self.params)
        self._pending = [len(b.members) for b in self.buckets]
        self._next = 0  # first bucket not launched yet
        self._handles: list[Any] = [None] * len(self.buckets)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients without communicating (all micro-batches
        but the last)."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    # -- scaleout.parallel.sync.GradientSync: the trainer asks this optimizer what it asks
    # DataParallel ----
    grads_are_views = False  # .grad are autograd's own tensors, copied into the buckets
    finds_nonfinite = True  # its shards' non-finite counts ride on step()'s norm all-reduce

    def reduced_grads(self) -> None:
        return None  # each rank holds its own shard's only: the check is step()'s (skipped)

    def nonfinite_flag(self) -> torch.Tensor | None:
        """Under graphs: the last step's device verdict (1.0: a reduced gradient was non-finite and
        the step wrote nothing, alike on every rank); otherwise None (step() reads it itself)."""
        return self._bad if self.graphed else None

    def ride(self, fill: Callable[[torch.Tensor], None] | None) -> bool:
        return False  # no replicated buffer whose sums every rank reads alike

    def ride_result(self) -> None:
        return None

    def while_waiting(self, work: Callable[[], None]) -> None:
        """Dropped: no host wait here to fill (the next step's batch is built in its own step)."""

    def unused_flag(self) -> torch.Tensor | None:
        """Under graphs: 1.0 on the device when some parameter got no gradient on any rank (read
        with the agreement; :meth:`check_unused` then names them). Otherwise None: the usage rides
        on step()'s norm all-reduce and step() raises (_check_unused)."""
        return self._unused if self.graphed and not self.allow_unused else None

    def _launch_usage(self) -> None:
        """optim.shard=node over several nodes: which parameters got a gradient on some rank, summed
        over the world on its own (the norm all-reduce stays within the node), issued as soon as the
        last bucket is out, so it completes while the reduce-scatters are waited for. It goes
        through :func:`dispatch`, behind the buckets still queued on the comm thread: with one rank
        per node the inter-node group is the world group, and a collective issued here while that
        thread still sends buckets on it would pair with a bucket on another rank (c10d matches by
        issue order per group)."""
        if not self._world_usage or self._usage_work is not None:
            return
        self._usage = usage = self._usage_on_device(0)
        self.issued += 1
        group = self.world.group
        self._usage_work = dispatch(
            self.world,
            usage,
            lambda: dist.all_reduce(usage, group=group),
            lambda: dist.all_reduce(usage, group=group, async_op=True),
            None,
            True,
        )

    def check_unused(self) -> list[str]:
        if self.graphed and not self.allow_unused:  # the error path: one host read
            self._check_unused(self._usage_sum.tolist())
        return []

    def _usage_on_device(self, slot: int) -> torch.Tensor:
        """This rank's usage (1.0 per parameter that got a gradient) on the parameters' device,
        copied from pinned memory on CUDA (a pageable copy is a synchronous staging copy there).
        One buffer per ``slot`` (the usage all-reduce, the norm rows): each is refilled only in
        the next step, after this step's host read (step()) waited for its copy."""
        dev = self.flat_param.device
        bufs = self.__dict__.setdefault("_usage_host", {})
        host = bufs.get(slot)
        if host is None or host.numel() != len(self._used):
            host = bufs[slot] = torch.empty(
                len(self._used), dtype=torch.float32, pin_memory=dev.type == "cuda"
            )
        host.copy_(torch.tensor(self._used, dtype=torch.float32))
        return host.to(dev, non_blocking=True)

    def collectives(self) -> tuple[int, str]:
        if not self._built:
            return fingerprint(0, 0, 0), "not built"
        cached = getattr(self, "_fp_layout", (None, 0))
        if cached[0] is not self.buckets:  # hashed once per build
            cached = self._fp_layout = (
                self.buckets,
                layout_hash(
                    [
                        f"{b.flat_grad.dtype}x{b.flat_grad.numel()}",
                        *(self.keys[k] for k in b.members),
                    ]
                    for b in self.buckets
                ),
            )
        layout = cached[1]
        nbytes = self.flat_grad.numel() * self.flat_grad.element_size()
        count = len(self.buckets)
        return fingerprint(count, nbytes, layout), (
            f"{count} bucket reduce-scatters, {nbytes} bytes, layout 0x{layout:08x}"
        )

    def optimizer_state(self, optimizer: Any = None) -> tuple[dict[str, Any], dict[str, Piece]]:
        return self.sharded_state()

    def load_optimizer_state(self, optimizer: Any, state: dict[str, Any]) -> None:
        self.load_replicated(state)

    def _hook_for(self, k: int) -> Callable[[torch.Tensor], None]:
        def hook(_p: torch.Tensor) -> None:
            self._used[k] = True
            if not self._sync:
                return
            if not self._in_backward:
                self._in_backward = True
                Variable._execution_engine.queue_callback(self._end_backward)
            if self._ready[k]:
                self._second_backward(k)
            self._mark(k)

        return hook

    def _second_backward(self, k: int) -> None:
        """A gradient again after a synchronising backward, without step(): send everything again
        (every rank runs the same backward passes, so every rank does this at the same point)."""
        if self._next < len(self.buckets):
            raise UserError(
                f"parameter {self.keys[k]!r} received a gradient twice in one synchronising "
                "backward "
                "(reentrant checkpointing?): run all backward passes but the last under "
                "optimizer.no_sync()"
            )
        self._reset_step()

    def _mark(self, k: int) -> None:
        """Put parameter k's gradient (zero if it has none) into its bucket; launch buckets now
        complete."""
        g, view = self.params[k].grad, self._gview[k]
        if g is None:
            view.zero_()
        else:
            self._used[k] = True
            view.copy_(g)
        self._ready[k] = True
        b = self._bucket_of[k]
        self._pending[b] -= 1
        while (
            self._next < len(self.buckets) and self._pending[self._next] == 0
        ):  # strictly in index order
            bk = self.buckets[self._next]
            self.issued += 1
            self._handles[self._next] = self._reduce_scatter(bk)
            self._next += 1

    # -- the collectives --------------------------------------------------------------------------
    def _reduce_scatter(self, bk: ShardBucket) -> Any:
        """Start bucket ``bk``'s gradient reduction into ``bk.g_shard`` (a handle).

        * world, no compression: ``scaleout.comm.reduce_scatter`` with the configured algorithm,
          fp32 sum (divided by W in :meth:`_wait_all`).
        * node, no compression: reduce-scatter over the node's ranks (fp32 sum), then all-reduce of
          the slice over the same-local-rank peers of the other nodes (fp32 sum), then / W.
        * compression (bf16/fp16): :meth:`_compressed` (pre-divided by W, wire dtype on the wire,
          every sum in fp32).
        """
        if self.wire is None and self.shard == "world":
            return self.comm.reduce_scatter(bk.g_shard, bk.flat_grad, async_op=True)
        job = self._compressed if self.wire is not None else self._node_fp32
        return dispatch(self.world, bk.g_shard, lambda: job(bk), None, lambda: None, True)

    def _node_fp32(self, bk: ShardBucket) -> None:
        if self.local > 1:
            reduce_scatter_tensor(bk.g_shard, bk.flat_grad, group=self.intra, async_op=True).wait()
        else:
            bk.g_shard.copy_(bk.flat_grad)
        if self.size > self.local:
            dist.all_reduce(bk.g_shard, group=self.inter, async_op=True).wait()

    def _a2a_sum(self, out: torch.Tensor, inp: torch.Tensor, group: Any, n: int) -> None:
        """Reduce-scatter of ``inp`` (fp32, n equal slices) over ``group`` with the wire dtype on
        the wire and an fp32 sum: inp is rounded once to the wire dtype, one all-to-all hands
        member j the j-th slice of every member (moved as uint8 bytes: every backend has them),
        and ``out`` (fp32) = torch.sum over the n received slices with dtype=float32."""
        wire = inp.to(self.wire)
        recv = torch.empty_like(wire)
        if n > 1:
            dist.all_to_all_single(
                recv.view(torch.uint8), wire.view(torch.uint8), group=group, async_op=True
            ).wait()
        else:
            recv = wire
        torch.sum(recv.view(n, -1), dim=0, dtype=torch.float32, out=out)

    def _compressed(self, bk: ShardBucket) -> None:
        """The reduce-scatter with ``comm.compression``: g_r = rank r's bucket / W (fp32); world:
        g_shard = sum_fp32 over ranks of wire(g_r)[slice] (one all-to-all over the world). node:
        h = sum_fp32 over the node's ranks of wire(g_r)[slice] (all-to-all over the node), then
        the same again over the nodes on h's sub-slices (all-to-all over the same-local-rank
        peers), and an all-gather among those peers of wire(that fp32 sum): every peer ends with
        the same g_shard, rounded to the wire dtype once more. That all-gather is an all-to-all
        of the part repeated once per peer: the same bytes as a ring all-gather, but one exchange
        with every peer at once instead of k - 1 dependent ring steps, which at 256 nodes and a
        few KiB per part are pure latency (k - 1 network latencies per bucket)."""
        bk.flat_grad.div_(self.size)
        if self.shard == "world":
            self._a2a_sum(bk.g_shard, bk.flat_grad, self.world.group, self.size)
            return
        nodes = self.size // self.local
        if nodes == 1:
            self._a2a_sum(bk.g_shard, bk.flat_grad, self.intra, self.local)
            return
        h = torch.empty_like(bk.g_shard)
        self._a2a_sum(h, bk.flat_grad, self.intra, self.local)
        part = torch.empty(h.numel() // nodes, dtype=h.dtype, device=h.device)
        self._a2a_sum(part, h, self.inter, nodes)
        gathered = torch.empty(h.numel(), dtype=self.wire, device=h.device)
        dist.all_to_all_single(
            gathered.view(torch.uint8),
            part.to(self.wire).repeat(nodes).view(torch.uint8),
            group=self.inter,
            async_op=True,
        ).wait()
        bk.g_shard.copy_(gathered)

    def _all_gather(self, bk: ShardBucket) -> Any:
        """Start bucket ``bk``'s parameter all-gather (in the parameters' dtype): world: the
        configured algorithm; node: over the node's ranks (the peers on other nodes hold the
        same slice), one native async collective issued from this thread (the reduce-scatters
        were all waited for, so nothing queued earlier on the comm thread can be overtaken, and a
        collective the caller issues later cannot overtake it either)."""
        if self.shard == "world":
            return self.comm.all_gather(bk.flat_param, bk.p_shard, async_op=True)
        if self.local == 1:
            return None
        work = all_gather_tensor(bk.flat_param, bk.p_shard, group=self.intra, async_op=True)
        return WorkHandle(work, lambda: None, bk.flat_param)

    def wait_params(self, buckets: Any = None) -> None:
        """Wait for the parameter all-gathers of the last step (``buckets``: those only) before
        the parameters are read: the next forward's pre-hooks, a checkpoint, an evaluation, a
        state_dict. ``Handle.wait()``: on CUDA a stream wait (no host sync), on gloo a host
        wait."""
        gathers = self._gathers
        if not gathers:
            return
        for b in range(len(gathers)) if buckets is None else buckets:
            h = gathers[b]
            if h is not None:
                gathers[b] = None
                h.wait()
        if buckets is None:
            self._gathers = []

    def pending_gathers(self) -> int:
        """All-gathers started by step() and not waited for yet."""
        return sum(h is not None for h in self._gathers)

    def _attach(self, module: torch.nn.Module) -> None:
        """A forward pre-hook on every module that holds parameters of this optimizer directly: it
        waits for those parameters' buckets only, so the all-gathers of later buckets overlap
        the forward of earlier layers. (A parameter read outside its module's forward, or its
        parent's, needs :meth:`wait_params` first.)"""
        index = {id(p): k for k, p in enumerate(self.params)}
        self._module_hooks = []
        for m in module.modules():
            bs = sorted(
                {
                    self._bucket_of[index[id(p)]]
                    for p in m.parameters(recurse=False)
                    if id(p) in index
                }
            )
            if bs:

                def pre(_m: Any, _args: Any, bs: list[int] = bs) -> None:
                    if self._gathers:
                        self.wait_params(bs)

                self._module_hooks.append(m.register_forward_pre_hook(pre))

    def _send_all(self) -> None:
        for k, ready in enumerate(self._ready):
            if not ready:
                self._mark(k)

    def _wait_all(self) -> None:
        if self._handles and self._handles[0] is not None:
            self.waiting = True
            for h in self._handles:
                h.wait()
            self.waiting = False
            if self._post_divide:  # sum -> average (ReduceOp.AVG is NCCL-only)
                self.g_shard.div_(self.size)
            self._handles = [None] * len(self.buckets)

    def _end_backward(self) -> None:
        self._in_backward = False
        if not self._sync:
            return
        t0, during = (
            time.perf_counter(),
            self._next,
        )  # buckets the hooks launched while backward ran
        self._send_all()
        self._launch_usage()
        self._wait_all()
        self.last_stats = {
            "exposed_s": time.perf_counter() - t0,
            "launched_in_backward": during,
            "buckets": len(self.buckets),
        }

    def unscale_(self, factor: float) -> None:
        """fp16 loss scaling (scaleout/train/precision.py): the reduced gradients live in this
        optimizer's shard buffers, not in ``.grad``, so they are multiplied by ``factor`` (1/S)
        here, in :meth:`step` once the reduce-scatters are done (overlapped: already after
        backward; otherwise inside step()). The reduction is linear, so scaling after it equals
        unscaling every rank's gradients first."""
        self._unscale *= float(factor)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Also forgets a backward whose step was skipped (its reduce-scatters already
        completed)."""
        self._reset_step()
        self._used = [False] * len(self.params)
        super().zero_grad(set_to_none=set_to_none)

    # -- under CUDA graphs (module docstring) ------------------------------------------------------
    def use_graphs(self) -> None:
        """Make every later step() device-only, so that a CUDA graph can capture it: the step's
        scalars staged from the host (:meth:`stage`), the skip and the unused-parameter check as
        device flags (:meth:`nonfinite_flag`, :meth:`unused_flag`) read with the step's agreement,
        then :meth:`settle`. The all-gathers are waited for inside step()."""
        if self.profile:
            raise UserError(
                "ShardedLAMB profile=True synchronises the device between phases: not in a CUDA "
                "graph"
            )
        dev = self.flat_param.device
        self.graphed, self._defer = True, False
        groups = len(self.param_groups)
        # per group: lr, eps', wd / k, k of the step to run (LambCoeffs), staged by the host
        self._coef_host = torch.zeros(groups, 4, dtype=torch.float32, pin_memory=dev.type == "cuda")
        self._coef = torch.zeros(groups, 4, dtype=torch.float32, device=dev)
        self._bad = torch.zeros((), dtype=torch.float32, device=dev)
        self._unused = torch.zeros((), dtype=torch.float32, device=dev)
        self._usage_sum = torch.ones(len(self.params), dtype=torch.float32, device=dev)

    def stage(self) -> None:
        """Write the next step's per-group scalars into the pinned buffer that step() copies to the
        device (use_graphs): step() calls it when it is not being captured; whoever replays a
        captured step calls it before each replay."""
        rows = []
        for g in self.param_groups:
            c = LambCoeffs.of(g, g["step"] + 1)
            rows.append([c.lr, c.eps, c.wd, c.k])
        self._coef_host.copy_(torch.tensor(rows, dtype=torch.float32))

    def settle(self, skipped: bool) -> None:
        """Under graphs, once the step's verdict was read (:meth:`nonfinite_flag`, with the
        agreement): count the step unless it was skipped (the next :meth:`stage` uses the count)."""
        self.skipped = bool(skipped)
        if not self.skipped:
            for g in self.param_groups:
                g["step"] += 1

    @torch.no_grad()
    def _graphed_step(self) -> None:
        """step() under use_graphs() (module docstring): no host read, no per-step Python value in
        any device op."""
        if not _capturing():
            self.stage()
        self.wait_params()
        self._send_all()
        self._launch_usage()
        self._wait_all()
        g, dev = self.g_shard, self.flat_param.device
        if self._unscale != 1.0:  # a host value: the trainer refuses fp16 with graphs
            raise UserError("ShardedLAMB under CUDA graphs: fp16 loss scaling is not supported")
        coef = self._coef
        coef.copy_(self._coef_host, non_blocking=True)
        sq = torch.zeros(4, len(self.params), dtype=torch.float32, device=dev)
        sq[2] = self._usage_on_device(1)
        sq[3, 0] = torch.isfinite(g).logical_not_().sum()
        g.nan_to_num_(0.0, 0.0, 0.0)  # finite inputs: a skipped step's blend weight 0 is exact
        if self.clip_grad_norm is not None:
            gsq = sq_norms([g])
            self._norm_all_reduce(gsq)
            self.last_grad_norm = norm = gsq.sum().sqrt()  # a device value under graphs
            g.mul_(self.clip_grad_norm / torch.clamp(norm, min=self.clip_grad_norm))
        co = [
            replace(
                LambCoeffs.of(group, 1),
                lr=c[0],
                eps=c[1],
                wd=c[2],
                k=c[3],
            )
            for group, c in zip(self.param_groups, coef.unbind(), strict=True)
        ]
        sq, base = self._phase1(co, sq)
        self._norm_all_reduce(sq)
        if self._usage_work is not None:
            self._usage_work.wait()
            self._usage_work = None
            sq[2] = self._usage
        bad = sq[3, 0] > 0
        self._bad.copy_(bad)
        if not self.allow_unused:
            self._usage_sum.copy_(sq[2])
            self._unused.copy_((sq[2] == 0).any())
        keep = (~bad).float()  # the blend weight: 1 = this step's values, 0 = the old ones
        scale = [
            trust_ratios(
                sq[0, b : b + len(group["params"])], sq[1, b : b + len(group["params"])], c
            )
            * (-c.lr * c.k)
            * keep
            for b, group, c in zip(base, self.param_groups, co, strict=True)
        ]
        for bk in self.buckets:
            for w in bk.work:
                c = co[w.group]
                for k in range(len(w.P)):
                    m, v = new_moments(w.G[k], w.M[k], w.V[k], c)
                    weights = [keep] * len(m)
                    torch._foreach_lerp_(w.M[k], m, weights)
                    torch._foreach_lerp_(w.V[k], v, weights)
                    u = direction(w.P[k], w.M[k], w.V[k], c)
                    if c.adapt:
                        torch._foreach_mul_(u, list(scale[w.group][w.owner[k]].unbind()))
                    else:
                        torch._foreach_mul_(u, -c.lr * c.k * keep)
                    torch._foreach_add_(w.P[k], u)
            self.issued += 1
            self._gathers.append(self._all_gather(bk))
        self.wait_params()
        self._reset_step()
        self._used = [False] * len(self.params)

    # -- step -------------------------------------------------------------------------------------
    def _tick(self, name: str, t0: float, minus: float = 0.0) -> float:
        if self.profile and self.flat_param.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        self.timings[name] = self.timings.get(name, 0.0) + t - t0 - minus
        return t

    def _norm_all_reduce(self, x: torch.Tensor) -> float:
        """Sum ``x``, this rank's partial sums over its slices, over the ranks holding the other
        slices: the world (optim.shard=world), or only the node (optim.shard=node: the other nodes
        hold the same slices and sum the same values; at thousands of ranks a collective within
        the node instead of a world one on the step's critical path). Its seconds."""
        t0 = time.perf_counter()
        group = self.intra if self.shard == "node" else self.world.group
        if self.local > 1:
            self.issued += 1
            dist.all_reduce(x, group=group)
        return time.perf_counter() - t0

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.timings = {}
        if self.graphed:
            self._graphed_step()
            return loss
        self.wait_params()  # a step without a forward since the last one: its gathers first
        t = time.perf_counter()
        # overlap=False, or gradients set without backward: everything goes out here
        self._send_all()
        self._launch_usage()
        t = self._tick("pack", t)
        self._wait_all()
        if self._unscale != 1.0:
            self.g_shard.mul_(self._unscale)
        t = self._tick("reduce_scatter", t)
        clip = 1.0
        if self.clip_grad_norm is not None:
            gsq = sq_norms([self.g_shard])
            self._norm_all_reduce(gsq)
            self.last_grad_norm = norm = float(gsq.sum().sqrt())
            clip = clip_factor(norm, self.clip_grad_norm)
        co = [LambCoeffs.of(g, g["step"] + 1, clip) for g in self.param_groups]
        t = self._tick("norm_allreduce", t)
        sq, base = self._phase1(co)
        comm = self._norm_all_reduce(sq)
        t = self._tick("update", t, minus=comm)
        if self._usage_work is not None:
            self._usage_work.wait()
            self._usage_work = None
            sq[2] = self._usage
        self.timings["norm_allreduce"] += comm
        # the step's one host read: non-finite elements in the reduced gradient (all shards), and
        # the usage when unused parameters are an error
        read = sq[3, :1] if self.allow_unused else torch.cat([sq[3, :1], sq[2]])
        values = read.tolist()
        self._check_unused(values[1:])
        self.skipped = values[0] > 0
        if self.skipped:  # every rank read the same sums: every rank skips, nothing was written
            self._gathers = []
            self._reset_step()
            self._used = [False] * len(self.params)
            return loss
        for g in self.param_groups:
            g["step"] += 1
        scale = [
            trust_ratios(sq[0, b : b + len(g["params"])], sq[1, b : b + len(g["params"])], c)
            * (-c.lr * c.k)
            for b, g, c in zip(base, self.param_groups, co, strict=True)
        ]
        self._gathers = self._phase2(co, scale)
        t = self._tick("update", t)
        if not self._defer:  # no module's forward would wait for them
            self.wait_params()
        self._tick("all_gather", t)  # deferred: only the launches
        self._reset_step()
        self._used = [False] * len(self.params)
        return loss

    def _phase1(
        self,
        co: list[LambCoeffs],
        sq: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """Partial squared norms of the adapted groups (rows 0 and 1: ||w||^2 and ||u/k||^2) from
        the moments the step would write, computed chunk by chunk out of place: nothing is written
        before the sums say the step happens. Row 2: this rank's parameter usage; [3, 0]: the
        non-finite elements of this rank's reduced gradient shard."""
        ntens = [len(g["params"]) for g in self.param_groups]
        base = [sum(ntens[:gi]) for gi in range(len(ntens))]
        if sq is None:  # (under graphs the caller made it, rows 2 and 3 filled)
            sq = torch.zeros(
                4, len(self.params), dtype=torch.float32, device=self.flat_param.device
            )
            sq[2] = self._usage_on_device(1)
            sq[3, 0] = torch.isfinite(self.g_shard).logical_not_().sum()
        for bk in self.buckets:
            for w in bk.work:
                c = co[w.group]
                if not c.adapt:
                    continue
                for k in range(len(w.P)):
                    m, v = new_moments(w.G[k], w.M[k], w.V[k], c)
                    sq[0, base[w.group] :].index_add_(0, w.owner[k], sq_norms(w.P[k]))
                    sq[1, base[w.group] :].index_add_(
                        0, w.owner[k], sq_norms(direction(w.P[k], m, v, c))
                    )
        return sq, base

    def _check_unused(self, usage: list[float]) -> None:
        if self.allow_unused:
            return
        unused = [self.keys[k] for k, n in enumerate(usage) if n == 0]
        if unused:
            self._reset_step()
            raise UserError(
                f"parameters received no gradient on any rank: {unused}; pass allow_unused=True to "
                "ShardedLAMB if that is expected (their gradients are then zero)"
            )

    def _phase2(self, co: list[LambCoeffs], scale: list[torch.Tensor]) -> list[Any]:
        """Apply each bucket's update, then start that bucket's all-gather at once."""
        gathers = []
        for bk in self.buckets:
            for w in bk.work:
                c = co[w.group]
                for k in range(len(w.P)):
                    update_moments(w.G[k], w.M[k], w.V[k], c)  # the values _phase1 read
                    u = direction(w.P[k], w.M[k], w.V[k], c)
                    if c.adapt:
                        torch._foreach_mul_(u, scalars(scale[w.group][w.owner[k]]))
                        torch._foreach_add_(w.P[k], u)
                    else:
                        torch._foreach_add_(w.P[k], u, alpha=-c.lr * c.k)
            self.issued += 1
            gathers.append(self._all_gather(bk))
        return gathers

    # -- checkpoint -------------------------------------------------------------------------------
    def sharded_state(self) -> tuple[dict[str, Any], dict[str, Piece]]:
        """(replicated part: groups and step counters, the same on every rank; this rank's pieces
        of each parameter's exp_avg / exp_avg_sq, keyed ``exp_avg/<parameter name>``, in
        per-parameter coordinates, so that a checkpoint loads into any world size, bucket layout
        or shard mode; optim.shard=node: the pieces of nodes > 0 are marked ``replica``)."""
        self.wait_params()
        rep = {
            "format": FORMAT,
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in self.param_groups
            ],
            "params": {key: p.numel() for key, p in zip(self.keys, self.params, strict=True)},
        }
        return rep, dict(self._pieces)

    def load_replicated(self, rep: dict[str, Any]) -> None:
        """Load the replicated part of :meth:`sharded_state` (the pieces are loaded in place by
        the caller)."""
        if not isinstance(rep, dict) or rep.get("format") != FORMAT:
            raise ConfigError(
                f"checkpoint optimizer state is not a {FORMAT} state (saved with "
                "optim.sharded=false "
                "or by an older version); resume it with the settings it was saved with"
            )
        mine = self.sharded_state()[0]
        if rep["params"] != mine["params"] or len(rep["param_groups"]) != len(self.param_groups):
            diff = sorted(set(rep["params"].items()) ^ set(mine["params"].items()))[:3]
            raise ConfigError(
                f"checkpoint optimizer parameters or groups differ from this model's, e.g. {diff}"
            )
        for g, saved in zip(self.param_groups, rep["param_groups"], strict=True):
            g.update({k: v for k, v in saved.items() if k != "params"})

    def state_dict(self) -> dict[str, Any]:
        """This rank's state, to load on the same rank of the same layout (checkpoints:
        :meth:`sharded_state`)."""
        rep, pieces = self.sharded_state()
        layout = (self.shard, self.slot, self.size, self.shard_numel, len(self.buckets))
        return {
            **rep,
            "layout": layout,
            "state": {k: (p.offset, p.tensor.clone()) for k, p in pieces.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        mine = self.state_dict()
        if (
            tuple(state_dict.get("layout", ())) != mine["layout"]
            or state_dict["state"].keys() != self._pieces.keys()
        ):
            raise ConfigError(
                f"ShardedLAMB state_dict layout {state_dict.get('layout')} (shard mode, slot, "
                "world, shard, buckets) "
                f"does not match this rank's {mine['layout']}: use sharded_state() and "
                "scaleout.checkpoint"
            )
        self.load_replicated(state_dict)
        for k, p in self._pieces.items():
            p.tensor.copy_(state_dict["state"][k][1])


def _capturing() -> bool:
    """This thread's current CUDA stream is being captured into a graph."""
    try:
        return torch.cuda.is_current_stream_capturing()
    except RuntimeError:  # a torch built without CUDA
        return False
