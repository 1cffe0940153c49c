"""``scaleout data stage``: a data directory copied to node-local disk once per node, incrementally,
with mtimes (the shard index's key) kept."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest

from scaleout.data.stage import MARKER, stage
from scaleout.errors import UserError
from scaleout.families.bert.data.shard_index import shard_key

pytestmark = pytest.mark.unit


def make_data(root: Path) -> Path:
    """A data.path as scaleout reads it: train/ (a symlink to the shards, as one would point at the
    reference's hdf5_4320_shards_varlength), eval/, and the shard index beside the shards."""
    shards = root / "hdf5_4320_shards_varlength"
    (shards / ".scaleout-index").mkdir(parents=True)
    for i in range(3):
        (shards / f"part_{i:05d}.hdf5").write_bytes(bytes([i]) * (1000 + i))
    (shards / ".scaleout-index" / "summary-ab.npz").write_bytes(b"index")
    src = root / "data"
    (src / "eval").mkdir(parents=True)
    (src / "eval" / "eval_10k.hdf5").write_bytes(b"e" * 500)
    (src / "train").symlink_to(shards)
    return src


def test_stage_copies_once_keeps_the_index_key_and_restages_only_what_changed(tmp_path):
    """First call copies every file (through the symlink, as real files) with the same shard_key
    (name, size, mtime: the staged copy reuses the index); a second copies nothing; a changed
    shard is copied again."""
    src, dest = make_data(tmp_path), tmp_path / "local"
    r = stage(src, dest)
    assert (r.copied, r.kept, r.bytes_copied) == (5, 0, 1000 + 1001 + 1002 + 5 + 500)
    assert not (dest / "train").is_symlink() and (dest / "train").is_dir()
    for f in sorted((src / "train").glob("*.hdf5")):
        assert shard_key(dest / "train" / f.name) == shard_key(f)
        assert (dest / "train" / f.name).read_bytes() == f.read_bytes()
    assert (dest / "train/.scaleout-index/summary-ab.npz").read_bytes() == b"index"
    assert (dest / MARKER).is_file()
    r = stage(src, dest)
    assert (r.copied, r.kept) == (0, 5)
    changed = src / "train" / "part_00001.hdf5"
    changed.write_bytes(b"new")
    r = stage(src, dest)
    assert (r.copied, r.kept) == (1, 4)
    assert (dest / "train" / "part_00001.hdf5").read_bytes() == b"new"
    assert not list(dest.rglob(".scaleout-tmp-*"))


def test_ranks_of_one_node_copy_once(tmp_path):
    """Four callers at once on one node (threads: flock excludes separate open() calls as it
    excludes processes): the files are copied once in all."""
    src, dest = make_data(tmp_path), tmp_path / "local"
    results = []
    threads = [threading.Thread(target=lambda: results.append(stage(src, dest))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.copied for r in results) == [0, 0, 0, 5]


@pytest.mark.parametrize(
    "case, match",
    [("missing", "is not a directory"), ("inside", "or inside it")],
)
def test_bad_paths_are_one_line(tmp_path, case, match):
    src = make_data(tmp_path)
    args = (tmp_path / "nope", tmp_path / "x") if case == "missing" else (src, src / "copy")
    with pytest.raises(UserError, match=match):
        stage(*args)


def test_too_little_space_fails_before_copying(tmp_path, monkeypatch):
    """A full node-local disk cannot be made here without root: shutil.disk_usage is replaced by
    one reporting 1 KiB free (the only mock); the error names both sizes and nothing is copied."""
    src, dest = make_data(tmp_path), tmp_path / "local"
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1024))
    with pytest.raises(UserError, match=r"0\.0 GiB free, the copy needs"):
        stage(src, dest)
    assert not list((dest).rglob("*.hdf5"))
