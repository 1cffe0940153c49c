"""Units shared by the launchers, the simulator and the config schema (torch-free).

Link rates follow tc(8)'s units, as the emulated cluster (``tc ... tbf rate``) reads them: a bare
number and ``bit`` are bits per second, ``bps`` is *bytes* per second; SI prefixes k/m/g/t are
powers of 1000, IEC prefixes ki/mi/gi/ti powers of 1024. So ``1gbit`` = 1e9 bit/s and ``1gbps`` =
8e9 bit/s.
"""

from __future__ import annotations

import re
from typing import Any

from scaleout.errors import ConfigError

_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_PREFIX.update({"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40})
_RATE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ki|mi|gi|ti|k|m|g|t)?(bit|bps)?")
UNLIMITED = ("", "none", "0", "unlimited")

# Gradient buckets, MiB. 25: the DDP paper's default bucket (Li et al., VLDB 2020; torch DDP's
# bucket_cap_mb); 1: the first bucket (the last layers' gradients, ready first), torch DDP's
# _DEFAULT_FIRST_BUCKET_BYTES, so its all-reduce starts while the rest of backward runs. The
# schema's comm.bucket_mb / comm.first_bucket_mb defaults and every other default read these.
DEFAULT_BUCKET_MB = 25.0
DEFAULT_FIRST_BUCKET_MB = 1.0


def parse_rate(value: Any, what: str = "--rate") -> float | None:
    """A link rate in bit/s: a number (bit/s) or a tc rate ("1gbit", "100mbit", "125mbps" =
    bytes/s); None, "none", "unlimited" or 0 -> None (no limit). ``what`` names the value in the
    error."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) if value > 0 else None
    text = str(value).strip().lower()
    if text in UNLIMITED:
        return None
    m = _RATE.fullmatch(text)
    if not m:
        raise ConfigError(
            f"{what}={value!r}: expected a tc rate like 1gbit, 100mbit or 125mbps (bytes/s), "
            "a number of bit/s, or 'none'"
        )
    number, prefix, unit = m.group(1), m.group(2) or "", m.group(3) or "bit"
    return float(number) * _PREFIX[prefix] * (8 if unit == "bps" else 1)
