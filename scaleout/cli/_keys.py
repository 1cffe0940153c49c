"""``key=value`` settings for the CLI's analytic tools, instead of one flag per parameter.

`scaleout simulate` prices a cluster and a training step from a few dozen numbers (GPUs per node,
link rates, MFU, bucket size, ...). Each was a flag once (62 flags in all); now they are
``cluster.<key>=`` and ``sim.<key>=`` overrides written the way `scaleout train CONFIG key=value`
takes a config's, parsed by the same parser (:func:`scaleout.config.parse_overrides`: YAML
scalars), checked here against a table that also writes the help. Anything else that looks like
``section.key=value`` is a training config override (it needs --config).
"""

from __future__ import annotations

import argparse
import re
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from scaleout.errors import ConfigError


@dataclass(frozen=True)
class Key:
    """One setting: its type (``float``, ``int``, ``bool`` or ``str``), default (None: the preset's
    or the config's value) and help; ``minimum``/``above``: the smallest value allowed (inclusive /
    exclusive)."""

    type: type
    default: Any
    help: str
    minimum: float | None = None
    above: float | None = None


# The simulated cluster: a preset's parameters, each replaceable (sim.cluster.custom_cluster).
CLUSTER_KEYS: dict[str, Key] = {
    "gpus_per_node": Key(int, None, "GPUs (ranks) per node", above=0),
    "nics": Key(int, None, "NICs per node", above=0),
    "intra_gbs": Key(float, None, "achievable intra-node GB/s per GPU per direction", above=0),
    "inter_gbit": Key(float, None, "achievable Gbit/s per NIC per direction", above=0),
    "intra_lat_us": Key(float, None, "latency of one intra-node step (us)", minimum=0),
    "inter_lat_us": Key(float, None, "latency of one network step (us)", minimum=0),
    "sharp": Key(bool, None, "in-network reduction between nodes (SHARP / NCCL CollNet; off)"),
}

# The model and the training step of `simulate scale` (scaleout.sim.step: ModelSpec, TrainSpec) and
# its goodput row (scaleout.sim.goodput).
SCALE_KEYS: dict[str, Key] = {
    "optimizer": Key(
        str,
        None,
        "replicated | sharded | sharded-node (default replicated, or the config's optim.sharded)",
    ),
    "local_batch": Key(
        float, None, "samples per GPU per step (default 4, or the config's)", above=0
    ),
    "params": Key(float, None, "parameter count (default the model preset's)", above=0),
    "flops_per_sample": Key(
        float, None, "training FLOPs per sample (default the preset's)", above=0
    ),
    "grad_bytes": Key(int, None, "bytes per gradient element on the wire", above=0),
    "param_bytes": Key(int, None, "bytes per parameter a sharded optimizer all-gathers", above=0),
    "mfu": Key(float, 0.4, "achieved fraction of peak FLOP/s", above=0),
    "samples_per_s": Key(float, None, "per-device throughput (replaces sim.mfu)", above=0),
    "bucket_mb": Key(
        float, None, "gradient bucket MB (default DDP's 25, or comm.bucket_mb)", above=0
    ),
    "overlap": Key(bool, None, "all-reduce during backward (default true; false: after it)"),
    "torus_x": Key(str, None, "torus row length: an integer, node or square (default square)"),
    "samples": Key(float, None, "samples to converge at every batch (default: sim.convergence)"),
    "convergence": Key(
        str,
        None,
        "samples to converge vs global batch: rcp (MLCommons' reference convergence points, from "
        "mlperf-logging), a `scaleout bench largebatch --out` JSON (fitted) or fixed (the preset's "
        "samples at every batch); default rcp for the presets, fixed with --config",
    ),
    "rcp_ruleset": Key(str, None, "MLPerf Training ruleset whose RCPs to read (default 2.0.0)"),
    "cuda_graphs": Key(
        bool,
        None,
        "the step is one CUDA graph: host cost only (false: eager, launch-bound) (default true, "
        "or what the config's step is: model.cuda_graphs where the trainer can capture it)",
    ),
    "overhead": Key(
        str,
        "scaleout-h200",
        "calibration of the fixed per-step cost: scaleout-h200 (scaleout's measured H200 rows), "
        "nvidia-bert (NVIDIA's MLPerf BERT, from a published run) or none",
    ),
    "host_ms": Key(float, None, "per-step host time in ms (replaces sim.overhead's)", minimum=0),
    # None: the schema's checkpoint.mtbf_h default, read when the command runs (cli/simulate.py)
    "mtbf_h": Key(
        float,
        None,
        "one node's mean time between failures, hours (default checkpoint.mtbf_h's)",
        above=0,
    ),
    "save_stall_s": Key(float, 1.0, "seconds a checkpoint stalls training (async save)", minimum=0),
    "restart_s": Key(float, 300.0, "seconds from a failure to training again", minimum=0),
    "interval_s": Key(float, None, "seconds between checkpoints (default Young/Daly's)", above=0),
}

