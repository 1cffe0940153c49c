"""Bad input by class (docs/bad-input.md "Classes"): each class is one parametrised test that builds
its cases, so that a new case of a known class is covered without a new row.

Every case runs the real CLI and must end in one line on stderr naming the value, exit 2, no
traceback, nothing written, in bounded time. The numeric-flag class runs ``scaleout.cli.main`` in
this process (the same entry point as the ``scaleout`` script; ~90 cases would cost minutes as
subprocesses); the others run ``python -m scaleout`` as a subprocess.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_LEAKY = re.compile(
    r"^(SLURM_.*|SCALEOUT_.*|RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|MASTER_ADDR|"
    r"MASTER_PORT|TORCHELASTIC_.*|OMPI_.*|PMIX_.*|PMI_.*|HOROVOD_.*)$"
)
# An error line is a line: it names a value by an excerpt, never by megabytes.
MAX_LINE = 600


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(folder)): (p.lstat().st_size, p.lstat().st_mtime_ns)
        for p in folder.rglob("*")
    }


def run_cli(
    argv: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 60
) -> tuple[subprocess.CompletedProcess, float]:
    full = {k: v for k, v in os.environ.items() if not _LEAKY.match(k)}
    full.update(env or {}, PYTHONPATH=str(ROOT) + os.pathsep + full.get("PYTHONPATH", ""))
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "scaleout", *argv],
        cwd=cwd,
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return r, time.monotonic() - t0


def assert_one_line(r: subprocess.CompletedProcess, *named: str) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stdout[-1500:], r.stderr[-1500:])
    assert len(lines) == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert len(lines[0]) <= MAX_LINE, lines[0][:MAX_LINE]
    for n in named:
        assert n in lines[0], (n, lines[0])
    return lines[0]


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
    before = _snapshot(tmp_path)
    r, took = run_cli(["config", "show", "c.yaml"], tmp_path)
    line = assert_one_line(r, "c.yaml", said)
    assert line.startswith("scaleout config: error: ")
    assert took < 30, f"{took:.1f} s"
    assert _snapshot(tmp_path) == before


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


# ---------------------------------------------------------------- class: the launcher's own inputs


def _listening_port() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


def _launcher_cases() -> list[tuple[str, list[str], dict[str, str], str]]:
    """(id, argv after `scaleout launch --nnodes 2`, env, what the line names). ``{port}`` is a
    port another listener holds, ``{dir}`` the case's scratch folder."""
    smoke = ["--", "scaleout", "smoke"]
    cases: list[tuple[str, list[str], dict[str, str], str]] = []
    # a master address that is not this machine's (documentation and private ranges) or no name
    for addr in ("10.255.255.1", "198.51.100.7", "203.0.113.9", "2001:db8::1"):
        cases.append((f"addr-{addr}", ["--master-addr", addr, *smoke], {}, addr))
    for host in ("no-such-host.invalid", "x" * 300):
        shown = host if len(host) < 60 else f"({len(host)} chars)"  # an excerpt, not the value
        cases.append((f"host-{host[:20]}", ["--master-addr", host, *smoke], {}, shown))
    cases.append(("port-taken", ["--master-port", "{port}", *smoke], {}, "{port}"))
    # the command after --
    cases += [
        ("cmd-not-exec", ["--", "{dir}/notexec.sh"], {}, "notexec.sh"),
        ("cmd-folder", ["--", "{dir}"], {}, "{dir}"),
        ("cmd-missing-py", ["--", "{dir}/nope.py"], {}, "nope.py"),
        ("cmd-missing-path", ["--", "{dir}/nope"], {}, "nope"),
        ("cmd-subcommand", ["--", "scaleout", "nosuchcmd"], {}, "nosuchcmd"),
        ("cmd-flag", ["--", "scaleout", "smoke", "--numel", "x"], {}, "'x'"),
        ("cmd-missing-arg", ["--", "scaleout", "train"], {}, "config"),
    ]
    # environment knobs the ranks read
    for var, value in [
        ("GLOO_SOCKET_IFNAME", "nosuch0"),
        ("GLOO_SOCKET_IFNAME", ""),
        ("TP_SOCKET_IFNAME", "lo,nosuch1"),
        ("NCCL_SOCKET_IFNAME", "=zz"),
        ("OMP_NUM_THREADS", "0"),
        ("OMP_NUM_THREADS", "-1"),
        ("OMP_NUM_THREADS", "abc"),
        ("OMP_NUM_THREADS", "99999999"),
        ("MKL_NUM_THREADS", "4,x"),
    ]:
        cases.append((f"env-{var}={value}", smoke, {var: value}, var))
    return cases


