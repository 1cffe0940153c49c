"""Horovod's settings, read from its own environment variables at ``hvd.init`` (listed in
:mod:`scaleout.horovod.basics`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from scaleout.horovod.errors import HorovodNotSupportedError, HorovodValueError

MiB = 1 << 20


@dataclass(frozen=True)
class Settings:
    fusion_threshold: int = 128 * MiB  # Horovod 0.28 operations.cc default
    cycle_time_s: float = 1e-3  # Horovod's default HOROVOD_CYCLE_TIME, 1 ms
    cache_capacity: int = 1024  # Horovod's default HOROVOD_CACHE_CAPACITY
    timeline: str | None = None
    mark_cycles: bool = False
    stall_check_s: float = 60.0  # Horovod's stall inspector default
    stall_shutdown_s: float = 0.0


def _env_number(name: str, default: float, kind: type = int, minimum: float = 0) -> Any:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise HorovodValueError(
            f"{name}={raw!r}: expected a {kind.__name__} >= {minimum}"
        ) from None
    if value < minimum:
        raise HorovodValueError(f"{name}={raw!r}: expected a {kind.__name__} >= {minimum}")
    return value


def settings_from_env() -> Settings:
    if os.environ.get("HOROVOD_ELASTIC") == "1":
        raise HorovodNotSupportedError(
            "HOROVOD_ELASTIC=1: elastic training is not supported by scaleout.horovod"
        )
    timeline = os.environ.get("HOROVOD_TIMELINE") or None
    return Settings(
        fusion_threshold=_env_number("HOROVOD_FUSION_THRESHOLD", Settings.fusion_threshold),
        cycle_time_s=_env_number("HOROVOD_CYCLE_TIME", 1.0, float) / 1000.0,
        cache_capacity=_env_number("HOROVOD_CACHE_CAPACITY", Settings.cache_capacity),
        timeline=None if timeline == "DYNAMIC" else timeline,
        mark_cycles=os.environ.get("HOROVOD_TIMELINE_MARK_CYCLES", "0") not in ("", "0"),
        stall_check_s=_env_number(
            "HOROVOD_STALL_CHECK_TIME_SECONDS", Settings.stall_check_s, float
        ),
        stall_shutdown_s=_env_number("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", 0.0, float),
    )
