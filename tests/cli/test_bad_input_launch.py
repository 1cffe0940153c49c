"""Bad input by class, the launcher's side (docs/bad-input.md "Classes"): the launcher's own
inputs, what only a rank can see, and where a run writes and what it reads. Each class is one
parametrised test that builds its cases (tests/cli/test_bad_input_classes.py has the others).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cli.badinput_util import MAX_LINE, assert_one_line, run_cli, snapshot

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
    import h5py  # deferred: only this case needs it

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
    before = snapshot(tmp_path)
    with pytest.raises(UserError) as err:
        preflight(argv, 1, 1)
    line = str(err.value)
    assert "\n" not in line and len(line) <= MAX_LINE, line[:MAX_LINE]
    assert named in line, (named, line)
    assert snapshot(tmp_path) == before


@pytest.mark.full_system
def test_scaleout_launch_runs_the_run_path_checks_before_spawning(tmp_path: Path) -> None:
    """The same checks through the real launcher: one line, exit 2, no rank started."""
    argv = _prepare(tmp_path, _setting("train.output_dir={root}/plain.txt/out"))
    before = snapshot(tmp_path)
    r, _ = run_cli(["launch", "--", "scaleout", *argv], tmp_path, timeout=120)
    assert_one_line(r, "train.output_dir", "plain.txt")
    assert "[rank" not in r.stdout + r.stderr
    assert snapshot(tmp_path) == before