LAUNCHER = _launcher_cases()


@pytest.mark.full_system
@pytest.mark.parametrize("argv,env,named", [c[1:] for c in LAUNCHER], ids=[c[0] for c in LAUNCHER])
def test_launcher_inputs_are_checked_before_spawning(
    tmp_path: Path, argv: list[str], env: dict[str, str], named: str
) -> None:
    """An address that is not this machine's or does not resolve (it used to be a silent wait of
    150 s+), a taken port, a command that cannot run, an interface or thread count the ranks would
    choke on: one line from the launcher, in seconds, and no rank started (nothing printed as
    ``[rank N]``)."""
    listener, port = _listening_port()
    (tmp_path / "notexec.sh").write_text("#!/bin/sh\necho ran\n")
    subs = {"{port}": str(port), "{dir}": str(tmp_path)}

    def fill(text: str) -> str:
        for k, v in subs.items():
            text = text.replace(k, v)
        return text

    with listener:
        r, took = run_cli(["launch", "--nnodes", "2", *map(fill, argv)], tmp_path, env)
    line = assert_one_line(r, fill(named))
    assert line.startswith("scaleout launch: error: ")
    assert "[rank" not in r.stdout + r.stderr
    assert took < 20, f"{took:.1f} s"


def _slurm(nodelist: str) -> dict[str, str]:
    return {
        "SLURM_PROCID": "0",
        "SLURM_STEP_ID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_NNODES": "1",
        "SLURM_TASKS_PER_NODE": "1",
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_JOB_ID": "5",
    }


_TORCHRUN = {
    "RANK": "0",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29911",
}
IN_RANK = [
    ("slurm-host", _slurm("nosuchnode-zz9"), "does not resolve"),
    ("slurm-range", _slurm("gpu[001-002]"), "does not resolve"),
    ("torchrun-addr", {**_TORCHRUN, "MASTER_ADDR": "no-such-host.invalid"}, "does not resolve"),
    ("gloo-ifname", {**_TORCHRUN, "GLOO_SOCKET_IFNAME": "nosuch0"}, "GLOO_SOCKET_IFNAME"),
    ("tp-ifname", {**_TORCHRUN, "TP_SOCKET_IFNAME": "lo,nosuch1"}, "TP_SOCKET_IFNAME"),
]


@pytest.mark.full_system
@pytest.mark.parametrize("env,named", [c[1:] for c in IN_RANK], ids=[c[0] for c in IN_RANK])
def test_what_only_a_rank_can_see_is_one_line_naming_the_rank(
    tmp_path: Path, env: dict[str, str], named: str
) -> None:
    """Under srun or torchrun (no scaleout launcher before it), a rendezvous host that does not
    resolve, or an interface or thread count the process group would choke on: the rank says so
    at once, naming itself, instead of waiting train.init_timeout_s or gloo's traceback."""
    r, took = run_cli(["smoke"], tmp_path, env)
    assert_one_line(r, "rank 0", named)
    assert took < 30, f"{took:.1f} s"


# ---------------------------------------------------------------- class: paths and files of a run


def _zip_without_members(path: Path) -> None:
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        z.writestr("unrelated.npy", b"x")


def _foreign_hdf5(path: Path) -> None:
    h5py = pytest.importorskip("h5py")
    with h5py.File(path, "w") as f:
        f["pixels"] = [1, 2, 3]


def _shards(name: str, make: Callable[[Path], None]) -> Callable[[Path], str]:
    def build(root: Path) -> str:
        for split in ("train", "eval"):
            (root / "shards" / split).mkdir(parents=True)
            make(root / "shards" / split / f"part-0{name}")
        return f"data.source=wikipedia data.path={root / 'shards'}"

    return build


def _run_record(content: str) -> Callable[[Path], str]:
    def build(root: Path) -> str:
        (root / "ck").mkdir()
        (root / "ck" / "ckpt-00000002.pt").write_bytes(b"")  # listed, never read: run.json first
        (root / "ck" / "run.json").write_text(content)
        return "train.max_steps=5"

    return build


def _setting(text: str) -> Callable[[Path], str]:
    return lambda root: text.replace("{root}", str(root))


