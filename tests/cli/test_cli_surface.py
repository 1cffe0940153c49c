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
    ("plan", "--workdir"): "the benchmark's scratch folder, not launch.container.workdir (pyxis)",
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


# -- the user's CLI: every command but the lab group -----------------------------------------------
# The product and the lab are two surfaces (scaleout/cli/__init__.py): the verbs a user runs, with
# few flags and one meaning per flag name, and `scaleout bench` (benchmarks, the netns cluster)
# apart.
USER_FLAG_BUDGET = 150

# Every flag name that more than one user command takes, with its one meaning: every parser that
# takes it stores it under the same dest, and its help says so (the pattern, a regex, must match
# every help). A new shared name needs a row here; a name with a second meaning needs another name.
SHARED_FLAGS: dict[str, tuple[str, str, str]] = {
    # flag: (dest, the one meaning, a pattern every help matches)
    "--algorithms": (
        "algorithms",
        "all-reduce algorithms to price, a comma list",
        r"all-reduce algorithms",
    ),
    "--config": ("config", "the run's training config (file or name)", r"config"),
    "--env": ("env", "the launcher environment to force instead of detecting it", r"environment"),
    "--executor": ("executor", "submitit's executor: auto, slurm, local or debug", r"executor"),
    "--global-batch": ("global_batch", "the global batch (samples per step)", r"batch"),
    "--max-per-pack": (
        "max_per_pack",
        "sequences per packed row",
        r"per (pack|packed )?row|per pack",
    ),
    "--max-seq-len": ("max_seq_len", "tokens per sequence", r"tokens per sequence"),
    "--model": ("model", "a simulator model preset (bert-large, resnet50)", r"model preset"),
    "--netns": ("netns", "each emulated node in its own network namespace", r"namespace"),
    "--nnodes": ("nnodes", "the number of nodes (a comma list where a command sweeps)", r"node"),
    "--no-gpu-request": ("no_gpu_request", "ask Slurm for no GPUs", r"(ask|request).*GPU"),
    "--nproc-per-node": ("nproc_per_node", "ranks (processes) per node", r"per node"),
    "--out": ("out", "where the command writes its output", r"output|write|JSON|PNG|YAML"),
    "--packing": ("packing", "packing algorithm(s): spfhp, lpfhp, nnlshp, lphp", r"packing"),
    "--partition": ("partition", "the Slurm partition", r"partition"),
    "--png": ("png", "write a PNG picture here", r"PNG"),
    "--preset": ("preset", "the simulated cluster: a preset or a calibrate JSON", r"preset"),
    "--rate": ("rate", "an emulated node's link rate (tc units)", r"link rate"),
    "--seed": ("seed", "a random seed", r"seed"),
    "--slurm": ("slurm", "an sbatch option KEY=VAL, repeatable", r"sbatch option"),
    "--time": ("time", "a Slurm time limit in minutes", r"time limit"),
    "--timeout": ("timeout", "a time limit in seconds", r"second|timeout"),
    "--world": (
        "world",
        "the world size (ranks), a comma list where a command sweeps",
        r"world size",
    ),
}


def _user_actions() -> list[tuple[str, str, argparse.Action]]:
    """(command, flag, action) for every flag of every user command (all but the lab group)."""
    from scaleout.cli import LAB

    def walk(parser: argparse.ArgumentParser, command: str):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    if f"{command} {name}".strip() != LAB:
                        yield from walk(sub, f"{command} {name}".strip())
            elif not isinstance(action, argparse._HelpAction):
                yield from ((command, flag, action) for flag in action.option_strings)

    return list(walk(build_parser(), ""))


def test_the_user_cli_stays_small() -> None:
    """The user's CLI (every command but `scaleout bench`) has at most USER_FLAG_BUDGET flags,
    counted as the snapshot counts them (a torchrun alias such as --nproc_per_node is one more)."""
    from scaleout.cli import LAB

    user = {c: f for c, f in surface().items() if c.split(" ")[0] != LAB}
    assert sum(map(len, user.values())) == len(_user_actions())
    total = sum(map(len, user.values()))
    assert total <= USER_FLAG_BUDGET, (
        f"the user CLI has {total} flags, over the budget of {USER_FLAG_BUDGET}: make a setting "
        "a key=value override (scaleout/cli/_keys.py, config keys) or move a lab tool under "
        "`scaleout bench` (GROUP = 'bench')"
    )


def test_a_flag_name_has_one_meaning_across_the_user_cli() -> None:
    import re

    by_name: dict[str, list[tuple[str, argparse.Action]]] = {}
    for command, flag, action in _user_actions():
        by_name.setdefault(flag, []).append((command, action))
    shared = {f: uses for f, uses in by_name.items() if len({c for c, _ in uses}) > 1}
    unlisted = sorted(set(shared) - set(SHARED_FLAGS))
    assert not unlisted, (
        f"flags taken by several user commands without a row in SHARED_FLAGS: {unlisted} "
        f"({ {f: sorted({c for c, _ in shared[f]}) for f in unlisted} }): give each its one "
        "meaning there, or rename the flag that means something else"
    )
    assert not set(SHARED_FLAGS) - set(shared), (
        f"SHARED_FLAGS rows no longer shared: {sorted(set(SHARED_FLAGS) - set(shared))}"
    )
    wrong = []
    for flag, uses in shared.items():
        dest, meaning, pattern = SHARED_FLAGS[flag]
        for command, action in uses:
            if action.dest != dest or not re.search(pattern, action.help or "", re.I):
                wrong.append(f"'scaleout {command} {flag}' (dest {action.dest}, help "
                             f"{action.help!r}) is not {flag}: {meaning}")  # fmt: skip
    assert not wrong, "; ".join(wrong)


def test_the_one_meaning_check_sees_a_second_meaning() -> None:
    """Not vacuous: `--cluster` as it was (a netns cluster's name in launch, an executor in submit,
    a hardware preset in simulate) fails the rows' patterns."""
    import re

    helps = {
        "launch": "run in the existing emulated cluster NAME",
        "submit": "auto: Slurm if sbatch is on PATH, else submitit's local executor",
        "simulate scale": "cluster preset (default dgx-a100)",
    }
    pattern = SHARED_FLAGS["--preset"][2]
    assert [c for c, h in helps.items() if not re.search(pattern, h, re.I)] == ["launch", "submit"]


def test_the_lab_group_is_listed_apart() -> None:
    """`scaleout --help` lists the user's verbs as its commands and the lab group in its own
    section after them; every benchmark and lab tool sits under `scaleout bench`."""
    from scaleout.cli import LAB

    text = build_parser().format_help()
    commands, _, lab = text.partition("\nlab ")
    assert f"\n    {LAB} " not in commands and f"\n  {LAB} " in lab
    assert "\n    train " in commands and "\n    simulate " in commands
    assert {"cluster", "ttt", "allreduce"} <= {c.split(" ")[1] for c in surface() if " " in c
                                              and c.split(" ")[0] == LAB}  # fmt: skip


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
