"""``DataParallel``: replicate a module on every rank and average its gradients with overlapped,
bucketed all-reduce using any algorithm of :mod:`scaleout.comm`.

    dp = scaleout.DataParallel(model, world, algorithm="hierarchical", bucket_mb=25,
    compression="bf16")
    loss = loss_fn(dp(batch), target)
    loss.backward()          # returns with gradients averaged over all ranks
    optimizer.step()
    dp.last_stats            # backward_s, exposed_s (blocked on communication), comm_s, bytes, ...

Gradient accumulation: run all micro-steps but the last under ``with dp.no_sync():``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from scaleout.comm.collective import Collective
from scaleout.errors import UserError
from scaleout.parallel.buckets import bucket_layout, fingerprint, layout_hash
from scaleout.parallel.reducer import Reducer, compression_dtype
from scaleout.parallel.timeline import Timeline
from scaleout.units import DEFAULT_BUCKET_MB

if TYPE_CHECKING:
    from scaleout.config.schema import CommConfig
    from scaleout.world import World


class _BackwardStart(torch.autograd.Function):
    """Identity on the module's outputs whose backward marks the start of backward compute (for the
    backward span and stats; DDP's ``_DDPSink`` plays the same role)."""

    @staticmethod
    def forward(ctx: Any, reducer: Reducer, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.reducer = reducer
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:  # type: ignore[override]
        ctx.reducer.begin_backward()
        return None, grad


def broadcast_from_rank0(tensors: list[torch.Tensor], world: World) -> None:
    """Make every rank's copy equal rank 0's: one broadcast per dtype/device of the flattened
    tensors."""
    if world.world_size == 1 or not tensors:
        return
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for ts in groups.values():
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        dist.broadcast(flat, src=0)
        off = 0
        with torch.no_grad():
            for t in ts:
                t.copy_(flat[off : off + t.numel()].view_as(t))
                off += t.numel()


class DataParallel(torch.nn.Module):
    """Data-parallel wrapper with overlapped bucketed gradient all-reduce.

    Args:
        module: the model (already on ``world.device``).
        world: the :class:`scaleout.World`.
        algorithm: all-reduce algorithm name from ``scaleout.comm.ALGORITHMS``
            (``flat``, ``hierarchical``, ``torus2d``), or a :class:`~scaleout.comm.Collective`
            already resolved for ``world`` (``from_config`` builds one).
        bucket_mb: bucket size in MiB (25: the DDP paper's default).
        compression: ``None``/``'none'``, ``'bf16'`` or ``'fp16'``: the wire dtype of the buckets.
        overlap: launch buckets during backward (True) or only after it (False: the no-overlap
        baseline).
        allow_unused: parameters that get no gradient on any rank are an error naming them unless
        True
            (then their gradient is zero and their names are in ``last_stats['unused']``).
        timeline: path of a Chrome trace to collect; written by :meth:`write_timeline`.
        first_bucket_mb: a separate (smaller) cap for the first bucket, so communication starts
        right
            after the last layers' gradients (torch DDP: 1 MiB); None = ``bucket_mb``.
        rebuild_buckets: after the first step, rebuild the buckets once in the order gradients
        became
            ready (rank 0's order; as torch DDP does).
        rider: elements at the end of the last bucket for the caller's own values, summed with
            the gradients when they go on the wire uncompressed (:meth:`ride` /
            :meth:`ride_result`: the trainer's step agreement rides there).
        defer_unused: do not read the parameter usage after backward (a host read); the
        caller
            folds :meth:`unused_flag` into its own read, then calls :meth:`check_unused`.
        **algorithm_options: the algorithm's options (``chunk_bytes``, ``x``, ``y``), when
            ``algorithm`` is a name.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        world: World,
        algorithm: str | Collective = "flat",
        bucket_mb: float = DEFAULT_BUCKET_MB,
        compression: str | None = None,
        *,
        overlap: bool = True,
        allow_unused: bool = False,
        timeline: str | Path | None = None,
        first_bucket_mb: float | None = None,
        rebuild_buckets: bool = True,
        defer_unused: bool = False,
        rider: int = 0,
        **algorithm_options: Any,
    ):
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise UserError(f"DataParallel wraps a torch.nn.Module, got {type(module).__name__}")
        compression_dtype(compression)
        self.module = module
        self.world = world
        self.collective = Collective.resolve(world, algorithm, **algorithm_options)
        self.algorithm = self.collective.name
        self.bucket_mb = bucket_mb
        self.compression = compression
        broadcast_from_rank0([*module.parameters(), *module.buffers()], world)
        self.timeline = Timeline(timeline, world.rank) if timeline else None
        self.reducer = Reducer(
            list(module.named_parameters()),
            world,
            self.collective,
            bucket_mb=bucket_mb,
            compression=compression,
            overlap=overlap,
            allow_unused=allow_unused,
            timeline=self.timeline,
            first_bucket_mb=first_bucket_mb,
            rebuild_buckets=rebuild_buckets,
            rider=rider,
        )
        self.reducer.defer_unused = defer_unused
        self._fp_layout: tuple[Any, int] = (None, 0)  # (the buckets hashed, their layout hash)

    @classmethod
    def from_config(
        cls, module: torch.nn.Module, world: World, comm: CommConfig, **kwargs: Any
    ) -> DataParallel:
        """DataParallel as the ``comm`` section of a run config says (algorithm, bucket size,
        compression, overlap, timeline, torus grid, pipeline chunk, first bucket); ``kwargs``: the
        other arguments."""
        # torch DDP: a separate first cap only when it is the smaller one
        first = comm.first_bucket_mb
        kwargs.setdefault(
            "first_bucket_mb", first if first is not None and first < comm.bucket_mb else None
        )
        return cls(
            module,
            world,
            # auto: flat until scaleout/parallel/autotune.py switches the plan (set_plan)
            algorithm=Collective.from_config(comm, world),
            bucket_mb=comm.bucket_mb,
            compression=comm.wire_compression,
            timeline=comm.timeline,
            overlap=comm.overlap,
            **kwargs,
        )

    def set_plan(
        self,
        algorithm: str | Collective,
        bucket_mb: float,
        first_bucket_mb: float | None = None,
        compression: str | None = None,
        **algorithm_options: Any,
    ) -> None:
        """Between steps, on every rank alike: all-reduce with ``algorithm`` (its options),
        re-bucket to ``bucket_mb`` / ``first_bucket_mb`` in the current filling order, send in
        ``compression``'s dtype (comm.algorithm=auto: scaleout/parallel/autotune.py)."""
        compression = None if compression == "none" else compression
        collective = Collective.resolve(self.world, algorithm, **algorithm_options)
        self.reducer.relayout(collective, bucket_mb, first_bucket_mb, compression)
        self.collective, self.algorithm = collective, collective.name
        self.bucket_mb, self.compression = bucket_mb, compression

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.module(*args, **kwargs)
        if not torch.is_grad_enabled():
            return out

        roots: list[torch.Tensor] = []

        def mark(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.requires_grad:
                roots.append(x)
                return _BackwardStart.apply(self.reducer, x)
            return x

        out = tree_map(mark, out)
        if self.reducer.allow_unused and self.reducer.sync:
            self.reducer.expect_unused(roots)
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) for the backward passes inside."""
        prev = self.reducer.sync
        self.reducer.sync = False
        try:
            yield
        finally:
            self.reducer.sync = prev

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the bucket buffers in place: ``.grad`` stays a view into its bucket either way
        (setting it to None would only cost a copy into the bucket at the next backward)."""
        for b in self.reducer.buckets:
            b.buffer.zero_()
        for s in self.reducer.slots:
            s.param.grad = s.view

    # -- scaleout.parallel.sync.GradientSync
    # ------------------------------------------------------------
    grads_are_views = True  # .grad are views into the bucket buffers (zero_grad keeps them)
    finds_nonfinite = False  # the trainer's agreement carries the non-finite flag

    def reduced_grads(self) -> list[torch.Tensor]:
        """The bucket buffers' gradient parts (``.grad`` are views into them): a few flat tensors
        instead of one per parameter."""
        return [b.grads for b in self.reducer.buckets]

    def nonfinite_flag(self) -> torch.Tensor | None:
        """The averaging pass's flag (fp32 buckets divided after the sum, see the reducer)."""
        return self.reducer.nonfinite

    def ride(self, fill: Callable[[torch.Tensor], None] | None) -> bool:
        return self.reducer.ride(fill)

    def ride_result(self) -> torch.Tensor | None:
        return self.reducer.rider_result

    def while_waiting(self, work: Callable[[], None]) -> None:
        self.reducer.while_waiting(work)

    @property
    def issued(self) -> int:
        """Bucket all-reduces issued so far (the heartbeat's collective count)."""
        return self.reducer.issued

    @property
    def waiting(self) -> bool:
        """Backward is blocked waiting for the gradient sync (the heartbeat's "grad-sync")."""
        return self.reducer.waiting

    def unused_flag(self) -> torch.Tensor | None:
        return self.reducer.unused_flag()

    def check_unused(self) -> list[str]:
        return self.reducer.check_unused()

    def collectives(self) -> tuple[int, str]:
        r = self.reducer
        if self._fp_layout[0] is not r.buckets:  # built, or rebuilt after the first step
            self._fp_layout = (r.buckets, layout_hash(bucket_layout(r.buckets)))
        # from the buckets as they are (known once the last one is launched, before any wait)
        wire = r.comm_dtype.itemsize if r.comm_dtype is not None else None
        count = len(r.buckets)
        nbytes = sum(b.buffer.numel() * (wire or b.buffer.element_size()) for b in r.buckets)
        layout = self._fp_layout[1]
        return fingerprint(count, nbytes, layout), (
            f"{count} bucket all-reduces, {nbytes} bytes, layout 0x{layout:08x}"
        )

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], None]:
        return optimizer.state_dict(), None  # replicated: the same on every rank

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)

    def wait_params(self) -> None:
        """Nothing to wait for: the optimizer updates replicated parameters in place."""

    @property
    def last_stats(self) -> dict[str, Any]:
        """Of the last synchronising backward: ``backward_s``, ``exposed_s`` (time blocked on
        communication after backward), ``comm_s`` (first launch to last completion), ``bytes`` on
        the wire per rank-buffer, ``buckets``, ``launch_order``, ``unused`` (parameter names)."""
        return self.reducer.last_stats

    @property
    def buckets(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return [[s.name for s in b.slots] for b in self.reducer.buckets]

    def write_timeline(self) -> Path | None:
        """Collective: rank 0 writes every rank's spans as one Chrome trace (returns its path)."""
        if self.timeline is None:
            raise UserError("write_timeline() needs DataParallel(..., timeline='trace.json')")
        return self.timeline.write(self.world)
