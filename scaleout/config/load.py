"""YAML + ``a.b=c`` overrides -> :class:`Config`, with one-line errors that name the key."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from scaleout.config.oneline import describe
from scaleout.config.schema import Config
from scaleout.config.yamlread import load_yaml, read_text
from scaleout.errors import ConfigError, excerpt
from scaleout.resources import package_path
from scaleout.section import FAMILIES

CONFIG_DIR = package_path(
    "scaleout", "configs"
)  # the repository's configs/, shipped as package data


def resolve_config_path(path: str | os.PathLike[str]) -> Path:
    """A path as given, else relative to the project's ``configs/`` (``bert_tiny_cpu`` works
    too)."""
    p = Path(path)
    candidates = [p, CONFIG_DIR / p, CONFIG_DIR / f"{p}.yaml"]
    for c in candidates:
        if c.is_file():
            return c
    shipped = ", ".join(sorted(c.stem for c in CONFIG_DIR.glob("*.yaml")))
    raise ConfigError(
        f"config file {str(path)!r} not found (looked in . and {CONFIG_DIR}: {shipped})"
    )


def _read_yaml(path: Path) -> dict[str, Any]:
    text = read_text(path)
    try:
        data = load_yaml(text)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(
            f"{path}{where}: not valid YAML ({getattr(exc, 'problem', exc)})"
        ) from None
    if data is None:
        # An empty file (or only comments) is a mistake, not "all defaults": the defaults are
        # BERT-large on synthetic data. `{}` says "the defaults" on purpose.
        raise ConfigError(
            f"{path}: empty (no sections); expected a mapping of sections (model, data, ...), "
            "or {} for the defaults"
        )
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: expected a mapping of sections (model, data, ...), got {type(data).__name__}"
        )
    return data


def parse_overrides(overrides: list[str]) -> list[tuple[list[str], Any]]:
    """``["optim.lr=2e-3", "comm.algorithm=torus2d"]`` -> [(["optim", "lr"], 0.002), ...]."""
    parsed = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(
                f"override {excerpt(item)} is not of the form section.key=value "
                "(e.g. optim.lr=2e-3)"
            )
        try:
            value = load_yaml(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        except ConfigError as exc:
            raise ConfigError(f"override {key}: {exc}") from None
        parsed.append((key.split("."), value))
    return parsed


def _apply(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for i, part in enumerate(path[:-1]):
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(
                f"override {'.'.join(path)}: {'.'.join(path[: i + 1])} is a value, not a section"
            )
        node = nxt
    node[path[-1]] = value


def _one_line(exc: ValidationError, source: str) -> str:
    return f"{source}: {describe(exc, Config)}"


def load_config(
    path: str | os.PathLike[str] | None = None, overrides: list[str] | None = None
) -> Config:
    """Load ``path`` (or the defaults), apply overrides, validate. Raises ConfigError (one line)."""
    tree: dict[str, Any] = {}
    source = "config"
    if path is not None:
        p = resolve_config_path(path)
        tree = _read_yaml(p)
        source = str(path)
    for keys, value in parse_overrides(list(overrides or [])):
        _apply(tree, keys, value)
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_one_line(exc, source)) from None


def format_config(cfg: Config) -> str:
    """The resolved tree as YAML, as a user writes it: keys by their config names
    (``checkpoint.async``, not the Python field ``async_``) and only the model section of the
    family in use (``model.<arch>``; other families' sections are not read by this run)."""
    tree = cfg.model_dump(mode="json", by_alias=True)
    model = tree.get("model", {})
    for name, _ in FAMILIES.items():
        if name != cfg.model.arch:
            model.pop(name, None)
    return yaml.safe_dump(tree, sort_keys=False)
