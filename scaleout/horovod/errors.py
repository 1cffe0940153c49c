"""scaleout.horovod's errors: Horovod's names and base classes; a caller's mistake is also one of
scaleout's one-line UserErrors."""

from __future__ import annotations

from scaleout.errors import UserError


class HorovodInternalError(RuntimeError):
    """A collective failed on every rank that took part (mismatched tensors, join conflict,
    shutdown). Same name and base class as Horovod's, so ``except RuntimeError`` code keeps
    working."""


class HorovodValueError(UserError, ValueError):
    """Bad arguments, detected on the calling rank before anything is sent."""


class HorovodNotSupportedError(UserError, NotImplementedError):
    """A Horovod feature that scaleout.horovod does not implement (process sets, elastic,
    Adasum)."""
