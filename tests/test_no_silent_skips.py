"""The test suite skips only for what a machine may lack (root, a GPU, Slurm, MPI, a kernel
feature), never for something the project itself promises: a package its ``test`` extra installs, or
a scaleout command.

A skip of that kind turns a broken install, or a renamed command, into a quiet "s" in the summary
where a failure belonged (a `"train" not in commands` skip once guarded the main Slurm test;
`importorskip` of h5py / transformers guarded tests whose packages the test extra installs).
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
TESTS = sorted((ROOT / "tests").rglob("*.py"))


def _test_extra_modules() -> set[str]:
    """Top-level import names of every distribution in pyproject's ``test`` extra."""
    # read as text: tomllib is Python >= 3.11 and scaleout supports 3.10
    block = re.search(r"^test = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.S | re.M)
    assert block, "pyproject.toml has no test extra"
    extra = re.findall(r'^\s*"([^"]+)"', block.group(1), re.M)
    dists = {
        re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower().replace("_", "-") for req in extra
    }
    modules = {
        d.replace("-", "_") for d in dists
    }  # the usual spelling, also when not installed here
    for module, owners in importlib.metadata.packages_distributions().items():
        if {o.lower().replace("_", "-") for o in owners} & dists:
            modules.add(module)
    return modules


def _probes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every availability probe: importorskip("m"), find_spec("m"), and an
    import inside a ``try`` whose handler catches ImportError / ModuleNotFoundError."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = (
                node.func.attr
                if isinstance(node.func, ast.Attribute)
                else getattr(node.func, "id", "")
            )
            if name in ("importorskip", "find_spec") and isinstance(node.args[0].value, str):
                out.append((node.lineno, node.args[0].value))
        if isinstance(node, ast.Try):
            caught = {ast.unparse(h.type) for h in node.handlers if h.type is not None}
            if caught & {"ImportError", "ModuleNotFoundError"}:
                for stmt in node.body:
                    if isinstance(stmt, ast.Import):
                        out += [(stmt.lineno, a.name) for a in stmt.names]
                    elif isinstance(stmt, ast.ImportFrom) and stmt.module:
                        out.append((stmt.lineno, stmt.module))
    return out


def test_no_test_probes_for_a_package_the_test_extra_installs() -> None:
    extra = _test_extra_modules()
    assert {"h5py", "transformers", "PIL", "matplotlib", "tensorboard"} <= extra, (
        extra
    )  # the mapping works
    found = [
        f"{f.relative_to(ROOT)}:{line}: {mod}"
        for f in TESTS
        for line, mod in _probes(ast.parse(f.read_text()))
        if mod.split(".")[0] in extra
    ]
    assert not found, (
        "import these directly (a missing package is a failure, not a skip):\n" + "\n".join(found)
    )


def _skip_conditions(tree: ast.AST) -> list[ast.AST]:
    """The conditions of ``skipif(...)`` marks and of ``if ...: pytest.skip(...)``."""
    out: list[ast.AST] = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "skipif"
        ):
            out += node.args[:1] + [k.value for k in node.keywords if k.arg == "condition"]
        if isinstance(node, ast.If) and any(
            isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "skip"
            for stmt in node.body
            for n in ast.walk(stmt)
        ):
            out.append(node.test)
    return out


def test_no_skip_depends_on_scaleouts_own_commands() -> None:
    found = []
    for f in TESTS:
        for cond in _skip_conditions(ast.parse(f.read_text())):
            text = ast.unparse(cond)
            if "_commands" in text or "scaleout.cli" in text:
                found.append(f"{f.relative_to(ROOT)}:{cond.lineno}: {text}")
    assert not found, (
        "a scaleout command is part of the product: test it, never skip on it:\n" + "\n".join(found)
    )


def test_the_checks_above_can_fail() -> None:
    """Both scanners find what they look for (on the forms the suite used to have)."""
    old = ast.parse(
        'h5py = pytest.importorskip("h5py")\n'
        'HAS_TB = importlib.util.find_spec("tensorboard") is not None\n'
        "try:\n    import transformers\nexcept ImportError:\n    transformers = None\n"
        '@pytest.mark.skipif("train" not in {m.NAME for m in _commands()}, reason="")\ndef '
        "test_x(): pass\n"
        "def test_y():\n    if 'train' not in names(_commands()):\n        pytest.skip('no "
        "train')\n"
    )
    assert sorted(m for _, m in _probes(old)) == ["h5py", "tensorboard", "transformers"]
    assert len([c for c in _skip_conditions(old) if "_commands" in ast.unparse(c)]) == 2
