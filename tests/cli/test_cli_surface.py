"""The command-line surface is frozen: every (command, flag) pair of `scaleout` -- its subcommands
and the sub-subcommands of `bench`, `simulate`, `data`, ... as the CLI discovers them
(scaleout/cli/__init__.py) -- is checked in as tests/data/cli_surface.json, and a flag that is not
there fails this test.

The idea is torchtitan's (tests/unit_tests/test_no_new_cli_options.py): every flag is one more name
for a user to learn and for the docs to keep, and a flag that re-declares a config key
(`--bucket-mb` next to comm.bucket_mb) is a second way to say the same thing. A setting of a run
belongs in the config, set from the command line as a key=value override (`scaleout train CONFIG
comm.bucket_mb=4`, `scaleout bench ttt train.precision=fp32`). When a new flag is really the tool's
own (a variant list, an output path), add it and update the snapshot deliberately, in the same
commit:

python3 tests/cli/test_cli_surface.py --write
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script (--write) from a checkout
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402

from scaleout.cli import build_parser  # noqa: E402

pytestmark = pytest.mark.unit

SNAPSHOT = ROOT / "tests" / "data" / "cli_surface.json"
WRITE = "python3 tests/cli/test_cli_surface.py --write"


def surface(
    parser: argparse.ArgumentParser | None = None, command: str = ""
) -> dict[str, list[str]]:
    """{command: its flags} for every parser under ``parser`` (default: `scaleout`'s), ``--help``
    aside. A command is the words after `scaleout` ("bench ttt"); `scaleout` itself is ""."""
    parser = parser or build_parser()
    flags, out = [], {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.update(surface(sub, f"{command} {name}".strip()))
        elif not isinstance(action, argparse._HelpAction):
            flags += action.option_strings
    return {command: sorted(flags), **out}


def pairs(commands: dict[str, list[str]]) -> set[tuple[str, str]]:
    return {(c, f) for c, fs in commands.items() for f in fs}


def _snapshot() -> dict[str, list[str]]:
    return json.loads(SNAPSHOT.read_text())["commands"]


def _show(found: set[tuple[str, str]]) -> str:
    return ", ".join(f"'scaleout {c} {f}'".replace("  ", " ") for c, f in sorted(found))


def test_no_new_flags() -> None:
    added = pairs(surface()) - pairs(_snapshot())
    assert not added, (
        f"new command-line flags: {_show(added)}. The CLI surface is frozen "
        "(tests/cli/test_cli_surface.py): prefer a config key, set as a key=value override (a "
        "benchmark "
        "that trains takes --config and overrides: scaleout.bench._harness.add_config_arguments); "
        "if the "
        f"flag is the tool's own, update the snapshot deliberately: {WRITE}"
    )


def test_snapshot_is_exact() -> None:
    """A removed flag leaves the snapshot too: else it could come back unnoticed."""
    now, then = surface(), _snapshot()
    gone = pairs(then) - pairs(now)
    assert not gone, f"flags gone from the CLI but still in {SNAPSHOT.name}: {_show(gone)}; {WRITE}"
    assert set(now) == set(then), (
        f"commands differ from {SNAPSHOT.name}: {set(now) ^ set(then)}; {WRITE}"
    )


# A flag named like a config key that means something else, with why.
SAME_NAME_OTHER_MEANING = {
    (
        "compile",
        "--backend",
    ): "torch.compile's backend (inductor, eager), not launch.backend (nccl, gloo)",
    (
        "largebatch",
        "--eval-every",
    ): "in large-batch steps: the base run evaluates every factor x this",
}


def test_a_config_benchmark_repeats_no_config_key() -> None:
    """A benchmark with key=value overrides takes the config's keys there only: none of its flags
    is named after a config key (--bucket-mb beside comm.bucket_mb, --precision beside
    train.precision)."""
    from scaleout.cli.bench import benches
    from scaleout.config.schema import Config

    def leaves(model: type, prefix: str = "") -> dict[str, str]:
        out = {}
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                out.update(leaves(ann, f"{prefix}{name}."))
            else:
                out[name] = f"{prefix}{name}"
        return out

    keys = leaves(Config)
    clashes = []
    for mod in benches():
        p = argparse.ArgumentParser()
        mod.add_arguments(p)
        if not any(a.dest == "overrides" for a in p._actions):
            continue
        for a in p._actions:
            for flag in a.option_strings:
                name = flag.lstrip("-").replace("-", "_")
                if name in keys and (mod.NAME, flag) not in SAME_NAME_OTHER_MEANING:
                    clashes.append(f"bench {mod.NAME} {flag} (config key {keys[name]})")
    assert not clashes, f"flags that repeat a config key (use key=value overrides): {clashes}"


def test_every_benchmark_default_config_loads_outside_the_checkout(tmp_path, monkeypatch) -> None:
    """A benchmark's default --config is a shipped config's name, found from any directory
    (`scaleout bench plan` run from /tmp once stopped at 'configs/bert_tiny_cpu.yaml not found')."""
    from scaleout.cli.bench import benches
    from scaleout.config import load_config

    monkeypatch.chdir(tmp_path)
    checked = []
    for mod in benches():
        p = argparse.ArgumentParser()
        mod.add_arguments(p)
        default = next((a.default for a in p._actions if a.dest == "config"), None)
        if default is not None:
            load_config(default)  # raises UserError naming the path when it is not found
            checked.append(mod.NAME)
    assert "plan" in checked and len(checked) >= 5, checked


def write() -> None:
    commands = surface()
    SNAPSHOT.write_text(
        json.dumps(
            {
                "_what": "scaleout's frozen command-line surface: tests/cli/test_cli_surface.py; "
                f"update deliberately with {WRITE}",
                "parsers": len(commands),
                "flags": sum(len(f) for f in commands.values()),
                "commands": commands,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"{os.path.relpath(SNAPSHOT)}: {len(commands)} parsers, {len(pairs(commands))} flags")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(f"usage: {WRITE}")
    write()