# (id, what the overrides are (built in the case's folder), what the line names)
RUN_PATHS: list[tuple[str, Callable[[Path], str], str]] = [
    # output folders: under a file, a file, a dangling link, empty, no room for one checkpoint
    ("out-under-file", _setting("train.output_dir={root}/plain.txt/out"), "train.output_dir"),
    ("out-is-file", _setting("train.output_dir={root}/plain.txt"), "train.output_dir"),
    ("out-dangling", _setting("train.output_dir={root}/dangling"), "train.output_dir"),
    ("out-empty", _setting("train.output_dir="), "train.output_dir=''"),
    ("ckpt-under-file", _setting("checkpoint.dir={root}/plain.txt/ck"), "checkpoint.dir"),
    ("ckpt-is-file", _setting("checkpoint.dir={root}/plain.txt"), "checkpoint.dir"),
    (
        "ckpt-no-room",  # a valid model whose one checkpoint is larger than any disk here
        _setting("model.bert.layers=1024 model.bert.hidden=65536"),
        "room for one checkpoint",
    ),
    ("timeline-under-file", _setting("comm.timeline={root}/plain.txt/t.json"), "comm.timeline"),
    ("timeline-is-folder", _setting("comm.timeline={root}"), "comm.timeline"),
    # data files opened as a rank opens them
    ("npz-torn", _shards(".npz", lambda p: p.write_bytes(b"PK\x03\x04" + b"\x07" * 500)), "npz"),
    ("npz-members", _shards(".npz", _zip_without_members), "missing MLPerf BERT fields"),
    ("hdf5-foreign", _shards(".hdf5", _foreign_hdf5), "missing MLPerf BERT fields"),
    ("data-missing", _setting("data.source=wikipedia data.path={root}/nowhere"), "nowhere"),
    ("data-no-path", _setting("data.source=wikipedia"), "data.path"),
    ("seq-over-positions", _setting("data.max_seq_len=256 model.bert.max_position=128"), "256"),
    # the run record beside the checkpoints: valid JSON that is not a record, or not JSON
    ("record-null", _run_record("null"), "run.json"),
    ("record-list", _run_record("[1, 2]"), "run.json"),
    ("record-number", _run_record("7"), "run.json"),
    ("record-torn", _run_record('{"status": "runn'), "run.json"),
]


def _prepare(tmp_path: Path, build: Callable[[Path], str]) -> list[str]:
    (tmp_path / "plain.txt").write_text("a regular file\n")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere" / "x")
    overrides = f"train.output_dir={tmp_path}/out checkpoint.dir={tmp_path}/ck " + build(tmp_path)
    return ["train", "bert_tiny_cpu", *overrides.split()]


@pytest.mark.unit
@pytest.mark.parametrize("build,named", [c[1:] for c in RUN_PATHS], ids=[c[0] for c in RUN_PATHS])
def test_run_paths_and_files_are_checked_before_spawning(
    tmp_path: Path, build: Callable[[Path], str], named: str
) -> None:
    """Where a run writes (writable folders, room for one checkpoint), what it reads (data files
    opened as far as a rank opens them, the run record): one line from the preflight every
    launcher runs before it spawns a rank (``scaleout.cli.preflight``, called here directly: a
    subprocess per case would cost ~20 s of torch imports each), nothing written. These used to be
    rank tracebacks after half a minute, or accepted (an empty train.output_dir wrote into the
    current folder)."""
    from scaleout.cli import preflight
    from scaleout.errors import UserError

    argv = _prepare(tmp_path, build)
    before = _snapshot(tmp_path)
    with pytest.raises(UserError) as err:
        preflight(argv, 1, 1)
    line = str(err.value)
    assert "\n" not in line and len(line) <= MAX_LINE, line[:MAX_LINE]
    assert named in line, (named, line)
    assert _snapshot(tmp_path) == before


@pytest.mark.full_system
def test_scaleout_launch_runs_the_run_path_checks_before_spawning(tmp_path: Path) -> None:
    """The same checks through the real launcher: one line, exit 2, no rank started."""
    argv = _prepare(tmp_path, _setting("train.output_dir={root}/plain.txt/out"))
    before = _snapshot(tmp_path)
    r, _ = run_cli(["launch", "--", "scaleout", *argv], tmp_path, timeout=120)
    assert_one_line(r, "train.output_dir", "plain.txt")
    assert "[rank" not in r.stdout + r.stderr
    assert _snapshot(tmp_path) == before


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
