"""Config tree, overrides, and the one-line errors for bad configs and CLI input (>= 15 cases)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scaleout.cli import main
from scaleout.config import load_config


def _cli_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) if argv and argv[0] == "--argparse" else _noop():
        code = main(argv[1:] if argv[0] == "--argparse" else argv)
        assert code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line, got: {err!r}"
    return lines[0]


class _noop:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _bad_yaml(tmp_path: Path, text: str) -> str:
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    return str(p)


BAD_CASES = [
    # (argv, substrings the single line must contain)
    (["config", "show", "foo.bar=1"], ["unknown key foo", "expected one of: model, data"]),
    (["config", "show", "optim.lrr=1"], ["unknown key optim.lrr", "lr"]),
    (["config", "show", "optim.lr=abc"], ["optim.lr='abc'", "valid number"]),
    (["config", "show", "optim.lr=-1"], ["optim.lr=-1", "greater than 0"]),
    (["config", "show", "comm.algorithm=ring"], ["comm.algorithm='ring'", "'flat', 'hierarchical' or 'torus2d'"]),
    (["config", "show", "optim.betas=[0.9,1.5]"], ["optim.betas[1]=1.5", "[0, 1)"]),
    (["config", "show", "optim.eps=-1e-8"], ["optim.eps", "greater than or equal to 0"]),
    (["config", "show", "model.bert.hidden=100", "model.bert.heads=3"], ["model.bert.hidden=100", "divisible"]),
    (["config", "show", "train.global_batch=0"], ["train.global_batch=0", "greater than or equal to 1"]),
    (["config", "show", "optim.lr=1", "optimlr"], ["'optimlr'", "section.key=value"]),
    (["config", "show", "comm.algorithm=torus2d", "comm.torus_x=3", "--world", "4"], ["torus grid 3x1", "world size 4"]),
    (["config", "show", "train.global_batch=30", "--world", "4"], ["train.global_batch=30", "divisible by world size 4"]),
    (["config", "show", "model.arch=resnet", "model.resnet.bn_group=3", "--world", "4"], ["bn_group=3", "world size 4"]),
    (["config", "show", "data.mask_prob=1.5"], ["data.mask_prob=1.5", "less than 1"]),
    (["config", "show", "model.resnet.depth=42"], ["model.resnet.depth=42", "18"]),
    (["config", "show", "launch.master_port=70000"], ["launch.master_port=70000", "65535"]),
    (["config", "show", "train=3"], ["train=3", "dictionary"]),
    (["config", "show", "no/such/config.yaml"], ["'no/such/config.yaml' not found"]),
    (["--argparse", "launch", "--nproc-per-node", "x"],
     ["--nproc-per-node", "'x': expected an integer >= 1 or one of auto, cpu, gpu"]),
    (["launch", "--nnodes", "0", "--", "scaleout", "smoke"], ["--nnodes=0", ">= 1"]),
    (["launch", "--nproc-per-node", "2"], ["no command given"]),
    (["--argparse", "nosuchcommand"], ["invalid choice: 'nosuchcommand'"]),
]


@pytest.mark.parametrize(("argv", "needles"), BAD_CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_input_is_one_line(capsys, argv, needles) -> None:
    line = _cli_error(capsys, argv)
    for needle in needles:
        assert needle in line, line


def test_bad_yaml_files(tmp_path: Path, capsys) -> None:
    line = _cli_error(capsys, ["config", "show", _bad_yaml(tmp_path, "model: [1, 2\n")])
    assert "not valid YAML" in line and "line" in line
    line = _cli_error(capsys, ["config", "show", _bad_yaml(tmp_path, "- a\n- b\n")])
    assert "expected a mapping of sections" in line
    line = _cli_error(capsys, ["config", "show", _bad_yaml(tmp_path, "optim:\n  lr: fast\n")])
    assert "optim.lr='fast'" in line


def test_at_least_fifteen_cases() -> None:
    assert len(BAD_CASES) + 3 >= 15


def test_overrides_and_types(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("optim:\n  name: lars\n  lr: 2.0\ncomm:\n  algorithm: hierarchical\n")
    cfg = load_config(p, ["optim.lr=3e-3", "comm.bucket_mb=50", "optim.betas=[0.8, 0.99]", "checkpoint.dir=/tmp/x"])
    assert cfg.optim.name == "lars" and cfg.optim.lr == pytest.approx(3e-3)
    assert cfg.comm.algorithm == "hierarchical" and cfg.comm.bucket_mb == 50.0
    assert cfg.optim.betas == (0.8, 0.99) and cfg.checkpoint.dir == "/tmp/x"
    cfg.check_world(4, 2)  # defaults are valid for 4 ranks


def test_config_show_prints_resolved_tree(capsys) -> None:
    assert main(["config", "show", "comm.algorithm=torus2d", "train.global_batch=64", "--world", "8",
                 "--nproc-per-node", "4"]) == 0
    out = capsys.readouterr().out
    assert "algorithm: torus2d" in out and "global_batch: 64" in out


def test_every_subcommand_has_help() -> None:
    """`scaleout --help` lists every subcommand with a purpose; each has its own --help."""
    from scaleout.cli import _commands

    top = subprocess.run([sys.executable, "-m", "scaleout", "--help"], capture_output=True, text=True, timeout=60)
    assert top.returncode == 0
    names = [m.NAME for m in _commands()]
    assert {"launch", "config", "smoke", "bench"} <= set(names)
    for mod in _commands():
        assert mod.NAME in top.stdout and mod.HELP.split()[0] in top.stdout
        with pytest.raises(SystemExit) as exc:
            main([mod.NAME, "--help"])
        assert exc.value.code == 0


def test_rank_code_never_imports_launchers() -> None:
    """Dependencies point one way: launchers -> scaleout. Only the CLI may use both."""
    root = Path(__file__).resolve().parents[1] / "scaleout"
    offenders = []
    for f in root.rglob("*.py"):
        if "cli" in f.relative_to(root).parts:
            continue
        text = f.read_text()
        if "import launchers" in text or "from launchers" in text:
            offenders.append(str(f.relative_to(root)))
    assert not offenders, offenders
