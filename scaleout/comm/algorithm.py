"""The all-reduce algorithm extension point: :class:`Algorithm`, its :class:`Options`, and the one
registry :data:`ALGORITHMS`.

An algorithm is one file under ``scaleout/comm/`` (``flat.py``, ``hierarchical.py``, ``torus2d.py``)
holding a subclass of :class:`Algorithm` and one ``register(...)`` call:

* ``name`` and ``help``;
* ``Options``: its options (a pydantic model; ``from_config`` reads them from the run config's
  ``comm`` section, ``config_keys`` says which ``comm.*`` keys it reads);
* ``check(opts, world_size, ranks_per_node)``: the checks that need the world (one-line error);
* the runtime: ``all_reduce`` (a blocking in-place sum of a 1-D contiguous buffer), and optionally
  ``reduce_scatter`` / ``all_gather`` / ``shard_index`` for the sharded LAMB (the defaults are
  torch.distributed's collectives on the world group);
* ``cost(opts, cluster, nodes, nbytes, chunks)``: its alpha-beta cost plan for the simulator.

This module and the declarations are torch-free (the config schema reads them; ``import
scaleout.config`` must not import torch): the runtime methods import torch when they run, and the
cost methods import the simulator's numpy building blocks when they are priced.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError

from scaleout.errors import UserError
from scaleout.section import ALGORITHMS

if TYPE_CHECKING:
    import torch

    from scaleout.config.schema import CommConfig
    from scaleout.sim.cluster import Cluster
    from scaleout.sim.cost import Plan
    from scaleout.world import World


class Options(BaseModel):
    """An algorithm's options (none by default). Subclasses add fields, list the ``comm.*``
    config keys they read in ``config_keys`` and build themselves from the config in
    ``from_config``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    config_keys: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_config(cls, comm: CommConfig) -> Options:
        return cls()


class Algorithm:
    """Base class of an all-reduce algorithm (see the module docstring for the protocol)."""

    name: ClassVar[str]
    help: ClassVar[str] = ""
    Options: ClassVar[type[Options]] = Options
    # True when all_reduce is one torch.distributed collective: ``start`` then returns its async
    # work and no communication thread is needed for ``async_op=True``.
    single_collective: ClassVar[bool] = False

    def options(self, what: str = "all_reduce", **kwargs: Any) -> Options:
        """``Options`` from keyword arguments (``all_reduce(..., **options)``); one-line
        UserError."""
        unknown = sorted(set(kwargs) - set(self.Options.model_fields))
        if unknown:
            raise UserError(
                f"{what} option(s) {unknown} not understood by algorithm {self.name!r}: "
                f"expected {sorted(self.Options.model_fields) or 'none'}"
            )
        try:
            return self.Options(**{k: v for k, v in kwargs.items() if v is not None})
        except ValidationError as e:
            err = e.errors()[0]
            key = ".".join(str(p) for p in err["loc"])
            raise UserError(
                f"{what} {key}={err.get('input')!r} ({self.name}): {err['msg']}"
            ) from None

    def check(self, opts: Options, world_size: int, ranks_per_node: int | None) -> None:
        """Checks that need the world size; raise ConfigError / TopologyError naming the key."""

    # -- runtime (torch: import it inside, mark the import ``# deferred: torch runtime``) ----------
    def prepare(self, world: World, opts: Options) -> Any:
        """Resolved in the caller's thread before the collective is queued (process groups are
        created in call order on every rank, and a bad grid fails at the call). Passed to the
        methods below."""
        return None

    def start(self, buf: torch.Tensor, world: World, opts: Options) -> Any:
        """``single_collective`` algorithms: start the async work (None: nothing to send)."""
        raise NotImplementedError(f"all-reduce algorithm {self.name!r} is not a single collective")

    def all_reduce(self, buf: torch.Tensor, world: World, opts: Options, prepared: Any) -> None:
        """Sum ``buf`` (1-D, contiguous) over every rank of ``world``, in place, blocking."""
        raise NotImplementedError(f"all-reduce algorithm {self.name!r} has no all_reduce")

    def shard_index(self, world: World, opts: Options, prepared: Any) -> int:
        """Which of the ``world_size`` equal slices this rank owns in reduce_scatter /
        all_gather."""
        return world.rank

    def reduce_scatter(
        self, out: torch.Tensor, inp: torch.Tensor, world: World, opts: Options, prepared: Any
    ) -> None:
        """``out`` = the sum over every rank of slice ``shard_index`` of ``inp`` (blocking)."""
        from scaleout.comm.scatter import world_reduce_scatter  # deferred: torch runtime

        world_reduce_scatter(out, inp, world)

    def all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, world: World, opts: Options, prepared: Any
    ) -> None:
        """Slice ``shard_index`` of ``out`` on every rank = that rank's ``inp`` (blocking)."""
        from scaleout.comm.scatter import world_all_gather  # deferred: torch runtime

        world_all_gather(out, inp, world)

    # -- cost model (the simulator's numpy building blocks, imported when priced) ------------------
    def cost(
        self,
        opts: Options,
        cluster: Cluster,
        nodes: int,
        nbytes: float,
        chunks: int | None = None,
    ) -> Plan:
        """The alpha-beta-gamma plan of one all-reduce of ``nbytes`` per rank on ``nodes`` nodes."""
        raise NotImplementedError(f"all-reduce algorithm {self.name!r} has no cost model")

    def half_cost(
        self, kind: str, opts: Options, cluster: Cluster, nodes: int, nbytes: float
    ) -> Plan:
        """Reduce-scatter (``kind="rs"``) or all-gather (``"ag"``) of ``nbytes`` per rank, as
        ``reduce_scatter`` / ``all_gather`` run it (default: one ring over the world)."""
        from scaleout.sim.cost import row_col_half_plan  # deferred: numpy cost model

        return row_col_half_plan(kind, None, cluster, nodes, nbytes)

    def __repr__(self) -> str:
        return f"<all-reduce algorithm {self.name}>"


def register(algorithm: Algorithm) -> Algorithm:
    """Register an algorithm instance under its ``name`` (a taken name is refused)."""
    return ALGORITHMS.register(algorithm.name, algorithm)


def get_algorithm(name: str) -> Algorithm:
    """The registered algorithm ``name`` (one-line error listing the choices)."""
    return ALGORITHMS.get(name)
