"""Config tree, overrides, and the one-line errors for bad configs and CLI input (>= 15 cases)."""

from __future__ import annotations

import re
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
    (
        ["config", "show", "comm.algorithm=ring"],
        ["comm.algorithm='ring'", "flat, hierarchical, torus2d"],
    ),
    (["config", "show", "optim.betas=[0.9,1.5]"], ["optim.betas[1]=1.5", "[0, 1)"]),
    (["config", "show", "optim.eps=-1e-8"], ["optim.eps", "greater than or equal to 0"]),
    (
        ["config", "show", "optim.warmup_steps=5", "optim.total_steps=5"],
        ["optim.total_steps=5 must be > optim.warmup_steps=5"],
    ),
    (
        ["config", "show", "model.bert.hidden=100", "model.bert.heads=3"],
        ["model.bert.hidden=100", "divisible"],
    ),
    (
        ["config", "show", "train.global_batch=0"],
        ["train.global_batch=0", "greater than or equal to 1"],
    ),
    (["config", "show", "optim.lr=1", "optimlr"], ["'optimlr'", "section.key=value"]),
    (
        ["config", "show", "comm.algorithm=torus2d", "comm.torus_x=3", "--world", "4"],
        ["comm.torus_x=3", "world size 4"],
    ),
    (
        ["config", "show", "train.global_batch=30", "--world", "4"],
        ["train.global_batch=30", "divisible by world size 4"],
    ),
    (
        ["config", "show", "model.arch=resnet", "model.resnet.bn_group=3", "--world", "4"],
        ["bn_group=3", "world size 4"],
    ),
    (["config", "show", "data.mask_prob=1.5"], ["data.mask_prob=1.5", "less than 1"]),
    (["config", "show", "model.resnet.depth=42"], ["model.resnet.depth=42", "18"]),
    (["config", "show", "launch.master_port=70000"], ["launch.master_port=70000", "65535"]),
    (["config", "show", "train=3"], ["train=3", "dictionary"]),
    (["config", "show", "no/such/config.yaml"], ["'no/such/config.yaml' not found"]),
    (
        ["--argparse", "launch", "--nproc-per-node", "x"],
        ["--nproc-per-node", "'x': expected an integer >= 1 or one of auto, cpu, gpu"],
    ),
    (["launch", "--nnodes", "0", "--", "scaleout", "smoke"], ["--nnodes=0", ">= 1"]),
    (["launch", "--nproc-per-node", "2"], ["no command given"]),
    (["--argparse", "nosuchcommand"], ["invalid choice: 'nosuchcommand'"]),
]


@pytest.mark.multi_process
@pytest.mark.parametrize(
    ("argv", "needles"), BAD_CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else None
)
def test_bad_input_is_one_line(capsys, argv, needles) -> None:
    line = _cli_error(capsys, argv)
    for needle in needles:
        assert needle in line, line


@pytest.mark.unit
def test_bad_yaml_files(tmp_path: Path, capsys) -> None:
    line = _cli_error(capsys, ["config", "show", _bad_yaml(tmp_path, "model: [1, 2\n")])
    assert "not valid YAML" in line and "line" in line
    line = _cli_error(capsys, ["config", "show", _bad_yaml(tmp_path, "- a\n- b\n")])
    assert "expected a mapping of sections" in line
    line = _cli_error(capsys, ["config", "show", _bad_yaml(tmp_path, "optim:\n  lr: fast\n")])
    assert "optim.lr='fast'" in line


@pytest.mark.unit
def test_at_least_fifteen_cases() -> None:
    assert len(BAD_CASES) + 3 >= 15


