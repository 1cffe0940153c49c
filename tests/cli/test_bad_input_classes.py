"""Bad input by class (docs/bad-input.md "Classes"): each class is one parametrised test that builds
its cases, so that a new case of a known class is covered without a new row.

Every case runs the real CLI and must end in one line on stderr naming the value, exit 2, no
traceback, nothing written, in bounded time. The numeric-flag class runs ``scaleout.cli.main`` in
this process (the same entry point as the ``scaleout`` script; ~90 cases would cost minutes as
subprocesses); the others run ``python -m scaleout`` as a subprocess. The launcher's classes are in
tests/cli/test_bad_input_launch.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tests.cli.badinput_util import ROOT, assert_one_line, run_cli, snapshot

# ---------------------------------------------------------------- class: config files as text


def _alias_bomb(depth: int, width: int = 9, key: str = "model:\n  bert:\n    hidden") -> str:
    rows = ["x:", f"  a0: &a0 [{','.join(['lol'] * width)}]"]
    for i in range(1, depth):
        rows.append(f"  a{i}: &a{i} [{','.join([f'*a{i - 1}'] * width)}]")
    return "\n".join(rows) + f"\n{key}: *a{depth - 1}\n"


def _config_file_cases() -> list[tuple[str, bytes, str]]:
    """(id, file content, what the line must say) of config files that are not a config."""
    good = "train:\n  max_steps: 3\n"
    cases: list[tuple[str, bytes, str]] = []
    # not UTF-8: a Latin-1 byte in a value, in a comment, a UTF-16 file, binary bytes
    cases += [
        ("latin1-value", "train:\n  output_dir: caf\xe9\n".encode("latin-1"), "0xe9"),
        ("latin1-comment", "# r\xe9sum\xe9\n".encode("latin-1") + good.encode(), "not UTF-8"),
        ("utf16", good.encode("utf-16"), "not UTF-8"),
        ("binary", bytes(range(128, 256)) * 4, "not UTF-8"),
    ]
    # aliases that expand without limit: deep, wide, under a section or a key
    cases += [
        ("bomb-9x9", _alias_bomb(9).encode(), "expands"),
        ("bomb-6x20", _alias_bomb(6, 20).encode(), "expands"),
        ("bomb-section", _alias_bomb(8, key="optim").encode(), "expands"),
    ]
    # duplicate keys: a section, a key, a flow mapping, a key repeated far apart
    cases += [
        ("dup-section", b"train:\n  seed: 1\ntrain:\n  seed: 2\n", "duplicate key 'train'"),
        ("dup-key", b"train:\n  seed: 1\n  seed: 2\n", "duplicate key 'seed'"),
        ("dup-flow", b"optim: {lr: 0.1, lr: 0.2}\n", "duplicate key 'lr'"),
        (
            "dup-far",
            b"optim:\n  lr: 0.1\n" + b"  # filler\n" * 50 + b"  lr: 0.2\n",
            "duplicate key 'lr'",
        ),
    ]
    # empty: nothing, blanks, comments only, an empty document, an explicit null
    for name, text in [
        ("empty", b""),
        ("blank", b"\n\n   \n"),
        ("comments", b"# a config\n# with nothing\n"),
        ("doc-start", b"---\n"),
        ("null", b"null\n"),
        ("tilde", b"~\n"),
    ]:
        cases.append((name, text, "empty"))
    return cases


CONFIG_FILES = _config_file_cases()


@pytest.mark.full_system
@pytest.mark.parametrize(
    "content,said", [c[1:] for c in CONFIG_FILES], ids=[c[0] for c in CONFIG_FILES]
)
def test_config_file_text_is_checked_where_read(tmp_path: Path, content: bytes, said: str) -> None:
    """A config file is UTF-8, each key once, bounded when aliases expand, and not empty (an empty
    file used to mean BERT-large on synthetic data, silently)."""
    (tmp_path / "c.yaml").write_bytes(content)
    before = snapshot(tmp_path)
    r, took = run_cli(["config", "show", "c.yaml"], tmp_path)
    line = assert_one_line(r, "c.yaml", said)
    assert line.startswith("scaleout config: error: ")
    assert took < 30, f"{took:.1f} s"
    assert snapshot(tmp_path) == before


@pytest.mark.full_system
def test_a_small_alias_bomb_value_is_echoed_as_an_excerpt(tmp_path: Path) -> None:
    """Under the node budget, a bad value built of aliases is named by a bounded excerpt."""
    (tmp_path / "c.yaml").write_text(_alias_bomb(4))
    r, _ = run_cli(["config", "show", "c.yaml"], tmp_path)
    assert_one_line(r, "c.yaml")


# ---------------------------------------------------------------- class: numeric flags


def _numeric_flags() -> list[tuple[tuple[str, ...], str]]:
    """(command path, flag) of every option of simulate, plan and data pack that takes one number:
    found from the parsers, so a new numeric flag is a new case."""
    from scaleout.cli import build_parser

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, (*path, name))
            elif action.option_strings and (
                action.type in (int, float) or hasattr(action.type, "bounds")
            ):
                yield path, action.option_strings[0]

    wanted = {("simulate",), ("plan",), ("data", "pack")}
    found = [
        (path, flag)
        for path, flag in walk(build_parser(), ())
        if any(path[: len(w)] == w for w in wanted) and flag != "--max-len"
    ]
    assert len(found) >= 10, found
    return found


# Flags that take a comma list of numbers: each entry is bounded the same way.
LIST_FLAGS = [
    (("plan",), "--per-gpu-batch"),
    (("plan",), "--nproc-per-node"),
    (("plan",), "--nnodes"),
    (("simulate", "allreduce"), "--sizes-mb"),
    (("simulate", "convergence"), "--batches"),
]
_POSITIONAL = {("plan",): ["configs/bert_tiny_cpu.yaml"], ("simulate", "calibrate"): ["x.json"]}
_NO_OUT = {("plan",), ("simulate", "convergence"), ("simulate", "allreduce")}
NUMERIC = [
    (path, flag, bad)
    for path, flag in _numeric_flags() + LIST_FLAGS
    for bad in ("nan", "inf", "-inf", "-1")
]


@pytest.mark.unit
@pytest.mark.parametrize(
    "path,flag,bad", NUMERIC, ids=[f"{' '.join(p)} {f}={b}" for p, f, b in NUMERIC]
)
def test_numeric_flags_are_finite_and_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, path, flag, bad
) -> None:
    """NaN, inf and negative numbers for the flags of simulate, plan and data pack: one line that
    names the flag and the value (they used to be tracebacks, or tables with negative step times
    and 316 % efficiency)."""
    from scaleout.cli import main

    monkeypatch.chdir(ROOT)
    argv = [*path, *_POSITIONAL.get(path, [])]
    if path == ("data", "pack"):
        (tmp_path / "h.txt").write_text("10 3\n20 5\n")
        argv.append(str(tmp_path / "h.txt"))
    argv += [f"{flag}={bad}"]
    if path not in _NO_OUT:
        argv += ["--out", str(tmp_path / "o.json")]
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's usage error
        rc = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, (argv, rc, err[-5:])
    assert len(err) == 1, err[-5:]
    assert flag in err[0] and bad in err[0], err[0]
    assert not (tmp_path / "o.json").exists()


# ---------------------------------------------------------------- class: long values are excerpts

_LONG = "9" * 100_000  # one argv string may hold 128 KiB (Linux MAX_ARG_STRLEN)
LONG_VALUES = [
    ("float-key", ["config", "show", "bert_tiny_cpu", f"optim.lr={_LONG}x"]),
    ("choice-key", ["config", "show", "bert_tiny_cpu", f"comm.algorithm=a{_LONG}"]),
    ("unknown-key", ["config", "show", "bert_tiny_cpu", f"optim.k{_LONG}=1"]),
    ("not-an-override", ["config", "show", "bert_tiny_cpu", f"x{_LONG}"]),
    ("flag", ["data", "pack", "h.txt", "--packing", f"a{_LONG}", "--out", ""]),
    ("master-addr", ["launch", "--master-addr", f"h{_LONG}", "--", "true"]),
]


@pytest.mark.full_system
@pytest.mark.parametrize("argv", [c[1] for c in LONG_VALUES], ids=[c[0] for c in LONG_VALUES])
def test_a_long_value_is_echoed_as_an_excerpt(tmp_path: Path, argv: list[str]) -> None:
    """A 100,000-character value: the one line names it by an excerpt and its length."""
    (tmp_path / "h.txt").write_text("10 3\n")
    r, _ = run_cli(argv, tmp_path)
    assert_one_line(r)