ALLREDUCE_KEYS: dict[str, Key] = {
    "torus_x": Key(str, "square", "torus row length: an integer, node or square"),
}

# section.key=value: an override wherever it stands on the command line.
_OVERRIDE = re.compile(r"^[A-Za-z_][\w-]*(\.[\w-]+)+=")


def overrides_anywhere(parser: argparse.ArgumentParser) -> None:
    """Let overrides follow options (`sweep CFG --world 1,2 optim.lr=1e-3`): argparse alone
    cannot place a positional list after options, so override-shaped tokens are taken out before
    parsing and put back as ``overrides``."""
    parse = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):  # type: ignore[no-untyped-def]
        args = list(args or [])
        found = [a for a in args if _OVERRIDE.match(a)]
        ns, extra = parse([a for a in args if not _OVERRIDE.match(a)], namespace)
        ns.overrides = list(getattr(ns, "overrides", None) or []) + found
        return ns, extra

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


def _typed(name: str, value: Any, key: Key) -> Any:
    if key.type is bool:
        ok = isinstance(value, bool)
    elif key.type is str:
        ok, value = value is not None, str(value)
    elif key.type is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    if not ok:
        what = {bool: "true or false", int: "an integer", float: "a number"}[key.type]
        raise ConfigError(f"{name}={value!r}: expected {what}")
    if key.above is not None and not value > key.above:
        raise ConfigError(f"{name}={value!r}: expected a value > {key.above:g}")
    if key.minimum is not None and not value >= key.minimum:
        raise ConfigError(f"{name}={value!r}: expected a value >= {key.minimum:g}")
    return value


def settings(
    overrides: list[str], sections: Mapping[str, Mapping[str, Key]]
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """({section: {key: value}} for every section of ``sections``, defaults filled in; the other
    overrides, left for a training config). A key that a section lacks is one line naming the
    section's keys."""
    from scaleout.config import parse_overrides

    ours = [o for o in overrides if o.partition(".")[0] in sections]
    rest = [o for o in overrides if o.partition(".")[0] not in sections]
    out = {s: {k: key.default for k, key in keys.items()} for s, keys in sections.items()}
    for path, value in parse_overrides(ours):
        section, name = path[0], ".".join(path[1:])
        key = sections[section].get(name)
        if key is None:
            raise ConfigError(
                f"{section}.{name}: unknown key; expected one of "
                + ", ".join(f"{section}.{k}" for k in sections[section])
            )
        out[section][name] = _typed(f"{section}.{name}", value, key)
    return out, rest


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()  # as written in YAML
    return f"{value:g}" if isinstance(value, float) else str(value)


def describe(sections: Mapping[str, Mapping[str, Key]], width: int = 100) -> str:
    """The keys as help lines, ``  section.key   help (default D)``, wrapped at ``width``."""
    names = {f"{s}.{k}": key for s, keys in sections.items() for k, key in keys.items()}
    col = 2 + max(map(len, names)) + 2
    lines = []
    for name, key in names.items():
        default = "" if key.default is None else f" (default {_shown(key.default)})"
        lines += textwrap.wrap(
            key.help + default,
            width,
            initial_indent=f"  {name}".ljust(col),
            subsequent_indent=" " * col,
        )
    return "\n".join(lines)
