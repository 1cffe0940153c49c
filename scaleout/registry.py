"""``Registry[T]``: the one shape of scaleout's extension points.

Model families (:mod:`scaleout.families`), all-reduce algorithms (:mod:`scaleout.comm`) and launcher
environments (:mod:`scaleout.env`) each keep one registry. Everything that lists the choices (the
config schema's ``Literal``s, CLI ``choices=``, the simulator's lists, the docs tables) reads
``names()`` from it, so a name is written once: where the implementation registers itself. As
torch.distributed.elastic's ``RendezvousHandlerRegistry``, a second registration under a taken name
is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, Literal, TypeVar

from scaleout.errors import UserError

T = TypeVar("T")


class RegistryError(UserError):
    """A lookup of an unknown name, or a second registration under a taken one."""


class Registry(Generic[T]):
    """Named implementations of one extension point, in registration order.

    ``kind`` names the extension point in errors ("all-reduce algorithm", "model family"...).
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str, item: T) -> T:
        if not name or not isinstance(name, str):
            raise RegistryError(f"{self.kind} name {name!r}: expected a non-empty string")
        if name in self._items:
            raise RegistryError(
                f"{self.kind} {name!r} is already registered ({self._items[name]!r}); "
                "choose another name"
            )
        self._items[name] = item
        return item

    def decorator(self, name: str) -> Callable[[T], T]:
        """``@REGISTRY.decorator("name")`` registers a class or function under ``name``."""

        def wrap(item: T) -> T:
            return self.register(name, item)

        return wrap

    def unregister(self, name: str) -> None:
        """Remove ``name`` (tests that register a toy implementation clean up with this)."""
        self._items.pop(name, None)

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise RegistryError(
                f"unknown {self.kind} {name!r}: expected one of {', '.join(self._items)}"
            ) from None

    def names(self) -> tuple[str, ...]:
        return tuple(self._items)

    def literal(self, *extra: str) -> object:
        """``Literal[...]`` of the registered names (plus ``extra``), for a pydantic field's
        type."""
        return Literal[(*extra, *self._items)]  # type: ignore[valid-type]

    def items(self) -> Iterator[tuple[str, T]]:
        return iter(list(self._items.items()))

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._items)})"
