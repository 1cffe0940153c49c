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
from collections.abc import Iterable
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DRIVER = {"cli", "bench", "sweep", "sim"}
# The one rank-side use of the driver side: comm.algorithm=auto (scaleout/parallel/autotune.py) fits
# and prices its candidates with the simulator's model in every rank (sim.calibrate, sim.cluster,
# sim.step: numpy and scipy, no torch, nothing of cli, bench or sweep), deferred until auto is on.
# The other: an algorithm's cost model (comm's Algorithm.cost / half_cost) is written in the
# simulator's algebra (scaleout.sim.cost: numpy, no torch), imported only when something prices it,
# as a new algorithm's does (tests/comm/test_extend_comm.py). Module by module neither closes a
# circle
# (test_no_import_cycle_between_modules); unit by unit they are the one pair left out.
ALLOWED = {("parallel", "sim"), ("comm", "sim")}


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
    graph = {u: set(edges) - {t for f, t in ALLOWED if f == u} for u, edges in _graph().items()}
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
        "safetensors",
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


# Module granularity: the same scan, one node per file (a package's __init__ is the package).
def _module_name(path: Path) -> str:
    if path.is_relative_to(ROOT / "launchers"):
        parts = ["scaleout", "launchers", *path.relative_to(ROOT / "launchers").parts]
    else:
        parts = ["scaleout", *path.relative_to(ROOT / "scaleout").parts]
    parts[-1] = parts[-1].removesuffix(".py")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _module_imports(path: Path, me: str, modules: set[str]) -> dict[str, int]:
    """Modules of ours that importing ``path`` executes -> first line: ``from a.b import c``
    runs ``a.b`` (and ``a.b.c`` when that is a module), and every package above them, except the
    packages that hold ``me`` (Python ran those before it). Relative imports resolved; deferred
    ones count; ``if TYPE_CHECKING:`` ones do not."""
    tree = ast.parse(path.read_text())
    type_only = {
        id(n)
        for top in ast.walk(tree)
        if isinstance(top, ast.If)
        and ast.unparse(top.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for n in ast.walk(top)
    }
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    mine = {".".join(me.split(".")[:i]) for i in range(1, me.count(".") + 1)}

    def norm(mod: str) -> str:
        # the launchers/ folder is importable both as launchers and as scaleout.launchers
        return "scaleout." + mod if mod.split(".")[0] == "launchers" else mod

    out: dict[str, int] = {}

    def add(mod: str, line: int, explicit: bool) -> None:
        mod = norm(mod)
        parts = mod.split(".")
        for i in range(1, len(parts) + 1):
            m = ".".join(parts[:i])
            if m in modules and m != me and (m not in mine or (explicit and i == len(parts))):
                out.setdefault(m, line)

    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name, node.lineno, True)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from <my own package> import <submodule>` needs nothing of the package's __init__
            # (Python is running it already): an edge to the submodule only
            subs = {a.name for a in node.names if norm(f"{mod}.{a.name}") in modules}
            if norm(mod) not in mine or len(subs) < len(node.names):
                add(mod, node.lineno, True)
            for a in node.names:
                if norm(f"{mod}.{a.name}") in modules:
                    add(f"{mod}.{a.name}", node.lineno, True)
    return out


@functools.cache
def _module_graph() -> dict[str, dict[str, str]]:
    """module -> {imported module: "file:line"}."""
    files = {_module_name(f): f for f in _library_and_launcher_files()}
    graph = {}
    for name, f in files.items():
        graph[name] = {
            t: f"{f.relative_to(ROOT)}:{line}"
            for t, line in _module_imports(f, name, set(files)).items()
        }
    return graph


def _cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_no_import_cycle_between_modules() -> None:
    """No two modules of scaleout/ and launchers/ import each other, directly or round a circle,
    counting imports inside functions (``if TYPE_CHECKING:`` ones excepted: they never run). A
    package's ``__init__`` is a module; importing ``a.b.c`` also runs ``a`` and ``a.b``. A
    package's own submodules do not depend on its ``__init__`` merely by being inside it (Python
    runs it first anyway), only by importing a name it defines: so an ``__init__`` may import its
    implementations to register them, or re-export, as long as they take what they need from a
    sibling (``families/base.py``, ``comm/algorithm.py``), not from the ``__init__``."""
    graph = _module_graph()
    bad = []
    for comp in _cycles(graph):
        edges = [f"{a} -> {b} ({graph[a][b]})" for a in comp for b in graph[a] if b in comp]
        bad.append("cycle: " + ", ".join(comp) + "\n    " + "\n    ".join(edges))
    assert not bad, "\n".join(bad)


def test_the_module_scan_sees_a_deferred_cycle(tmp_path: Path) -> None:
    """The scan is not vacuous: a deferred import and a name taken from the own package's
    ``__init__`` are edges, a submodule of the own package and a type-only import are not."""
    f = tmp_path / "x.py"
    f.write_text(
        "from typing import TYPE_CHECKING\n"
        "from scaleout.pkg import helper, sub\n"
        "if TYPE_CHECKING:\n    from scaleout.other import T\n"
        "def f():\n    from .sub import g\n"
    )
    modules = {"scaleout", "scaleout.pkg", "scaleout.pkg.sub", "scaleout.pkg.x", "scaleout.other"}
    found = _module_imports(f, "scaleout.pkg.x", modules)
    assert set(found) == {"scaleout.pkg", "scaleout.pkg.sub"}
    f.write_text("from scaleout.pkg import sub\n")  # only a sibling: no edge to the __init__
    assert set(_module_imports(f, "scaleout.pkg.x", modules)) == {"scaleout.pkg.sub"}
    assert _cycles({"a": {"b": ""}, "b": {"c": ""}, "c": {"a": ""}, "d": {"a": ""}}) == [
        ["a", "b", "c"]
    ]


# Who may import a family's own modules (scaleout.families.<name>...) from outside its folder, and
# why: the registry that loads the built-ins, and commands and benchmarks that are that family's
# own (they act on its data formats or measure its kernels: there is nothing generic to ask).
FAMILY_ENTRIES = {
    "scaleout/families/__init__.py": "registers the built-in families (torch-free declarations)",
    # the family's own commands: each acts on that family's data format or checkpoint format
    "scaleout/cli/data.py": "`scaleout data`: ImageNet / Fashion-MNIST preparation, BERT shards",
    "scaleout/cli/pack.py": "`scaleout pack`: BERT's sequence packing of a length histogram",
    "scaleout/cli/config.py": "`scaleout config rcp`: ResNet's MLPerf reference-point configs",
    "scaleout/cli/ckpt.py": "`scaleout ckpt --format hf`: BERT's Hugging Face converter",
    # benchmarks of one family's own kernels and input paths (bench/ is the lab, review sec. 5.9)
    "scaleout/bench/_gpuchecks.py": "BERT / ResNet kernels and GPU decode against references",
    "scaleout/bench/_deep_parts.py": "the one-GPU deep check: JPEG race, group BN, BERT-large step",
    "scaleout/bench/compile.py": "torch.compile of the BERT model on packed batches",
    "scaleout/bench/data.py": "ResNet's JPEG decode and DALI input paths",
    "scaleout/bench/mlmhead.py": "BERT's unpadded MLM head",
    "scaleout/bench/packing.py": "BERT's packing algorithms and packed batches",
    "scaleout/bench/shards.py": "BERT's shard format and its reader",
    # the plain-PyTorch DDP baselines the ttt benchmark races: same model and data, no scaleout
    "scaleout/bench/_ttt_baseline.py": "the DDP baseline trains the same BERT on the same data",
    "scaleout/bench/_ttt_baseline_resnet.py": "the DDP baseline trains the same ResNet",
    "scaleout/bench/_ttt_baseline_llama.py": "the DDP baseline trains the same Llama",
}


def _family_reaches(entries: Iterable[str] = FAMILY_ENTRIES) -> dict[str, list[str]]:
    families = [
        p.name for p in (ROOT / "scaleout" / "families").iterdir() if (p / "__init__.py").is_file()
    ]
    out: dict[str, list[str]] = {}
    for f in _library_and_launcher_files():
        rel = str(f.relative_to(ROOT))
        if rel in entries:
            continue
        for line, mod in _imports(f):
            parts = mod.split(".")
            if parts[:2] == ["scaleout", "families"] and len(parts) > 2 and parts[2] in families:
                if not rel.startswith(f"scaleout/families/{parts[2]}/"):
                    out.setdefault(rel, []).append(f"{line}: {mod}")
    return out


def test_no_reach_into_a_family_from_outside() -> None:
    """The rest of scaleout talks to a model family through its ``Family`` object
    (scaleout/families/base.py), never to the modules inside scaleout/families/<name>/."""
    reaches = _family_reaches()
    assert not reaches, "\n".join(f"{k}: {v}" for k, v in sorted(reaches.items()))
    # not vacuous, and no stale entry: every allowed file does reach into its family
    assert sorted(_family_reaches(())) == sorted(FAMILY_ENTRIES)
