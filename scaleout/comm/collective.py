"""A :class:`Collective`: an all-reduce algorithm resolved once for one ``World`` -- the
:class:`~scaleout.comm.algorithm.Algorithm`, its validated ``Options`` and what its ``prepare``
built (the row/column groups of ``hierarchical`` / ``torus2d``) -- and the functional API over it.

The name and the options are resolved where a run is configured (``DataParallel.from_config``, the
sharded LAMB's factory, ``Collective.resolve`` for a caller holding a name); the gradient reducer
and the sharded optimizer then call the object per bucket, so nothing on that path looks a name up,
builds ``Options`` or creates groups. ``prepare`` runs in the constructor: groups are created in
construction order, which every rank shares, and a bad grid fails there with its one-line error.

``all_reduce(tensor, world, algorithm="flat", **options)`` (and ``reduce_scatter`` /
``all_gather`` / ``shard_index``) build a Collective per call, for callers that hold a name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from scaleout.comm import handles, shard
from scaleout.comm.algorithm import Algorithm, Options, get_algorithm
from scaleout.comm.api import dispatch, op_name
from scaleout.errors import UserError
from scaleout.telemetry.profiler import traced

if TYPE_CHECKING:
    from scaleout.config.schema import CommConfig
    from scaleout.world import World


class Collective:
    """``algorithm`` bound to ``world`` with ``opts``; ``prepare`` has run once (``prepared``).

    ``single_collective``: the all-reduce is one native torch.distributed work, which the caller
    may start itself with :meth:`start` (the reducer's fast path: no hand-off, no Python layer per
    bucket)."""

    def __init__(self, algorithm: Algorithm, world: World, opts: Options | None = None):
        self.algorithm = algorithm
        self.world = world
        self.opts = algorithm.Options() if opts is None else opts
        self.single_collective = algorithm.single_collective
        self.prepared = algorithm.prepare(world, self.opts)
        self._shard: int | None = None

    @classmethod
    def resolve(
        cls,
        world: World,
        algorithm: str | Algorithm | Collective = "flat",
        what: str = "all_reduce",
        **options: Any,
    ) -> Collective:
        """From a registered name (or an Algorithm) and keyword options (one-line UserError for an
        unknown name or option, ``what`` naming the call); a Collective is returned as it is (its
        options were set when it was built: more are an error)."""
        if isinstance(algorithm, Collective):
            if options:
                raise UserError(
                    f"{what} option(s) {sorted(options)} given with a built Collective "
                    f"({algorithm.name}): expected its options to be set when it was built"
                )
            return algorithm
        alg = get_algorithm(algorithm) if isinstance(algorithm, str) else algorithm
        return cls(alg, world, alg.options(what, **options))

    @classmethod
    def from_config(
        cls, comm: CommConfig, world: World, algorithm: str | None = None
    ) -> Collective:
        """As the run config's ``comm`` section sets it: ``algorithm`` (default ``comm.algorithm``;
        ``auto``: flat, the plan the run starts from, scaleout/parallel/autotune.py) with the
        options its ``Options.from_config`` reads. The one place config keys become options."""
        name = algorithm or ("flat" if comm.auto else comm.algorithm)
        alg = get_algorithm(name)
        return cls(alg, world, alg.Options.from_config(comm))

    @property
    def name(self) -> str:
        return self.algorithm.name

    def __repr__(self) -> str:
        return f"<Collective {self.name} {self.opts!r} over {self.world.world_size} ranks>"

    # -- all-reduce --------------------------------------------------------------------------------
    def start(self, buf: torch.Tensor) -> Any:
        """``single_collective`` only: start the in-place sum of ``buf`` (1-D, contiguous) as one
        native async work; None when there is nothing to send."""
        return self.algorithm.start(buf, self.world, self.opts)

    @traced("all_reduce")
    def all_reduce(self, tensor: torch.Tensor, op: Any = "sum", async_op: bool = False) -> Any:
        """Reduce ``tensor`` over every rank of the world, in place.

        Returns ``tensor`` (``async_op=False``) or a :class:`~scaleout.comm.handles.Handle` whose
        ``wait()`` returns it once every phase has completed. Any shape, element count and strides;
        any dtype gloo/NCCL can add (``avg`` needs floating point). ``avg`` is the sum divided by
        the world size, exactly as for ``flat``, so results match bit for bit on integer-valued
        data. All ranks must issue their all-reduces in the same order (as for torch.distributed);
        several may be in flight."""
        opname = op_name(op)
        if opname == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
            raise UserError(
                f"all_reduce op='avg' needs a floating-point tensor, got {tensor.dtype}"
            )
        alg, world, opts, prepared = self.algorithm, self.world, self.opts, self.prepared
        contiguous = tensor.is_contiguous()
        buf = tensor.view(-1) if contiguous else tensor.contiguous().view(-1)
        p = world.world_size

        def finish() -> None:
            if opname == "avg":
                buf.div_(p)
            if not contiguous:
                tensor.copy_(buf.view(tensor.shape))

        def job() -> None:
            if not contiguous and buf.is_cuda:
                # the staging copy was allocated on the caller's stream and dies when this call
                # returns, while the phases queued here (the comm stream, which waits for every
                # NCCL work) still use it: without this the caching allocator hands its block to
                # the caller's next allocation mid-reduction (review gpu-day-two finding 6)
                buf.record_stream(torch.cuda.current_stream(buf.device))
            alg.all_reduce(buf, world, opts, prepared)
            end = handles.ending_stream() if buf.is_cuda else None
            if end is None:
                finish()
                return
            # the phases ended on another stream (the pipelined column lane): finish there, in
            # order after them, and keep the staging copy alive for that stream too
            if not contiguous:
                buf.record_stream(end)
            with torch.cuda.stream(end):
                finish()

        native = (lambda: alg.start(buf, world, opts)) if alg.single_collective else None
        # a sum in place needs no finishing: a native work is then waited for as it is
        done = None if opname != "avg" and contiguous else finish
        return dispatch(world, tensor, job, native, done, async_op)

    # -- reduce-scatter / all-gather (the sharded optimizer's pair) --------------------------------
    def shard_index(self) -> int:
        """Which of the ``world_size`` equal slices this rank owns in :meth:`reduce_scatter` /
        :meth:`all_gather` (every rank owns a different one)."""
        if self._shard is None:
            self._shard = self.algorithm.shard_index(self.world, self.opts, self.prepared)
        return self._shard

    # a profiler range scaleout.reduce_scatter (scaleout/telemetry/profiler.py)
    @traced("reduce_scatter")
    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: Any = "sum", async_op: bool = False
    ) -> Any:
        """``output`` = sum (or average) over every rank of slice :meth:`shard_index` of ``input``
        (``input.numel() == world_size * output.numel()``; both contiguous, same dtype/device).
        Returns ``output`` or, with ``async_op=True``, a Handle."""
        opname = op_name(op, "reduce_scatter")
        world = self.world
        shard.check(output, input, world, "reduce_scatter", "input")
        alg, opts, prepared = self.algorithm, self.opts, self.prepared

        def finish() -> None:
            if opname == "avg":
                output.div_(world.world_size)

        def job() -> None:
            alg.reduce_scatter(output, input, world, opts, prepared)

        # the native op is read at call time (tests count the bytes it sends)
        return shard.run(
            world, output, alg, job, shard._reduce_scatter, input, finish, async_op, output.numel()
        )

    @traced("all_gather")
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Any:
        """Inverse of :meth:`reduce_scatter`: slice :meth:`shard_index` of ``output`` on every
        rank = that rank's ``input`` (``output.numel() == world_size * input.numel()``). Returns
        ``output`` or a Handle."""
        world = self.world
        shard.check(output, input, world, "all_gather", "output")
        alg, opts, prepared = self.algorithm, self.opts, self.prepared

        def job() -> None:
            alg.all_gather(output, input, world, opts, prepared)

        return shard.run(
            world, output, alg, job, shard._all_gather, input, lambda: None, async_op, input.numel()
        )


# -- the functional API: a Collective per call -----------------------------------------------------
def all_reduce(
    tensor: torch.Tensor,
    world: World,
    algorithm: str = "flat",
    op: Any = "sum",
    async_op: bool = False,
    **options: Any,
) -> Any:
    """:meth:`Collective.all_reduce` with ``algorithm`` and its ``options`` (e.g. ``chunk_bytes``
    and ``composition`` of the row/column algorithms, ``x``/``y`` of the torus grid; an option it
    does not have is a one-line UserError). Holding the run's algorithm, build the Collective once
    instead (:meth:`Collective.resolve`)."""
    op_name(op)  # checked before the Collective is built, so a bad op creates no process group
    coll = Collective.resolve(world, algorithm, **options)
    return coll.all_reduce(tensor, op=op, async_op=async_op)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    world: World,
    algorithm: str = "flat",
    op: Any = "sum",
    async_op: bool = False,
    **options: Any,
) -> Any:
    """:meth:`Collective.reduce_scatter` with ``algorithm`` and its ``options``."""
    # checked before the Collective is built, so a bad call creates no process group
    op_name(op, "reduce_scatter")
    shard.check(output, input, world, "reduce_scatter", "input")
    coll = Collective.resolve(world, algorithm, "reduce_scatter", **options)
    return coll.reduce_scatter(output, input, op=op, async_op=async_op)


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    world: World,
    algorithm: str = "flat",
    async_op: bool = False,
    **options: Any,
) -> Any:
    """:meth:`Collective.all_gather` with ``algorithm`` and its ``options``."""
    # checked before the Collective is built, so a bad call creates no process group
    shard.check(output, input, world, "all_gather", "output")
    coll = Collective.resolve(world, algorithm, "all_gather", **options)
    return coll.all_gather(output, input, async_op=async_op)


def shard_index(world: World, algorithm: str = "flat", **options: Any) -> int:
    """Which of the ``world_size`` equal slices this rank owns in :func:`reduce_scatter` /
    :func:`all_gather` with this algorithm."""
    return Collective.resolve(world, algorithm, "shard_index", **options).shard_index()
