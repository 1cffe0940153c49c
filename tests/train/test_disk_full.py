"""A full disk said plainly and costing nothing (scaleout/diskfull.py), on a real full file system:
a small tmpfs mounted for the test (root; skipped where mount is refused).

A save that finds no room: one line naming the rank whose write failed, the path, the bytes
needed and free; no save starts after it; the previous checkpoint is the one resume uses; no
``.tmp`` survives the next start; a resume onto a disk still too full stops in the preflight."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from scaleout.checkpoint import Checkpointer
from scaleout.diskfull import DiskFull, disk_full, is_disk_full
from tests.train.test_async_save import SMALL as ASYNC_SMALL

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "scaleout" / "configs" / "bert_tiny_cpu.yaml")
_OWN = [
    "model.bert.hidden=64",  # a checkpoint of ~0.3 MiB: several fit the 4 MiB file system
    "model.bert.intermediate=128",
    "train.global_batch=4",
    "train.target=null",
    "checkpoint.every_steps=1",
    "checkpoint.keep=10",
]
_KEYS = {kv.split("=")[0] for kv in _OWN}
SMALL = [kv for kv in ASYNC_SMALL if kv.split("=")[0] not in _KEYS] + _OWN


@pytest.fixture
def small_fs(tmp_path):
    """A 4 MiB tmpfs: a real file system that fills up (ENOSPC), unmounted after the test."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _leave_free(fs: Path, free: int) -> None:
    """Fill ``fs`` with a ballast file until ``free`` bytes (page-rounded) are left."""
    ballast = fs / "ballast"
    ballast.unlink(missing_ok=True)
    size = os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize - free
    with open(ballast, "wb") as f:
        f.write(b"\0" * max(size, 0))


