"""Bad input through the real CLI: exit 2, exactly one line on stderr that names the offending
value, nothing written, before anything is spawned. Every case is a row of docs/bad-input.md, and
the table is generated from CASES (``python tests/cli/test_bad_input.py --write``); the tests check
that
they agree.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "bad-input.md"
# Launcher variables of the calling process must not leak into a case (each case sets its own).
_LEAKY = re.compile(
    r"^(SLURM_.*|SCALEOUT_.*|RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|MASTER_ADDR|"
    r"MASTER_PORT|TORCHELASTIC_.*|OMPI_.*|PMIX_.*|PMI_.*|HOROVOD_.*)$"
)
TORCHRUN = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
SLURM = {
    "SLURM_PROCID": "0",
    "SLURM_STEP_ID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_NNODES": "1",
    "SLURM_TASKS_PER_NODE": "2",
    "SLURM_JOB_NODELIST": "n1",
    "SLURM_JOB_ID": "5",
}


def _npy(values, dtype=None) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        import numpy as np

        np.save(path, np.array(values, dtype=dtype))

    return make


def _torch_saved(obj) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        import torch  # deferred: only this case's file needs it

        torch.save(obj, path)

    return make


def _shard_dir(content: bytes) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        (path / "train").mkdir(parents=True)
        (path / "eval").mkdir()
        (path / "train" / "part-00000.hdf5").write_bytes(content)
        (path / "eval" / "eval.hdf5").write_bytes(content)

    return make


def _folder(mode: int, marker_less_data: bool = False) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        path.mkdir()
        if marker_less_data:
            (path / "spool").mkdir()
        os.chmod(path, mode)

    return make


@dataclass(frozen=True)
class Case:
    argv: tuple[str, ...]  # after `scaleout`
    value: str  # the offending value: the one line must name it
    env: dict[str, str] = field(default_factory=dict)
    files: tuple[tuple[str, str | bytes | Callable[[Path], None]], ...] = ()
    given: str = ""  # what the files hold, for the table
    root: bool = False  # the local Slurm scripts: root only
    normalize: tuple[
        tuple[str, str], ...
    ] = ()  # machine-dependent parts of the message -> placeholders

    @property
    def command(self) -> str:
        env = " ".join(f"{k}={_quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + "scaleout " + " ".join(_quote(a) for a in self.argv)


def _quote(arg: str) -> str:
    return f"'{arg}'" if re.search(r"[\s;()*$]", arg) or arg == "" else arg


CFG = ("config", "show", "bert_tiny_cpu")
BIG_HIST = "10 99999999999999999999999\n"
WRAP_HIST = "10 9223372036854775807\n11 9223372036854775807\n"
CASES: list[Case] = [
    # config values (the same validation runs in launch/submit preflight and in every rank)
    Case((*CFG, "optim.lr=.inf"), "optim.lr=inf"),
    Case((*CFG, "optim.lr=.nan"), "optim.lr=nan"),
    Case((*CFG, "optim.lr=abc"), "optim.lr='abc'"),
    Case((*CFG, "optim.lr=-1"), "optim.lr=-1"),
    Case((*CFG, "optim.lrr=1"), "optim.lrr"),
    Case((*CFG, "comm.bucket_mb=.inf"), "comm.bucket_mb=inf"),
    Case((*CFG, "train.step_timeout_s=.inf"), "train.step_timeout_s=inf"),
    Case((*CFG, "train.init_timeout_s=1e300"), "train.init_timeout_s='1e300'"),
    Case((*CFG, "train.seed=99999999999999999999999"), "train.seed=99999999999999999999999"),
    Case((*CFG, "train.seed=-1"), "train.seed=-1"),
    Case((*CFG, "data.seed=-3"), "data.seed=-3"),
    Case(
        (*CFG, "train.global_batch=100000000000000000000000"),
        "train.global_batch=100000000000000000000000",
    ),
    Case((*CFG, "train.global_batch=-5"), "train.global_batch=-5"),
    Case((*CFG, "data.num_workers=100000"), "data.num_workers=100000"),
    Case((*CFG, "model.bert.hidden=1000000000"), "model.bert.hidden=1000000000"),
    Case((*CFG, "model.bert.layers=100000"), "model.bert.layers=100000"),
    Case((*CFG, "model.bert.vocab_size=2000000000"), "model.bert.vocab_size=2000000000"),
    Case((*CFG, "model.resnet.image_size=100000"), "model.resnet.image_size=100000"),
    Case((*CFG, "launch.nnodes=0"), "launch.nnodes=0"),
    Case((*CFG, "launch.nnodes=10000000"), "launch.nnodes=10000000"),
    Case((*CFG, "launch.master_port=70000"), "launch.master_port=70000"),
    Case((*CFG, "--world", "0"), "world size 0"),
    Case((*CFG, "--world", "-4"), "world size -4"),
    Case((*CFG, "--world", "3"), "world size 3"),
    # scaleout launch: flags
    Case(("launch", "--grace", "-5", "--", "true"), "--grace=-5.0"),
    Case(("launch", "--grace", "nan", "--", "true"), "--grace=nan"),
    Case(("launch", "--timeout", "-1", "--", "true"), "--timeout=-1.0"),
    Case(("launch", "--timeout", "inf", "--", "true"), "--timeout=inf"),
    Case(("launch", "--master-port", "70000", "--", "true"), "--master-port=70000"),
    Case(("launch", "--master-port", "0", "--", "true"), "--master-port=0"),
    Case(("launch", "--nnodes", "0", "--", "true"), "--nnodes=0"),
    Case(
        ("launch", "--nnodes", "100000", "--nproc-per-node", "100000", "--", "sleep", "1"),
        "10000000000 ranks",
        normalize=(
            (
                r"at most \d+ on this machine \(64 per core x \d+ cores\)",
                "at most <64 x cores> on this machine (64 per core x <cores> cores)",
            ),
        ),
    ),
    Case(("launch", "--netns", "--nnodes", "300", "--", "true"), "--nnodes=300"),
    Case(("launch", "--", "no-such-prog-xyz"), "no-such-prog-xyz"),
    Case(("launch", "--node-rate", "1=10mbit", "--", "true"), "--node-rate='1=10mbit'"),
    Case(("launch", "--netns", "--node-rate", "1=fast", "--", "true"), "--node-rate 1='fast'"),
    Case(("launch", "--nnodes", "3", "--", "scaleout", "train", "bert_tiny_cpu"), "world size 3"),
    Case(
        (
            "launch",
            "--nproc-per-node",
            "2",
            "--",
            "scaleout",
            "train",
            "bert_tiny_cpu",
            "train.seed=-1",
        ),
        "train.seed=-1",
    ),
    # scaleout bench cluster
    Case(("bench", "cluster", "up", "--nnodes", "251"), "--nnodes=251"),
    Case(("bench", "cluster", "up", "--name", "x;rm"), "'x;rm'"),
    Case(("bench", "cluster", "up", "--rate", "fast"), "--rate='fast'"),
    Case(("bench", "cluster", "status", "--all"), "--all"),
    # scaleout doctor
    Case(("doctor", "--threshold", "2"), "'2'"),
    Case(
        ("doctor", "--quarantine", "q.json"),
        "q.json",
        files=(("q.json", "{not json"),),
        given="q.json: `{not json`",
    ),
    # scaleout data pack
    Case(
        ("data", "pack", "h.txt", "--out", ""),
        "99999999999999999999999",
        files=(("h.txt", BIG_HIST),),
        given=f"h.txt: `{BIG_HIST.strip()}`",
    ),
    Case(
        ("data", "pack", "h.txt", "--out", ""),
        "9223372036854775807",
        files=(("h.txt", WRAP_HIST),),
        given="h.txt: two counts of 2^63-1 (int64 used to wrap to -2 sequences)",
    ),
    Case(
        ("data", "pack", "h.txt", "--out", ""),
        "-3",
        files=(("h.txt", "10 -3\n"),),
        given="h.txt: `10 -3`",
    ),
    Case(
        ("data", "pack", "--lengths", "f.npy", "--out", ""),
        "float64",
        files=(("f.npy", _npy([1.7, 2.2, 300.9])),),
        given="f.npy: float array [1.7, 2.2, 300.9] (used to be truncated silently)",
    ),
    Case(
        ("data", "pack", "--lengths", "o.npy", "--out", ""),
        "o.npy",
        files=(("o.npy", _npy([None, 1], object)),),
        given="o.npy: object array (pickle; refused, never loaded)",
    ),
    Case(
        ("data", "pack", "--lengths", "l.txt", "--out", ""),
        "99999999999999999999",
        files=(("l.txt", "12\n99999999999999999999\n"),),
        given="l.txt: a 20-digit length",
    ),
    Case(
        ("data", "pack", "--lengths", "l.txt", "--out", ""),
        "'1.5'",
        files=(("l.txt", "12\n1.5\n"),),
        given="l.txt: `1.5`",
    ),
    Case(
        ("data", "pack", "h.txt", "--max-len", "1000000000000", "--out", ""),
        "max_len=1000000000000",
        files=(("h.txt", "10 3\n"),),
        given="h.txt: `10 3`",
    ),
    # scaleout submit: the launch preflight runs before anything is queued
    Case(("submit", "bert_tiny_cpu", "optim.lr=-1", "--executor", "local"), "optim.lr=-1"),
    Case(
        ("submit", "bert_tiny_cpu", "--executor", "local", "--nproc-per-node", "3"), "world size 3"
    ),
    Case(
        ("submit", "bert_tiny_cpu", "--executor", "local", "--array", "train.seed=1,-2"),
        "train.seed=-2",
    ),
    Case(
        ("submit", "--command", "smoke", "--time", "1", "--signal-delay", "100000"),
        "--signal-delay=100000",
    ),
    # corrupt or foreign files under path-valued keys: sniffed before anything is written
    Case(
        ("train", "bert_tiny_cpu", "model.init_checkpoint=/etc/passwd"),
        "model.init_checkpoint=/etc/passwd",
        given="a text file as the initial checkpoint",
    ),
    Case(
        ("train", "bert_tiny_cpu", "model.init_checkpoint=list.pt"),
        "model.init_checkpoint=list.pt",
        files=(("list.pt", _torch_saved([1, 2, 3])),),
        given="list.pt: `torch.save([1, 2, 3])`",
    ),
    Case(
        ("train", "bert_tiny_cpu", "model.init_checkpoint=junk.pt"),
        "model.init_checkpoint=junk.pt",
        files=(("junk.pt", b"PK\x03\x04 truncated zip"),),
        given="junk.pt: a truncated zip",
    ),
    Case(
        ("train", "bert_tiny_cpu", "data.source=wikipedia", "data.path=shards"),
        "data.path=shards",
        files=(("shards", _shard_dir(b"not an HDF5 file\n")),),
        given="shards/{train,eval}/*.hdf5: text files",
    ),
    # launcher environments, read by every rank (scaleout smoke reads them first)
    Case(("smoke",), "WORLD_SIZE=0", env={**TORCHRUN, "WORLD_SIZE": "0"}),
    Case(("smoke",), "MASTER_PORT=70000", env={**TORCHRUN, "MASTER_PORT": "70000"}),
    Case(("smoke",), "2(x99999999999)", env={**SLURM, "SLURM_TASKS_PER_NODE": "2(x99999999999)"}),
    Case(("smoke",), "n[0-999999]b[0-9]", env={**SLURM, "SLURM_JOB_NODELIST": "n[0-999999]b[0-9]"}),
    # ResNet data and recipe (issue 27): config keys, then the data/config/mlperf commands
    Case(("config", "show", "resnet_cpu", "data.crop_min_area=0"), "data.crop_min_area=0"),
    Case(("config", "show", "resnet_cpu", "data.decode=tpu"), "data.decode='tpu'"),
    Case(
        ("config", "show", "resnet_cpu", "data.decode=dali", "data.source=synthetic"),
        "data.source='synthetic'",
    ),
    Case(
        ("config", "show", "resnet_cpu", "data.decode=dali", "data.format=shards"),
        "data.format=shards",
    ),
    Case(("config", "show", "resnet_cpu", "hpcai500.target=1.5"), "hpcai500.target=1.5"),
    Case(
        (
            "config",
            "resnet-rcp",
            "--global-batch",
            "1000",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "8",
        ),
        "--global-batch 1000",
    ),
    Case(("mlperf", "rcp", "nowhere"), "nowhere"),
    Case(
        ("data", "prepare-imagenet", "out", "--train", "nowhere", "--val", "v"), "--train nowhere"
    ),
    Case(("data", "make-image-shards", "nowhere", "out"), "data.path=nowhere"),
    Case(("data", "prepare-fashion-mnist", "--source", "nowhere", "--out", "fm"), "nowhere"),
    # the local Slurm scripts (root): refused before anything starts or is deleted
    Case(
        ("slurm", "up", "--no-install", "--state", "planted"),
        "planted",
        files=(("planted", _folder(0o777)),),
        given="planted: a folder of mode 777",
        root=True,
    ),
    Case(
        ("slurm", "down", "--wipe", "--state", "data"),
        "data",
        files=(("data", _folder(0o755, True)),),
        given="data: a folder with data but no scaleout marker",
        root=True,
    ),
    # comm.algorithm=auto (issue 29): a misspelt name lists auto; auto with what it cannot re-plan
    Case((*CFG, "comm.algorithm=autotune"), "comm.algorithm='autotune'"),
    Case((*CFG, "comm.algorithm=auto", "optim.sharded=true"), "optim.sharded=true"),
    # scaleout plan: cluster, calibration, grid, convergence fit
    Case(("plan", "c.yaml", "--preset", "dgx-z9"), "dgx-z9"),
    Case(
        ("plan", "c.yaml", "--preset", "cal.json"),
        "cal.json",
        files=(("cal.json", "{not json"),),
        given="cal.json: `{not json`",
    ),
    Case(("plan", "c.yaml", "--per-gpu-batch", "8,x"), "'8,x'"),
    Case(
        ("plan", "c.yaml", "--fit", "lb.json"),
        "lb.json",
        files=(("c.yaml", "{}\n"),),
        given="c.yaml: `{}` (the defaults)",
    ),
]


def _normalize(case: Case, message: str) -> str:
    for pattern, placeholder in case.normalize:
        message = re.sub(pattern, placeholder, message)
    return message


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in folder.rglob("*")
    }


def run_case(case: Case, cwd: Path) -> tuple[subprocess.CompletedProcess, dict, dict]:
    for name, content in case.files:
        path = cwd / name
        if callable(content):
            content(path)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    before = _snapshot(cwd)
    env = {k: v for k, v in os.environ.items() if not _LEAKY.match(k)}
    env.update(case.env, PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    r = subprocess.run(
        [sys.executable, "-m", "scaleout", *case.argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    return r, before, _snapshot(cwd)


def _cell(text: str) -> str:
    text = text.replace("|", "\\|")
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def _uncell(text: str) -> str:
    text = text.strip()
    text = text[3:-3] if text.startswith("`` ") else text[1:-1]
    return text.replace("\\|", "|")


def doc_rows() -> list[tuple[str, str, str]]:
    """(command, given, error) of every table row in docs/bad-input.md."""
    rows = []
    for line in DOC.read_text().splitlines():
        if re.match(r"^\| \d+ \|", line):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows.append((_uncell(cells[1]), cells[2], _uncell(cells[3])))
    return rows


def write_doc(messages: list[str]) -> None:
    text = DOC.read_text()
    head, _, _ = text.partition(
        "<!-- table: generated by `python tests/cli/test_bad_input.py --write` -->"
    )
    lines = ["| # | input | given | one-line error (exit 2) |", "|---|---|---|---|"]
    for i, (case, msg) in enumerate(zip(CASES, messages, strict=True), 1):
        lines.append(f"| {i} | {_cell(case.command)} | {case.given} | {_cell(msg)} |")
    DOC.write_text(
        head
        + "<!-- table: generated by `python tests/cli/test_bad_input.py --write` -->\n"
        + "\n".join(lines)
        + "\n"
    )


@pytest.mark.unit
def test_doc_table_lists_every_case() -> None:
    rows = doc_rows()
    assert len(CASES) >= 40
    assert [r[0] for r in rows] == [c.command for c in CASES], (
        "docs/bad-input.md is stale: run tests/cli/test_bad_input.py --write"
    )
    assert [r[1] for r in rows] == [c.given for c in CASES]


@pytest.mark.full_system
@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.command[9:60] for c in CASES])
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path: Path, index: int) -> None:
    case = CASES[index]
    if case.root and os.geteuid() != 0:
        pytest.skip("the local Slurm scripts need root")
    r, before, after = run_case(case, tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert len(lines) == 1, r.stderr
    assert case.value in lines[0], (case.value, lines[0])
    assert r.stdout == "", r.stdout
    assert after == before, "the command wrote files before failing"
    documented = doc_rows()[index][2]
    assert _normalize(case, lines[0]) == documented, (
        "docs/bad-input.md is stale: run tests/cli/test_bad_input.py --write"
    )


if __name__ == "__main__":  # regenerate the table of docs/bad-input.md from the real CLI
    import tempfile

    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/cli/test_bad_input.py --write")
    msgs = []
    for c in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            res, _, _ = run_case(c, Path(tmp))
        msgs.append(_normalize(c, res.stderr.strip()))
        print(f"{res.returncode} {c.command}\n    {msgs[-1]}", flush=True)
    write_doc(msgs)
