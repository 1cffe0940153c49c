"""The layering README "Architecture" draws, checked on the source: imports point down, and no
cycle.

Library (runs in every rank): env, comm, parallel, optim, data, models, train and the top-level
modules. Driver side: cli, bench, sweep, sim. Launchers start ranks and never import the CLI; only
the CLI uses both. An import inside a function counts as much as one at the top: it is still a
dependency. Imports under ``if TYPE_CHECKING:`` do not: they never run.
"""

from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DRIVER = {"cli", "bench", "sweep", "sim"}
# The one rank-side use of the driver side: comm.algorithm=auto (scaleout/parallel/autotune.py) fits
# and prices its candidates with the simulator's model in every rank (sim.calibrate, sim.cluster,
# sim.step: numpy and scipy, no torch, nothing of cli, bench or sweep), deferred until auto is on.
ALLOWED = {("parallel", "sim")}


def _units() -> dict[str, list[Path]]:
    """Top-level unit (``train``, ``report``, ``launchers``, ...) -> its source files."""
    out: dict[str, list[Path]] = {}
    for f in sorted((ROOT / "scaleout").rglob("*.py")):
        rel = f.relative_to(ROOT / "scaleout").parts
        if rel[0] == "launchers":  # the symlink to ../launchers: counted once, as launchers
            continue
        if rel == ("__main__.py",):  # `python -m scaleout` is the CLI
            unit = "cli"
        else:
            unit = "scaleout" if rel == ("__init__.py",) else rel[0].removesuffix(".py")
        out.setdefault(unit, []).append(f)
    out["launchers"] = sorted((ROOT / "launchers").rglob("*.py"))
    return out


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file, in functions too; not the type-only
    ones under ``if TYPE_CHECKING:`` (never executed: ``World`` is a type every layer names)."""
    tree = ast.parse(path.read_text())
    type_only = {
        id(n)
        for top in tree.body
        if isinstance(top, ast.If) and ast.unparse(top.test) == "TYPE_CHECKING"
        for n in ast.walk(top)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, node.module)] + [
                (node.lineno, f"{node.module}.{a.name}") for a in node.names
            ]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return found


def _target(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "launchers":
        return "launchers"
    if parts[0] != "scaleout":
        return None
    return (
        "launchers" if parts[1:2] == ["launchers"] else (parts[1] if len(parts) > 1 else "scaleout")
    )


@functools.cache
def _graph() -> dict[str, dict[str, list[str]]]:
    """unit -> {imported unit: ["file:line", ...]} (read once per session)."""
    graph: dict[str, dict[str, list[str]]] = {}
    for unit, files in _units().items():
        edges = graph.setdefault(unit, {})
        for f in files:
            for line, mod in _imports(f):
                t = _target(mod)
                if (
                    t and t != unit and t != "scaleout"
                ):  # `import scaleout` (the lazy face) is not an edge
                    edges.setdefault(t, []).append(f"{f.relative_to(ROOT)}:{line}")
    return graph


def test_rank_side_never_imports_the_driver_side() -> None:
    graph = _graph()
    offenders = {
        f"{u} -> {t}": where
        for u, edges in graph.items()
        if u not in DRIVER | {"launchers"}
        for t, where in edges.items()
        if t in DRIVER and (u, t) not in ALLOWED
    }
    assert not offenders, offenders
    # what the exception may reach: the simulator, never the CLI side through it
    assert not {t for t in graph.get("sim", {}) if t in DRIVER - {"sim"}}, graph["sim"]


def test_launchers_never_import_the_cli() -> None:
    assert "cli" not in _graph()["launchers"], _graph()["launchers"]["cli"]


def test_no_import_cycle_between_units() -> None:
    graph = {u: set(edges) for u, edges in _graph().items()}
    cycles = []

    def visit(u: str, path: list[str]) -> None:
        for t in sorted(graph.get(u, ())):
            if t in path:
                cycles.append(" -> ".join(path[path.index(t) :] + [t]))
            elif t not in done:
                visit(t, path + [t])
        done.add(u)

    done: set[str] = set()
    for u in sorted(graph):
        if u not in done:
            visit(u, [u])
    assert not cycles, sorted(set(cycles))


def test_the_checks_see_a_real_upward_import(tmp_path: Path) -> None:
    """The scan is not vacuous: it finds a function-local import of the CLI and knows where it
    is."""
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from scaleout.cli import main\n")
    assert [_target(m) for _, m in _imports(f)] == ["cli", "cli"]
    assert _graph()["cli"]["launchers"]  # the one place that uses both does import launchers


def _readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"## {title}\n")
    return text[start : text.index("\n## ", start + 1)]


def test_readme_contents_lists_every_guide() -> None:
    contents = _readme_section("Contents")
    missing = [
        p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"docs/{p.name}" not in contents
    ]
    assert not missing, f"README Contents does not list {missing}"


def test_readme_architecture_names_what_exists() -> None:
    """Every package of scaleout/ and every launcher module is in the block; every name in it
    exists."""
    block = _readme_section("Architecture")
    packages = [
        p.name
        for p in sorted((ROOT / "scaleout").iterdir())
        if (p / "__init__.py").is_file() and p.name not in ("launchers", "configs")
    ]
    launchers = [p.stem for p in sorted((ROOT / "launchers").glob("*.py")) if p.stem != "__init__"]
    missing = [f"scaleout/{n}/" for n in packages if f"{n}/" not in block] + [
        n for n in launchers if n not in block
    ]
    assert not missing, f"README Architecture does not mention {missing}"
    named = set(__import__("re").findall(r"\b([a-z_]+)/ ", block))
    stale = sorted(
        n
        for n in named - {"scaleout", "launchers", "configs", "slurm", "tests"}
        if not (ROOT / "scaleout" / n).is_dir()
    )
    assert not stale, f"README Architecture names folders that do not exist: {stale}"


# Function-level imports: the one rule (README "Architecture" says it too).
DEFERRING_PACKAGES = ("cli", "bench")
HEAVY = frozenset(
    {
        "torch",  # only where the module does not import torch at its top (a torch-free module)
        "numpy",
        "scipy",
        "matplotlib",
        "PIL",
        "h5py",
        "mpi4py",
        "submitit",
        "transformers",
        "mlperf_logging",
        "tensorboard",
        "wandb",
        "torch_optimizer",
        "horovod",
    }
)


def _function_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, source lines) of every import inside a function body."""
    src = path.read_text()
    lines = src.splitlines()
    found = []

    def walk(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                walk(child, True)
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                if in_function:
                    if isinstance(child, ast.ImportFrom):
                        module = "." if child.level else child.module or ""
                    else:
                        module = child.names[0].name
                    text = "\n".join(lines[child.lineno - 1 : child.end_lineno])
                    found.append((child.lineno, module, text))
            else:
                walk(child, in_function)

    walk(ast.parse(src), False)
    return found


def _imported_at_top(path: Path) -> set[str]:
    """Modules the file imports in its module body (not in functions), with their top-level
    packages."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out | {m.split(".")[0] for m in out}


def _import_violations(path: Path) -> list[str]:
    rel = path.relative_to(ROOT)
    in_driver_cli = rel.parts[:1] == ("scaleout",) and rel.parts[1:2] in (
        (p,) for p in DEFERRING_PACKAGES
    )
    at_top = _imported_at_top(path)
    bad = []
    for line, module, text in _function_imports(path):
        top = module.split(".")[0]
        # the same module, or a third-party package, already imported at the top: nothing deferred
        already = module in at_top or (top not in ("scaleout", "launchers") and top in at_top)
        if "# deferred:" in text:
            continue
        if top in HEAVY and not already:
            continue
        if in_driver_cli and top not in sys.stdlib_module_names and not already:
            continue
        bad.append(f"{rel}:{line}: {text.strip().splitlines()[0]}")
    return bad


def _library_and_launcher_files() -> list[Path]:
    return [f for files in _units().values() for f in files]


def test_imports_inside_functions_only_where_deferred_on_purpose() -> None:
    """An import sits at the module top unless it is deferred on purpose, which is one of:

    (a) in ``scaleout/cli/`` and ``scaleout/bench/``: the CLI imports every subcommand module to
        build its parser, so these modules import the library (and torch) only when the command
        runs, keeping ``scaleout --help`` fast and torch-free;
    (b) a heavy or optional third-party package (``HEAVY``: torch where the module is torch-free
        at its top, numpy, scipy, matplotlib, submitit, mpi4py, ...);
    (c) any other import marked ``# deferred: <why>`` on its line (an import cycle, a torch-free
        module that must not pull in torch through an internal import, a large stdlib module).

    A standard-library import is never deferred without a mark, nor is a package the module
    already imports at its top.
    """
    offenders = [v for f in _library_and_launcher_files() for v in _import_violations(f)]
    assert not offenders, "\n".join(offenders)


def test_the_import_rule_sees_an_undeferred_import(tmp_path: Path) -> None:
    """The rule is not vacuous: a stdlib import in a function is flagged, a marked one is not, and
    torch is heavy only in a module that does not import torch at its top."""
    f = ROOT / "scaleout" / "_probe_import_rule.py"  # under scaleout/: rule (a) must not apply
    f.write_text(
        "import torch\n\n\ndef f():\n    import json\n    import os  # deferred: test\n"
        "    import torch.distributed\n    import scipy\n"
    )
    try:
        bad = _import_violations(f)
    finally:
        f.unlink()
    assert [b.split(": ", 1)[1] for b in bad] == ["import json", "import torch.distributed"]


def test_cli_parser_is_torch_free() -> None:
    """Building the whole ``scaleout`` parser (every subcommand module) imports no torch: the
    reason rule (a) of the import rule exists."""
    code = (
        "import sys, scaleout.cli as c; c.build_parser(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout[:500]
