"""Small agreements through the rendezvous store: one rank decides, every other rank reads it.

Why not an object collective on a gloo group: a gloo group over every rank connects a full mesh when
it is made (world - 1 sockets per rank, and each rank fetches every other rank's address record from
the store: bytes served by rank 0's store grow as world squared). At 2,048 ranks that is 2,047
sockets per process, past a login shell's ``ulimit -n`` of 1,024, and ~69 GB through one TCPStore
(review gpu-day-two §1). Through the store, a value one rank sets is one ``get`` per reader: per
rank, one socket (the store client every rank already has) and the value's own bytes, at any world
size.

Every rank calls :func:`share` / :func:`broadcast_object` at the same point, in the same order (like
a collective): the key is a per-World sequence number plus the name, so repeated calls (a second
restore in one process) never read an earlier value. A value the deciding rank could not compute is
re-raised on every rank as one line (a :class:`~scaleout.errors.UserError` keeps its type and text),
so no rank waits for a key that never comes.
"""

from __future__ import annotations

import itertools
import pickle
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch.distributed as dist

from scaleout.errors import UserError

if TYPE_CHECKING:
    from scaleout.world import World

T = TypeVar("T")

PREFIX = "scaleout/share"
# The call sequence of each World (every rank counts its calls alike). Weak: a closed World's count
# goes with it; a new World in the same process (a test pool) starts a new store and a new count.
_SEQUENCE: weakref.WeakKeyDictionary[Any, itertools.count] = weakref.WeakKeyDictionary()


class PeerFailed(RuntimeError):
    """The deciding rank failed with something other than a bad input (its traceback is in its
    own output)."""


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


def _key(world: World, name: str) -> str:
    seq = _SEQUENCE.setdefault(world, itertools.count())
    return f"{PREFIX}/{next(seq)}/{name}"


def share(world: World | None, name: str, decide: Callable[[], T], src: int = 0) -> T:
    """``decide()`` on rank ``src`` only; its value on every rank. An exception in ``decide`` is
    raised on every rank: a UserError as itself (the same line everywhere), anything else as
    :class:`PeerFailed` naming ``src`` on the other ranks. The value must pickle and be small (it
    is held by the store; every reader fetches it once)."""
    if world is None or world.world_size == 1:
        return decide()
    key = _key(world, name)
    if world.rank == src:
        try:
            value = decide()
        except UserError as exc:
            _store().set(key, pickle.dumps(("user", type(exc), str(exc))))
            raise
        except BaseException as exc:
            _store().set(key, pickle.dumps(("failed", type(exc).__name__, str(exc)[:300])))
            raise
        _store().set(key, pickle.dumps(("ok", value), protocol=pickle.HIGHEST_PROTOCOL))
        return value
    kind, *rest = pickle.loads(_store().get(key))  # waits up to the store's timeout
    if kind == "ok":
        return rest[0]
    if kind == "user":
        raise rest[0](rest[1])
    raise PeerFailed(f"rank {src} failed while deciding {name}: {rest[0]}: {rest[1]}")


def broadcast_object(world: World | None, name: str, obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (the others pass anything, e.g. None)."""
    return share(world, name, lambda: obj, src)