def _launch(out: Path, ck: Path, *extra: str) -> subprocess.CompletedProcess:
    argv = [
        sys.executable, "-m", "scaleout", "launch", "--nnodes", "1", "--nproc-per-node", "2",
        "--grace", "5", "--", "scaleout", "train", TINY, *SMALL,
        f"train.output_dir={out}", f"checkpoint.dir={ck}", *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(argv, env=env, capture_output=True, timeout=400)


def _full_run(tmp_path: Path, fs: Path, mode: str) -> tuple[Path, int, subprocess.CompletedProcess]:
    """Two checkpoints written, then room left for 1.5 more: a resume to step 6 saves step 3
    and finds the disk full at step 4. Returns (checkpoint.dir, one checkpoint's size, the
    failed launch)."""
    out, ck = tmp_path / "out", fs / "ckpt"
    first = _launch(out, ck, "train.max_steps=2", f"checkpoint.async={mode}")
    assert first.returncode == 0, first.stdout.decode()[-3000:] + first.stderr.decode()[-2000:]
    size = (ck / "ckpt-00000002.pt").stat().st_size
    _leave_free(fs, size + size // 2)
    return ck, size, _launch(out, ck, "train.max_steps=6", f"checkpoint.async={mode}")


def _check_failed_save(ck: Path, failed: subprocess.CompletedProcess) -> str:
    text = failed.stdout.decode() + failed.stderr.decode()
    assert failed.returncode != 0, text[-3000:]
    last = failed.stderr.decode().strip().splitlines()[-1]
    # the launcher's last line names the rank whose write failed (rank 0), the path and bytes
    assert last.startswith("scaleout launch: rank 0: no space left writing checkpoint step 4 to")
    assert str(ck / "ckpt-00000004.pt") in last and "needs" in last and "free there" in last
    assert "checkpoint step 3 is kept" in last
    assert "Traceback" not in text and "unexpected pos" not in text, text[-3000:]
    assert "checkpoint: step 5 ->" not in text  # no save starts after the failed one
    assert not list(ck.glob("*.tmp"))
    found = Checkpointer(ck).choose()
    assert found is not None and found[1].name == "ckpt-00000003.pt"
    return text


@pytest.mark.extended  # minutes on 2 cores: python3 -m pytest -m extended (docs/testing.md)
@pytest.mark.multi_process
def test_a_full_disk_during_a_background_save_is_one_line_and_resume_uses_the_previous(
    tmp_path, small_fs
):
    ck, size, failed = _full_run(tmp_path, small_fs, "true")
    _check_failed_save(ck, failed)
    out = tmp_path / "out"

    # a resume onto a disk still too full for one checkpoint: refused by the preflight
    _leave_free(small_fs, size // 2)
    again = _launch(out, ck, "train.max_steps=6")
    err = again.stderr.decode().strip()
    assert again.returncode == 2 and len(err.splitlines()) == 1, err[-2000:]
    # the launcher's room check (one checkpoint, estimated from the model) or the resume's (the
    # newest checkpoint's size), whichever sees it first: the key, the path and what is free
    assert "checkpoint.dir=" in err and str(ck) in err and "free" in err, err
    assert "[rank" not in again.stdout.decode()  # nothing spawned

    # a killed write's temp file, room again: the next start removes it and resumes at step 3
    (ck / "ckpt-00000004.pt.999-0a0b0c0d.tmp").write_bytes(b"\0" * 1000)
    (small_fs / "ballast").unlink()
    done = _launch(out, ck, "train.max_steps=5")
    text = done.stdout.decode() + done.stderr.decode()
    assert done.returncode == 0, text[-3000:]
    assert "resumed from" in text and "ckpt-00000003.pt" in text
    assert not list(ck.glob("*.tmp")) and (ck / "ckpt-00000005.pt").exists()


@pytest.mark.multi_process
def test_a_full_disk_during_a_synchronous_save_stops_every_rank_at_once(tmp_path, small_fs):
    """checkpoint.async=false: rank 0's failed write is agreed at the save (the peers do not
    wait for it at a barrier until the step timeout and call it hung)."""
    ck, _, failed = _full_run(tmp_path, small_fs, "false")
    text = _check_failed_save(ck, failed)
    assert "hung or dead" not in text and "sent no heartbeat" not in text


@pytest.mark.unit
def test_a_full_disk_is_seen_through_torch_saves_wrapping(small_fs):
    """torch.save into a file object reports ENOSPC as ``RuntimeError: ... unexpected pos`` with
    the OSError in its context: recognised, and a checkpoint save's line names the rank, the path,
    the bytes needed and free, and leaves no temp file."""
    import torch

    _leave_free(small_fs, 64 << 10)
    try:
        with open(small_fs / "x.pt", "wb") as f:
            torch.save({"w": torch.zeros(1 << 18)}, f)
    except Exception as exc:  # noqa: BLE001 -- the shape of the error is the point
        assert is_disk_full(exc) and not isinstance(exc, OSError)
    else:
        pytest.fail("a 1 MiB save fit in 64 KiB")
    (small_fs / "x.pt").unlink()
    with pytest.raises(DiskFull) as err:
        Checkpointer(small_fs / "ck", rank=0).save(4, {"w": torch.zeros(1 << 18)})
    line = str(err.value)
    assert line.startswith("rank 0: no space left writing checkpoint step 4 to ")
    assert str(small_fs / "ck" / "ckpt-00000004.pt") in line
    assert "needs 1.0 MiB (" in line and "free there" in line and "\n" not in line
    assert list((small_fs / "ck").iterdir()) == []
    assert isinstance(disk_full(small_fs, None, "x"), DiskFull)


@pytest.mark.multi_process
def test_a_full_output_dir_is_one_line_naming_the_rank_and_the_directory(tmp_path, small_fs):
    """train.output_dir on a full disk: the MLPerf log's and metrics' writes (logging used to
    print a traceback per record and go on) end the run with one line naming rank 0."""
    out = small_fs / "out"
    _leave_free(small_fs, 8 << 10)
    failed = _launch(out, tmp_path / "ckpt", "train.max_steps=3", "checkpoint.every_steps=0")
    text = failed.stdout.decode() + failed.stderr.decode()
    assert failed.returncode != 0, text[-3000:]
    last = failed.stderr.decode().strip().splitlines()[-1]
    assert last.startswith("scaleout launch: rank 0: no space left writing to "), last
    assert str(out) in last and "free there" in last
    assert "Logging error" not in text and "Traceback" not in text, text[-3000:]


@pytest.mark.unit
def test_a_full_disk_is_seen_through_dcp_s_per_rank_failures(tmp_path, monkeypatch):
    """torch.distributed.checkpoint reports a rank's failed write as a CheckpointException whose
    ``failures`` hold (exception, traceback) per rank, not as a cause: a shard write that found
    the disk full is still recognised, and the sharded save's line names the path and the bytes,
    not DCP's multi-line traceback."""
    import errno

    import torch
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    def failed(exc: BaseException) -> CheckpointException:
        try:
            raise exc
        except BaseException as e:  # noqa: BLE001 -- wrapped as DCP wraps it
            return CheckpointException("save failed", {1: _wrap_exception(e)})

    full = OSError(errno.ENOSPC, "No space left on device")
    assert is_disk_full(failed(full))
    assert not is_disk_full(failed(ValueError("a bug, not a disk")))

    class Pieces:  # the sharded writer raising what DCP raises on a full disk
        def save_pieces(self, *a, **k):
            raise failed(full)

    ckpt = Checkpointer(tmp_path / "ckpt", rank=1, asynchronous=False)
    import scaleout.checkpoint as ck

    monkeypatch.setattr(ck, "_shards", lambda: Pieces())
    monkeypatch.setattr(ck, "_token", lambda world: "t")
    monkeypatch.setattr(ck, "_group", lambda world: None)
    with pytest.raises(DiskFull) as e:
        ckpt.save(3, {}, None, {"m": torch.zeros(1024)})
    line = str(e.value)
    assert "\n" not in line and line.startswith("rank 1: ") and "ckpt" in line, line