@pytest.mark.multi_process
def test_overrides_and_types(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("optim:\n  name: lars\n  lr: 2.0\ncomm:\n  algorithm: hierarchical\n")
    cfg = load_config(
        p,
        ["optim.lr=3e-3", "comm.bucket_mb=50", "optim.betas=[0.8, 0.99]", "checkpoint.dir=/tmp/x"],
    )
    assert cfg.optim.name == "lars" and cfg.optim.lr == pytest.approx(3e-3)
    assert cfg.comm.algorithm == "hierarchical" and cfg.comm.bucket_mb == 50.0
    assert cfg.optim.betas == (0.8, 0.99) and cfg.checkpoint.dir == "/tmp/x"
    cfg.check_world(4, 2)  # defaults are valid for 4 ranks


@pytest.mark.full_system
def test_config_show_prints_resolved_tree(capsys) -> None:
    assert (
        main(
            [
                "config",
                "show",
                "comm.algorithm=torus2d",
                "train.global_batch=64",
                "--world",
                "8",
                "--nproc-per-node",
                "4",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "algorithm: torus2d" in out and "global_batch: 64" in out


@pytest.mark.full_system
def test_every_subcommand_has_help() -> None:
    """`scaleout --help` lists every subcommand with a purpose; each has its own --help."""
    from scaleout.cli import subcommands

    top = subprocess.run(
        [sys.executable, "-m", "scaleout", "--help"], capture_output=True, text=True, timeout=60
    )
    assert top.returncode == 0
    names = [m.NAME for m in subcommands()]
    assert {"launch", "config", "smoke", "bench"} <= set(names)
    for mod in subcommands():
        assert mod.NAME in top.stdout and mod.HELP.split()[0] in top.stdout
        with pytest.raises(SystemExit) as exc:
            main([mod.NAME, "--help"])
        assert exc.value.code == 0


@pytest.mark.unit
def test_rank_code_never_imports_launchers() -> None:
    """Dependencies point one way: launchers -> scaleout. Only the driver side (the CLI, bench
    ttt's runs, the sweep) may use both."""
    root = Path(__file__).resolve().parents[2] / "scaleout"
    offenders = []
    for f in root.rglob("*.py"):
        # launchers: the folder itself (a symlink)
        if {"cli", "bench", "sweep", "sim", "launchers"} & set(f.relative_to(root).parts):
            continue
        text = f.read_text()
        if re.search(r"^\s*(from|import)\s+(scaleout\.)?launchers\b", text, re.MULTILINE):
            offenders.append(str(f.relative_to(root)))
    assert not offenders, offenders


def _schema_keys(model: type, section: str = "", prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, its section's field name, field name) of every field of the config tree, the
    family sections (model.<arch>, composed when a config is validated) included."""
    from pydantic import BaseModel

    from scaleout.config.schema import ModelConfig
    from scaleout.section import FAMILIES

    fields = {name: field.annotation for name, field in model.model_fields.items()}
    if model is ModelConfig:
        fields |= {name: fam.config for name, fam in FAMILIES.items() if fam.config is not None}
    out = []
    for name, ann in fields.items():
        out.append((f"{prefix}{name}", section, name))
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _schema_keys(ann, name, f"{prefix}{name}.")
    return out


def _each(sec: str | frozenset[str] | None) -> frozenset[str]:
    """A section binding as a set: one name, several (a parameter several call sites fill), none."""
    if not sec:
        return frozenset()
    return frozenset([sec]) if isinstance(sec, str) else sec


class _ConfigReads:
    """Which config fields the code reads, per section: ``x.<section>.<key>``, ``alias.<key>``
    where the alias was bound to a section (``d = cfg.data``, ``t, o = cfg.train, cfg.optim``,
    ``getattr(cfg, "launch")``, ``b.model_copy(...)``) or is a parameter a call site passes a
    section to (``build_optimizer(model, cfg.optim)``, ``BertForPreTraining(b)``), and
    ``getattr(<section>, "key")``. A same-named attribute of something else (``self.chunks``,
    ``world.master_port``) does not count."""

    def __init__(self, sections: set[str], trees: list) -> None:
        import ast

        self.ast, self.sections = ast, sections
        # (callee name, arg position / keyword) -> the sections call sites pass there (several
        # callees share a name, e.g. from_config: a parameter may stand for more than one section)
        self.params: dict[tuple[str, int | str], frozenset[str]] = {}
        self.reads: set[tuple[str, str]] = set()
        self.members: dict[str, str] = {}  # "Class.attr" -> section, from ``self.attr = <section>``
        # sections flow through calls into parameters (a model's config through its layers'
        # constructors): iterate to a fixed point
        for _ in range(12):
            before = (dict(self.params), set(self.reads), dict(self.members))
            for tree in trees:
                self._scope(tree, {}, None)
            if before == (self.params, self.reads, self.members):
                break

    def _section(self, node, aliases: dict[str, str]) -> str | None:
        ast = self.ast
        if isinstance(node, ast.Attribute) and node.attr in self.sections:
            return node.attr
        if isinstance(node, ast.Name):
            return aliases.get(node.id)
        if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "self":
            return self.members.get(f"{aliases.get('.class')}.{node.attr}")
        if isinstance(node, ast.Call):
            fn = node.func
            if isinstance(fn, ast.Attribute) and fn.attr == "model_copy":
                return self._section(fn.value, aliases)
            if (
                getattr(fn, "id", None) == "getattr"
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in self.sections
            ):
                return node.args[1].value
        return None

    def _scope(self, scope, inherited: dict[str, str], cls: str | None) -> None:
        ast = self.ast
        aliases = dict(inherited)
        if cls:
            aliases[".class"] = cls
        if isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
            name = cls if scope.name == "__init__" and cls else scope.name
            args = scope.args.args
            offset = 1 if args and args[0].arg in ("self", "cls") else 0
            for j, a in enumerate(args):
                sec = self.params.get((name, j - offset), frozenset()) | self.params.get(
                    (name, a.arg), frozenset()
                )
                if sec:
                    aliases[a.arg] = sec
        own = list(self._own_nodes(scope))
        for node in own:
            if isinstance(node, ast.Assign):
                pairs = [(node.targets[0], node.value)]
                if isinstance(node.targets[0], ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs = list(zip(node.targets[0].elts, node.value.elts, strict=False))
                for target, value in pairs:
                    sec = self._section(value, aliases)
                    if sec and isinstance(target, ast.Name):
                        aliases[target.id] = sec
                    elif (
                        sec
                        and isinstance(target, ast.Attribute)
                        and getattr(target.value, "id", None) == "self"
                    ):
                        self.members[f"{aliases.get('.class')}.{target.attr}"] = sec
        for node in own:
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                for sec in _each(self._section(node.value, aliases)):
                    self.reads.add((sec, node.attr))
            elif isinstance(node, ast.Call):
                self._call(node, aliases)
        for node in own:
            if isinstance(node, ast.ClassDef):
                for child in node.body:
                    if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                        self._scope(child, aliases, node.name)
            elif (
                isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
                and node is not scope
            ):
                self._scope(node, aliases, None)

    def _call(self, node, aliases: dict[str, str]) -> None:
        ast = self.ast
        name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
        if not name:
            return
        for i, arg in enumerate(node.args):
            secs = _each(self._section(arg, aliases))
            if secs:
                self.params[(name, i)] = self.params.get((name, i), frozenset()) | secs
        for kw in node.keywords:
            secs = _each(self._section(kw.value, aliases))
            if secs and kw.arg:
                self.params[(name, kw.arg)] = self.params.get((name, kw.arg), frozenset()) | secs
        if name == "getattr" and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            for sec in _each(self._section(node.args[0], aliases)):
                self.reads.add((sec, node.args[1].value))

    def _own_nodes(self, scope):
        """Nodes of ``scope`` outside nested functions and classes (those are scopes of their
        own, but are yielded themselves so the caller can descend)."""
        ast = self.ast
        stack = list(ast.iter_child_nodes(scope))
        while stack:
            node = stack.pop()
            yield node
            if not isinstance(
                node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda
            ):
                stack.extend(ast.iter_child_nodes(node))


@pytest.mark.multi_process
def test_every_config_key_is_read() -> None:
    """A key that nothing reads configures nothing (comm.chunks, launch.master_port and
    train.precision once did): each schema field must be read from its own section (see
    _ConfigReads) by code outside the schema itself (scaleout/config/), the MLPerf log
    (scaleout/telemetry/mlperf.py: it only reports keys) and the simulator (scaleout/sim/: it only
    models
    them)."""
    import ast

    from scaleout.config.schema import Config

    root = Path(__file__).resolve().parents[2]
    skip = ("scaleout/config/", "scaleout/telemetry/mlperf.py", "scaleout/sim/")
    paths = [
        p
        for p in [*root.glob("scaleout/**/*.py"), *root.glob("launchers/**/*.py")]
        if not p.relative_to(root).as_posix().startswith(skip)
    ]
    keys = _schema_keys(Config)
    sections = {name for _, sec, name in keys if sec == ""} | {sec for _, sec, _ in keys if sec}
    reads = _ConfigReads(sections, [ast.parse(p.read_text(), str(p)) for p in paths]).reads
    unread = [key for key, sec, name in keys if sec and (sec, name) not in reads]
    assert not unread, f"schema keys read by nothing outside config/, mlperf.py and sim/: {unread}"


@pytest.mark.unit
@pytest.mark.parametrize("name", ["bert_large_256x8", "resnet50_128x8"])
def test_flagship_configs_build_batches_in_input_workers(name: str) -> None:
    """The flagship runs build their batches in worker processes (data.num_workers >= 1), with the
    reasoning beside the key: on the training thread, ResNet's JPEG decodes (est. 150-350 ms per
    step of one core) and BERT's HDF5 reads land inside every step (review gpu-day-one, finding
    7)."""
    cfg = load_config(name)
    assert cfg.data.num_workers >= 1
    text = (Path(__file__).parents[2] / "configs" / f"{name}.yaml").read_text()
    lines = text.splitlines()
    at = next(i for i, x in enumerate(lines) if x.strip().startswith("num_workers:"))
    assert lines[at - 1].lstrip().startswith("#"), "the reason sits in a comment above the key"


@pytest.mark.unit
@pytest.mark.parametrize("name", ["bert_large_256x8", "resnet50_128x8"])
def test_flagship_runs_take_no_synchronous_save_inside_the_timed_region(name: str) -> None:
    """MLPerf counts every save between run_start and run_stop in time-to-train, and a save
    stalls every GPU while rank 0 writes (until issue "goodput" makes it asynchronous): the
    flagship configs save on preemption and after run_stop only, and say why next to the key."""
    cfg = load_config(name)
    assert cfg.checkpoint.dir, "a preemption notice needs somewhere to save"
    every = cfg.checkpoint.every_steps
    timed_saves = cfg.train.max_steps // every if every else 0
    assert timed_saves == 0, f"{name}: {timed_saves} synchronous saves inside the timed run"
    text = (Path(__file__).resolve().parents[2] / "configs" / f"{name}.yaml").read_text()
    block = text[text.index("\ncheckpoint:") : text.index("  every_steps:")]
    assert "time-to-train" in block and "goodput" in block, block


@pytest.mark.unit
def test_importing_the_config_imports_no_registry_runtime() -> None:
    """The schema is a leaf: importing scaleout.config (its schema and loader too) imports no
    module of scaleout.comm, scaleout.families or scaleout.world; the declarations come in when a
    config is first validated."""
    code = (
        "import sys, scaleout.config, scaleout.config.schema, scaleout.config.load\n"
        "above = ('scaleout.comm', 'scaleout.families', 'scaleout.world')\n"
        "print([m for m in sys.modules if m.startswith(above)])\n"
        "scaleout.config.load_config('bert_tiny_cpu')\n"
        "print('scaleout.families.bert' in sys.modules, 'scaleout.comm.torus2d' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout.splitlines()
    assert out == ["[]", "True True"], out


@pytest.mark.unit
def test_no_import_cycle_between_the_config_and_the_registries() -> None:
    """scaleout.config may import the built-in declarations when it validates (one deferred
    import); then nothing in scaleout.comm, scaleout.families or the section table may import
    scaleout.config back, not even inside a function, and the schema imports neither at its top."""
    import ast

    from tests.test_architecture import _imports

    root = Path(__file__).resolve().parents[2] / "scaleout"
    below = [root / "section.py", root / "registry.py", *(root / "comm").rglob("*.py")]
    below += (root / "families").rglob("*.py")
    back = {
        str(f.relative_to(root)): m
        for f in below
        for _, m in _imports(f)  # the layering test's scan: runtime imports, functions too
        if m == "scaleout.config" or m.startswith("scaleout.config.")
    }
    assert not back, back
    above = ("scaleout.comm", "scaleout.families", "scaleout.world")
    for f in (root / "config").glob("*.py"):
        top = [  # the module-level imports (a deferred one runs only when a config is validated)
            node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            for node in ast.parse(f.read_text()).body
            if isinstance(node, ast.Import | ast.ImportFrom)
        ]
        assert not [m for m in top if m and m.startswith(above)], (f.name, top)
    deferred = [  # the one place the built-in declarations are imported (when validating)
        f.name
        for f in (root / "config").glob("*.py")
        for _, m in _imports(f)  # the layering test's scan: runtime imports, functions too
        if m == "scaleout.families"
    ]
    assert deferred == ["compose.py"], deferred


@pytest.mark.unit
def test_the_schema_is_fixed_after_import() -> None:
    """Registering a family or an algorithm changes no schema class: they are read from the
    section table when a config is validated (no refresh, no rebuild)."""
    from pydantic import Field

    from scaleout.comm import ALGORITHMS, Algorithm
    from scaleout.config import schema
    from scaleout.errors import ConfigError
    from scaleout.families import FAMILIES, Family, register, unregister
    from scaleout.section import Section

    class ProbeConfig(Section):
        width: int = Field(3, ge=1)

    class Probe(Family):
        name = "probe_fixed"
        config = ProbeConfig
        data_sources = ("probe_points",)

    class Echo(Algorithm):
        name = "probe_echo"

    classes = [schema.Config, schema.ModelConfig, schema.DataConfig, schema.CommConfig]
    fields = {cls: dict(cls.model_fields) for cls in classes}
    assert not hasattr(schema, "refresh_families")
    register(Probe())
    ALGORITHMS.register("probe_echo", Echo())
    try:
        cfg = load_config(
            None,
            [
                "model.arch=probe_fixed",
                "model.probe_fixed.width=5",
                "data.source=probe_points",
                "comm.algorithm=probe_echo",
            ],
        )
        assert cfg.model.probe_fixed.width == 5 and cfg.comm.algorithm == "probe_echo"
        assert isinstance(cfg.model.bert, FAMILIES.get("bert").config)  # every family's section
        with pytest.raises(ConfigError, match="model.probe_fixed.width=0: expected greater"):
            load_config(None, ["model.probe_fixed.width=0"])
        with pytest.raises(ConfigError, match="model.bert.hidden='x'"):
            cfg.model.bert = {"hidden": "x"}  # assignment is validated as the family's section
        with pytest.raises(ValueError, match="hidden"):
            cfg.model.bert.hidden = "x"
    finally:
        unregister("probe_fixed")
        ALGORITHMS.unregister("probe_echo")
    assert schema.ModelConfig is classes[1] and schema.Config is classes[0]
    assert {cls: dict(cls.model_fields) for cls in classes} == fields
    with pytest.raises(
        ConfigError, match="model.arch='probe_fixed': expected 'bert', 'resnet' or 'llama'"
    ):
        load_config(None, ["model.arch=probe_fixed"])
    with pytest.raises(ConfigError, match="unknown key model.probe_fixed .expected one of: arch"):
        load_config(None, ["model.probe_fixed.width=5"])


# One case per rule between keys that lived only in the builders (inside every rank) before it
# moved into the schema: each now fails `scaleout config show` (and the train preflight), one line.
MOVED_RULES = [
    (["optim.overlap_comm=true"], "optim.overlap_comm=true needs optim.sharded=true"),
    (["optim.shard=node"], "optim.shard='node' needs optim.sharded=true"),
    (
        ["optim.sharded=true", "optim.name=sgd"],
        "optim.sharded=true is implemented for optim.name='lamb' or 'adamw', got optim.name='sgd'",
    ),
    (
        ["model.arch=resnet", "data.source=synthetic", "model.init_checkpoint=/x.pt"],
        "model.init_checkpoint: model.arch='resnet' starts from no checkpoint",
    ),
    (["data.decode=gpu"], "data.decode=gpu decodes image files: data.source='pydoc' has none"),
    (
        [
            "optim.sharded=true",
            "comm.compression=bf16",
            "comm.algorithm=hierarchical",
            "--world",
            "4",
            "--nproc-per-node",
            "2",
        ],
        "comm.compression=bf16 and comm.algorithm=hierarchical: the compressed reduce-scatter",
    ),
]


@pytest.mark.multi_process  # one `python -m scaleout` process per case
@pytest.mark.parametrize(("overrides", "needle"), MOVED_RULES, ids=lambda v: str(v)[:40])
def test_rules_between_keys_fail_in_config_show(overrides: list[str], needle: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "scaleout", "config", "show", "configs/bert_tiny_cpu.yaml"]
        + overrides,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2 and len(lines) == 1, (run.returncode, run.stderr)
    assert needle in lines[0], lines[0]


@pytest.mark.unit
def test_config_show_prints_the_family_in_use_and_the_keys_as_written() -> None:
    """`config show` (usability review §3): only model.<arch> of the family in use, and
    checkpoint.async as a user writes it (not the Python field async_)."""
    import yaml

    from scaleout.config import format_config

    bert = yaml.safe_load(format_config(load_config("bert_large_256x8")))
    assert "bert" in bert["model"] and "resnet" not in bert["model"]
    assert bert["checkpoint"]["async"] is True and "async_" not in bert["checkpoint"]
    resnet = yaml.safe_load(format_config(load_config("resnet_cpu", ["checkpoint.async=false"])))
    assert "resnet" in resnet["model"] and "bert" not in resnet["model"]
    assert resnet["checkpoint"]["async"] is False
