"""Reading a config file as untrusted text: UTF-8 only, no duplicate keys, no alias bomb, not empty.

PyYAML's ``safe_load`` shares an aliased node instead of copying it, so a 500-byte file of nested
aliases loads instantly and only explodes later, when validation or an error message walks it
(billions of nodes). :func:`load_yaml` walks the loaded tree once with a node budget and stops at
the first node over it, so the check itself is bounded. A duplicate key would silently keep the
last value (PyYAML's behaviour); here it is an error naming the key and its line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from scaleout.errors import ConfigError, excerpt

# Nodes a config may expand to. The largest shipped config has a few hundred; a bomb has 10^9.
MAX_NODES = 100_000
# A config larger than this is not a config (the largest shipped one is a few KB).
MAX_BYTES = 1 << 20


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping with the same key twice."""


def _mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)  # merge keys (<<) first, as SafeLoader does
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            first = seen.get(key)
        except TypeError:  # an unhashable key: SafeLoader's own error says so
            break
        if first is not None:
            raise ConfigError(
                f"line {line}: duplicate key {excerpt(key)} (first at line {first}); "
                "expected each key once"
            )
        seen[key] = line
    return loader.construct_mapping(node, deep=True)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def _check_size(data: Any, budget: int = MAX_NODES) -> None:
    """Raise ConfigError when ``data`` expands (aliases copied out) to more than ``budget`` nodes;
    stops at the first node over the budget, so a bomb costs ``budget`` steps, not its size."""
    stack = [data]
    count = 0
    while stack:
        node = stack.pop()
        count += 1
        if count > budget:
            raise ConfigError(
                f"expands to more than {budget:,} values (YAML aliases nested inside each other?);"
                " expected a config of sections and keys"
            )
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def load_yaml(text: str) -> Any:
    """``text`` as YAML (safe types only), with unique keys and a bounded expanded size."""
    data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
    _check_size(data)
    return data


def read_text(path: Path) -> str:
    """A config file's text: at most MAX_BYTES, UTF-8 (one line naming the first bad byte)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if len(raw) > MAX_BYTES:
        raise ConfigError(f"{path}: more than {MAX_BYTES} bytes; expected a YAML config file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"{path} line {line}: byte 0x{raw[exc.start]:02x} at offset {exc.start} is not "
            "UTF-8; expected a UTF-8 text file"
        ) from None
