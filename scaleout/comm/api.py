"""``all_reduce(tensor, world, algorithm=..., op=..., async_op=...)`` and the one algorithm registry
(``reduce_scatter`` / ``all_gather`` over the same registry: :mod:`scaleout.comm.shard`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from scaleout.comm import handles
from scaleout.comm.flat import flat_async
from scaleout.comm.grid import COMPOSITIONS, Grid, reduce_grid
from scaleout.comm.hierarchical import hierarchical_grid
from scaleout.comm.torus import torus_grid
from scaleout.errors import UserError
from scaleout.profile import traced

if TYPE_CHECKING:
    from scaleout.world import World


@dataclass(frozen=True)
class Algorithm:
    """An all-reduce algorithm: ``grid`` maps (world, **grid options) to the row/column decomposition;
    ``grid=None`` is the flat baseline (torch.distributed's own all_reduce)."""

    name: str
    help: str
    grid: Callable[..., Grid] | None
    grid_options: tuple[str, ...] = ()
    options: tuple[str, ...] = ()


ALGORITHMS: dict[str, Algorithm] = {}


def register(alg: Algorithm) -> Algorithm:
    ALGORITHMS[alg.name] = alg
    return alg


register(Algorithm("flat", "torch.distributed all_reduce on the world group (baseline)", None))
register(
    Algorithm(
        "hierarchical",
        "intra-node reduce-scatter -> inter-node all-reduce -> intra-node all-gather, chunk-pipelined",
        hierarchical_grid,
        options=("chunk_bytes", "composition"),
    )
)
register(
    Algorithm(
        "torus2d",
        "2D torus X x Y (arXiv 1811.05233): row reduce-scatter -> column all-reduce -> row all-gather",
        torus_grid,
        grid_options=("x", "y"),
        options=("chunk_bytes", "composition"),
    )
)


def get_algorithm(name: str) -> Algorithm:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise UserError(
            f"unknown all-reduce algorithm {name!r}: expected one of {sorted(ALGORITHMS)}"
        ) from None


def op_name(op: Any, what: str = "all_reduce") -> str:
    if op in ("sum", dist.ReduceOp.SUM):
        return "sum"
    if op in ("avg", "mean", getattr(dist.ReduceOp, "AVG", None)):
        return "avg"
    raise UserError(f"{what} op={op!r}: expected 'sum' or 'avg'")


@traced("all_reduce")
def all_reduce(
    tensor: torch.Tensor,
    world: World,
    algorithm: str = "flat",
    op: Any = "sum",
    async_op: bool = False,
    **options: Any,
) -> Any:
    """Reduce ``tensor`` over every rank of ``world``, in place.

    Returns ``tensor`` (``async_op=False``) or a :class:`~scaleout.comm.handles.Handle` whose
    ``wait()`` returns it once every phase has completed. Any shape, element count and strides; any
    dtype gloo/NCCL can add (fp32, bf16, fp16, integers; ``avg`` needs floating point). ``avg`` is the
    sum divided by the world size, exactly as for ``flat``, so results match bit for bit on
    integer-valued data. All ranks must issue their all-reduces in the same order (as for
    torch.distributed); several may be in flight.

    Options: ``chunk_bytes`` (pipeline chunk, hierarchical/torus2d), ``composition`` ('sharded', the
    default, or 'leader'; gloo only), ``x``/``y`` (torus2d grid; default x = ranks per node).
    """
    alg = get_algorithm(algorithm)
    opname = op_name(op)
    allowed = set(alg.grid_options) | set(alg.options)
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise UserError(
            f"all_reduce option(s) {unknown} not understood by algorithm {algorithm!r}: expected {sorted(allowed) or 'none'}"
        )
    chunk_bytes = options.get("chunk_bytes")
    if chunk_bytes is not None and (not isinstance(chunk_bytes, int) or chunk_bytes < 1):
        raise UserError(f"all_reduce chunk_bytes={chunk_bytes!r}: expected an integer >= 1")
    composition = options.get("composition", "sharded")
    if composition not in COMPOSITIONS:
        raise UserError(
            f"all_reduce composition={composition!r}: expected one of {list(COMPOSITIONS)}"
        )
    if opname == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise UserError(f"all_reduce op='avg' needs a floating-point tensor, got {tensor.dtype}")

    # Groups are resolved here, in the caller's thread, so that a bad grid fails at the call (one-line
    # TopologyError) and group creation happens in call order on every rank.
    grid = (
        alg.grid(world, **{k: options[k] for k in alg.grid_options if k in options})
        if alg.grid
        else None
    )

    contiguous = tensor.is_contiguous()
    buf = tensor.view(-1) if contiguous else tensor.contiguous().view(-1)
    p = world.world_size

    def finish() -> None:
        if opname == "avg":
            buf.div_(p)
        if not contiguous:
            tensor.copy_(buf.view(tensor.shape))

    def job() -> None:
        if grid is None:
            work = flat_async(buf, world)
            if work is not None:
                work.wait()
        else:
            reduce_grid(buf, grid, chunk_bytes, composition)
        finish()

    native = (lambda: flat_async(buf, world)) if grid is None else None
    return dispatch(world, tensor, job, native, finish, async_op)


def dispatch(
    world: World,
    result: torch.Tensor,
    job: Callable[[], None],
    native: Callable[[], Any] | None,
    finish: Callable[[], None],
    async_op: bool,
) -> Any:
    """Run one collective schedule in call order: ``job`` does everything (all phases, then ``finish``);
    ``native`` (single-collective algorithms) starts one torch.distributed async work instead, or returns
    None when there is nothing to send. Returns ``result`` (sync) or a Handle completing with it.

    In this thread when the World's communication thread has nothing queued (launch order is still the
    call order), else queued behind it: c10d matches collectives by their order on a group, so a call
    must never overtake an earlier one that shares its groups.
    """
    thread = handles.existing_thread(world)
    idle = thread is None or thread.idle
    if not async_op:
        if idle:  # nothing queued: run in this thread (no hand-off)
            job()
            return result
        return thread.submit(job, result).wait()
    if native is not None and idle:
        work = native()  # one native async collective: no thread needed
        if work is None:
            finish()
            return handles.completed(result)
        try:
            future = work.get_future()
        except RuntimeError:  # gloo's reduce_scatter / all_gather works have no future (torch 2.13)
            return WorkHandle(work, finish, result)
        return handles.Handle(future.then(lambda _f: (finish(), result)[1]), result)
    return handles.comm_thread(world).submit(job, result)


class WorkHandle(handles.Handle):
    """A native work without a future: ``wait()`` waits for it, then runs ``finish`` once."""

    def __init__(self, work: Any, finish: Callable[[], None], result: torch.Tensor):
        self.work, self._finish, self.tensor = work, finish, result
        self.future = None  # type: ignore[assignment]  (not usable as a DDP hook's future)
        self._done = False

    def wait(self) -> torch.Tensor:
        if not self._done:
            self.work.wait()
            self._finish()
            self._done = True
        return self.tensor

    def is_completed(self) -> bool:
        return self._done or self.work.is_completed()
