"""Grid arithmetic on ranks, torch-free: the X x Y torus rule that ``World`` (its groups), the
2D-torus algorithm (its config check) and the simulator share. It lives below both ``world`` and
``comm`` so that ``World`` never imports communication code.
"""

from __future__ import annotations

from scaleout.errors import TopologyError, UserError


def resolve_grid(
    world_size: int,
    ranks_per_node: int | None,
    x: int | None = None,
    y: int | None = None,
    names: tuple[str, str] = ("x", "y"),
    error: type[UserError] = TopologyError,
) -> tuple[int, int]:
    """The X x Y grid of ``world_size`` ranks: X given, Y given, both, or neither (X = ranks per
    node, or the world when that is unknown). A value that does not fit raises ``error`` naming
    its key."""
    p = world_size
    for name, v in zip(names, (x, y), strict=True):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise error(
                f"torus grid {name}={v!r}: expected a positive integer with x*y = world size {p}"
            )
    if x is not None and y is not None:
        if x * y != p:
            raise error(
                f"torus grid {names[0]}={x} by {names[1]}={y} does not match the world size {p} "
                f"(expected x*y = {p})"
            )
        return x, y
    if x is None and y is None:
        x = ranks_per_node or p
        if p % x:
            raise error(
                f"torus grid x = {x} ranks per node (the default) does not divide the world size "
                f"{p}"
            )
        return x, p // x
    name, given = (names[0], x) if x is not None else (names[1], y)
    if p % given:
        raise error(
            f"torus grid {name}={given} does not divide the world size {p} (expected x*y = {p})"
        )
    x, y = (given, p // given) if x is not None else (p // given, given)
    return x, y
