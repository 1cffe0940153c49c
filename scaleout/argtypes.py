"""Command-line values: comma lists and byte sizes, parsed in one place.

Two forms of each parser: ``parse_*(text, flag)`` raises :class:`~scaleout.errors.UserError` naming
the flag (for values checked in a command's ``run``), and ``csv_of(...)`` / ``size_arg`` are
argparse ``type=`` callables (argparse turns their ``ArgumentTypeError`` into the usual one-line
usage error).
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from scaleout.errors import UserError, excerpt

T = TypeVar("T")

# K/M/G alone are powers of 1024, as in nccl-tests' -b/-e; KB/MB/GB are powers of 1000.
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 10**9,
    "gib": 1 << 30,
}
_KIND_WORDS = {int: "integers", float: "numbers", str: "names"}


def parse_csv(
    text: str | None,
    flag: str,
    kind: Callable[[str], T] = str,
    *,
    at_least: float | None = None,
    choices: Sequence[Any] | None = None,
    allow_empty: bool = False,
) -> list[T]:
    """``" 1, 2,4 "`` -> [1, 2, 4]: each entry converted by ``kind``; optionally each >=
    ``at_least`` or one of ``choices``. An empty list is an error unless ``allow_empty``."""
    what = _KIND_WORDS.get(kind, "values")  # type: ignore[arg-type]
    items = [t.strip() for t in str(text or "").split(",") if t.strip()]
    try:
        values = [kind(t) for t in items]
    except ValueError:
        raise UserError(f"{flag}={text!r}: expected a comma list of {what}, e.g. 1,2,4") from None
    if any(isinstance(v, float) and not math.isfinite(v) for v in values):
        bad = next(v for v in values if isinstance(v, float) and not math.isfinite(v))
        raise UserError(f"{flag}={excerpt(text)}: {bad} is not a finite number")
    if not values and not allow_empty:
        raise UserError(f"{flag}={text!r}: expected a comma list of {what}, e.g. 1,2,4")
    if at_least is not None and any(v < at_least for v in values):  # type: ignore[operator]
        raise UserError(f"{flag}={text!r}: expected {what} >= {at_least:g}")
    if choices is not None and any(v not in choices for v in values):
        bad = next(v for v in values if v not in choices)
        raise UserError(f"{flag}: {excerpt(bad)} is not one of {', '.join(map(str, choices))}")
    return values


def csv_of(
    kind: Callable[[str], T] = str, *, at_least: float | None = None, allow_empty: bool = True
) -> Callable[[str], list[T]]:
    """An argparse ``type=`` for a comma list (see :func:`parse_csv`)."""

    def parse(text: str) -> list[T]:
        try:
            return parse_csv(text, "value", kind, at_least=at_least, allow_empty=allow_empty)
        except UserError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("value=")) from None

    parse.__name__ = f"comma list of {_KIND_WORDS.get(kind, 'values')}"  # type: ignore[arg-type]
    return parse


def parse_size(text: str, flag: str = "--sizes") -> int:
    """``4KiB``, ``64MiB``, ``1G``, ``4096`` -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise UserError(f"{flag}: {text!r} is not a size (expected e.g. 4KiB, 64MiB, 1GiB, 4096)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_sizes(text: str, flag: str = "--sizes") -> list[int]:
    """``64MiB``, ``4KiB,1MiB``, or a range ``A..B`` in steps of x4."""
    out: list[int] = []
    for part in str(text).split(","):
        if ".." in part:
            lo, hi = (parse_size(s, flag) for s in part.split("..", 1))
            if lo < 1 or hi < lo:
                raise UserError(f"{flag}: range {part!r} must go from a positive size up")
            while lo <= hi:
                out.append(lo)
                lo *= 4
        else:
            out.append(parse_size(part, flag))
    if any(s < 1 for s in out):
        raise UserError(f"{flag} {text!r}: sizes must be positive")
    return out


def fmt_bytes(n: int) -> str:
    """The largest binary unit that divides ``n`` exactly: 4096 -> 4KiB, 3000 -> 3000B."""
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f}{unit}"
    return f"{n}B"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def bounded(
    kind: type[int] | type[float],
    lo: float | None = None,
    hi: float | None = None,
    *,
    above: bool = False,
    what: str = "",
) -> Callable[[str], Any]:
    """An argparse ``type=`` for one number: ``kind`` (int or float), finite, ``>= lo`` (``> lo``
    with ``above``) and ``<= hi``. NaN, inf and values out of range are argparse's one-line usage
    error naming the flag and the value (``argument --host-ms: 'nan': expected a finite number of
    ms >= 0``), so no command has to remember to check a number it reads."""
    unit = f" of {what}" if what else ""
    noun = "an integer" if kind is int else f"a finite number{unit}"
    parts = []
    if lo is not None:
        parts.append(f"{'>' if above else '>='} {_num(lo)}")
    if hi is not None:
        parts.append(f"<= {_num(hi)}")
    expected = f"expected {noun}" + (f" {' and '.join(parts)}" if parts else "")

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{text[:80]!r}: {expected}") from None
        ok = math.isfinite(value)
        ok = ok and (lo is None or (value > lo if above else value >= lo))
        ok = ok and (hi is None or value <= hi)
        if not ok:
            raise argparse.ArgumentTypeError(f"{text[:80]!r}: {expected}")
        return value

    parse.__name__ = noun  # argparse's fallback message names the type
    parse.bounds = (lo, hi, above)  # type: ignore[attr-defined]  # for tests that build cases
    return parse
