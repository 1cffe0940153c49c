"""Image data layouts: the lazy, cached ImageFolder index (rank 0 lists, the others read one file),
val labelled by train's classes, tar shards with static per-node shards, `scaleout data
prepare-imagenet` / `make-image-shards`, and the one-line errors for bad inputs."""

from __future__ import annotations

import csv
import os
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from scaleout.cli import main
from scaleout.errors import UserError
from scaleout.families.resnet.data import ImageFolder
from scaleout.families.resnet.data.shards import NodeShardSampler, ShardImages, write_shards
from tests.distutil import run_dist

COLOURS = {"n01": (200, 30, 30), "n02": (30, 200, 30), "n03": (30, 30, 200)}


def make_images(d: Path, cls: str, count: int, prefix: str = "img") -> list[str]:
    """``count`` tiny JPEGs of class ``cls`` (its colour plus noise) in ``d``."""
    from PIL import Image

    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(abs(hash((cls, prefix))) % 2**32)
    names = []
    for i in range(count):
        a = np.clip(np.array(COLOURS[cls]) + rng.normal(0, 20, (12 + i, 16, 3)), 0, 255)
        name = f"{prefix}_{cls}_{i}.JPEG"
        Image.fromarray(a.astype(np.uint8)).save(d / name, quality=90)
        names.append(name)
    return names


def make_tree(root: Path, train: dict[str, int], val: dict[str, int]) -> Path:
    for split, counts in (("train", train), ("val", val)):
        for cls, n in counts.items():
            make_images(root / split / cls, cls, n, split)
    return root


class Listings:
    """Counts the directory listings of this process (os.scandir / os.listdir)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        for name in ("scandir", "listdir"):
            real = getattr(os, name)

            def counted(*a, _real=real, **k):
                self.calls += 1
                return _real(*a, **k)

            monkeypatch.setattr(os, name, counted)


@pytest.mark.unit
def test_folder_index_is_lazy_cached_and_read_by_other_ranks(tmp_path, monkeypatch):
    root = make_tree(tmp_path / "data", {"n01": 3, "n02": 2}, {"n01": 1, "n02": 1})
    seen = Listings(monkeypatch)
    train = ImageFolder(root, "train", image_size=8, rank=0)
    assert seen.calls == 0  # nothing listed when the data set is made
    assert len(train) == 5 and train.classes == ["n01", "n02"] and seen.calls > 0
    assert train.labels.tolist() == [0, 0, 0, 1, 1]
    index = list((root / ".scaleout-index").glob("train-*.npz"))
    assert len(index) == 1
    seen.calls = 0
    other = ImageFolder(root, "train", image_size=8, rank=1)
    assert len(other) == 5 and other.path(4) == train.path(4) and seen.calls == 0
    x, y = other.get(np.arange(5))
    assert x.shape == (5, 8, 8, 3) and y.tolist() == [0, 0, 0, 1, 1]  # uint8 NHWC
    # a tree that changed (a new class folder) gets a new index, built by rank 0
    make_images(root / "train" / "n03", "n03", 1, "train")
    assert len(ImageFolder(root, "train", rank=0)) == 6
    assert len(list((root / ".scaleout-index").glob("train-*.npz"))) == 1  # the old one removed


@pytest.mark.unit
def test_read_only_data_path_puts_the_index_under_output_dir(tmp_path, monkeypatch):
    root = make_tree(tmp_path / "data", {"n01": 2}, {"n01": 1})
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, m: False if Path(p) == root else real(p, m))
    out = tmp_path / "run"
    assert len(ImageFolder(root, "train", rank=0, index_root=out)) == 2
    assert not (root / ".scaleout-index").exists()
    assert len(list((out / ".scaleout-index").rglob("train-*.npz"))) == 1


@pytest.mark.unit
def test_val_is_labelled_by_train_classes_and_bad_sets_are_refused(tmp_path):
    """A val without one of train's classes keeps train's labels (the old reader sorted val's
    folders on their own: every later label shifted by one)."""
    root = make_tree(tmp_path / "a", {"n01": 2, "n02": 2, "n03": 2}, {"n01": 1, "n03": 2})
    train = ImageFolder(root, "train", rank=0)
    val = ImageFolder(root, "val", rank=0, classes_from=train)
    assert val.labels.tolist() == [0, 2, 2] and val.get(np.arange(3))[1].tolist() == [0, 2, 2]
    bad = make_tree(tmp_path / "b", {"n01": 2, "n02": 2}, {"n01": 1, "n03": 1})
    tr = ImageFolder(bad, "train", rank=0)
    with pytest.raises(UserError, match=r"val/ has class 'n03' .* expected val classes among"):
        len(ImageFolder(bad, "val", rank=0, classes_from=tr))
    with pytest.raises(UserError, match=r"train/ has 2 class folders; expected 1000$"):
        len(ImageFolder(bad, "train", rank=0, expect_classes=1000))
    with pytest.raises(UserError, match=r"train/ has 4 images; expected 1281167$"):
        len(ImageFolder(bad, "train", rank=0, expect_images=1_281_167))
    (bad / "empty").mkdir()
    with pytest.raises(UserError, match="has no class folders"):
        len(ImageFolder(bad, "empty", rank=0))
    # a rank waiting for rank 0's index gets rank 0's error instead of a time-out
    with pytest.raises(UserError, match="has no class folders"):
        len(ImageFolder(bad, "empty", rank=1))


def _count_listings(world, root: str) -> dict:
    """Each rank reads the folder index; ranks other than 0 must list nothing."""
    calls = {"n": 0}
    saved = (os.scandir, os.listdir)

    def counted(real):
        def f(*a, **k):
            calls["n"] += 1
            return real(*a, **k)

        return f

    os.scandir, os.listdir = counted(saved[0]), counted(saved[1])
    try:
        train = ImageFolder(root, "train", rank=world.rank)
        val = ImageFolder(root, "val", rank=world.rank, classes_from=train)
        n, labels = len(train), val.labels.tolist()
    finally:
        os.scandir, os.listdir = saved
    return {"listings": calls["n"], "n": n, "val": labels}


@pytest.mark.multi_process
def test_only_rank_0_lists_the_tree(tmp_path):
    """2 real ranks (gloo) open the same fresh tree at once: rank 1 waits for rank 0's index file
    and lists no directory."""
    root = make_tree(tmp_path / "data", {"n01": 3, "n02": 2}, {"n02": 1})
    res = run_dist(_count_listings, nproc_per_node=2, args=(str(root),))
    assert res[0]["listings"] > 0 and res[1]["listings"] == 0, res
    assert res[0]["n"] == res[1]["n"] == 5 and res[0]["val"] == res[1]["val"] == [1]


@pytest.mark.unit
def test_shards_round_trip_and_match_the_folder(tmp_path):
    src = make_tree(tmp_path / "src", {"n01": 3, "n02": 3, "n03": 2}, {"n01": 1, "n03": 1})
    out = tmp_path / "shards"
    # tiny shards: about one image each
    assert main(["data", "make-image-shards", str(src), str(out), "--shard-mb", "0.0005"]) == 0
    shards = sorted(p.name for p in out.glob("train-*.tar"))
    assert len(shards) == 8 and shards[0] == "train-000000.tar"
    with tarfile.open(out / "train-000000.tar") as t:
        names = t.getnames()
        assert names == ["00000000.jpg", "00000000.cls"]
        assert t.extractfile("00000000.cls").read() == b"0"
    assert (out / "classes.txt").read_text().split() == ["n01", "n02", "n03"]
    folder = ImageFolder(src, "train", image_size=8, seed=3)
    for rank in (0, 1):  # written with the shards: nobody lists or reads tar headers later
        sh = ShardImages(out, "train", image_size=8, seed=3, rank=rank)
        x, y = sh.get(np.arange(8), epoch=1)
        fx, fy = folder.get(np.arange(8), epoch=1)
        assert torch.equal(x, fx) and torch.equal(y, fy)
    # foreign shards (no index): rank 0 reads the tar headers once
    for p in (out / ".scaleout-index").iterdir():
        p.unlink()
    sh = ShardImages(out, "val", image_size=8, rank=0, classes_from=ShardImages(out, "train"))
    assert sh.labels.tolist() == [0, 2] and sh.shard_of.tolist() == [0, 1]
    assert torch.equal(
        sh.get(np.arange(2))[0], ImageFolder(src, "val", image_size=8).get([0, 1])[0]
    )
    cached = ShardImages(out, "train", image_size=8, seed=3, cache_bytes=1 << 20)
    a = cached.get(np.arange(8), epoch=2)[0]
    assert len(cached.cache.images) == 8 and torch.equal(cached.get(np.arange(8), epoch=2)[0], a)


@pytest.mark.unit
def test_bad_shards_give_one_line_errors(tmp_path):
    out = tmp_path / "s"
    out.mkdir()
    with tarfile.open(out / "train-000000.tar", "w") as t:
        info = tarfile.TarInfo("k1.jpg")
        info.size = 3
        t.addfile(info, __import__("io").BytesIO(b"abc"))
    with pytest.raises(UserError, match=r"sample 'k1' lacks its \.cls label"):
        len(ShardImages(out, "train", rank=0))
    with pytest.raises(UserError, match="no val-000000.tar"):
        ShardImages(out, "val")
    with pytest.raises(UserError, match="--shard-mb 0"):
        write_shards(tmp_path, out, 0)


class FakeShards:
    """What NodeShardSampler reads of a ShardImages: the shard of every sample."""

    def __init__(self, sizes: list[int]):
        self.shard_of = np.repeat(np.arange(len(sizes)), sizes)
        self.root = "fake"


@pytest.mark.unit
def test_per_node_shards_cover_every_sample_once_per_epoch_and_resume():
    sizes = [5, 7, 6, 5, 4, 8, 9, 4]  # node 0: 0,2,4,6 -> 24; node 1: 1,3,5,7 -> 24
    images, n, nodes, per_node, batch = FakeShards(sizes), sum(sizes), 2, 2, 8
    samplers = [
        NodeShardSampler(
            images,
            n,
            batch,
            r,
            nodes * per_node,
            r // per_node,
            nodes,
            r % per_node,
            per_node,
            seed=5,
        )
        for r in range(nodes * per_node)
    ]
    shard = images.shard_of
    for epoch in range(2):
        drawn = np.concatenate(
            [s.local_indices(p) for p in range(epoch * n, (epoch + 1) * n, batch) for s in samplers]
        )
        assert sorted(drawn.tolist()) == list(range(n))  # each sample exactly once per epoch
        for r, s in enumerate(samplers):  # only from its node's shards
            mine = np.concatenate(
                [s.local_indices(p) for p in range(epoch * n, (epoch + 1) * n, batch)]
            )
            assert set((shard[mine] % nodes).tolist()) == {r // per_node}
    e0 = [samplers[0].local_indices(p).tolist() for p in range(0, n, batch)]
    e1 = [samplers[0].local_indices(p).tolist() for p in range(n, 2 * n, batch)]
    assert e0 != e1  # reshuffled per epoch
    fresh = NodeShardSampler(images, n, batch, 0, 4, 0, 2, 0, 2, seed=5)
    assert fresh.local_indices(5 * batch).tolist() == samplers[0].local_indices(5 * batch).tolist()
    assert np.array_equal(
        np.sort(samplers[0].global_indices(0)),
        np.sort(np.concatenate([s.local_indices(0) for s in samplers])),
    )
    with pytest.raises(UserError, match="leave node 2 none"):
        NodeShardSampler(FakeShards([3, 3]), 6, 6, 2, 3, 2, 3, 0, 1).local_indices(0)


def _write_class_tars(raw: Path, counts: dict[str, int]) -> None:
    for cls, n in counts.items():
        tmp = raw / "tmp" / cls
        names = make_images(tmp, cls, n, "train")
        raw.joinpath("train").mkdir(parents=True, exist_ok=True)
        with tarfile.open(raw / "train" / f"{cls}.tar", "w") as t:
            for name in names:
                t.add(tmp / name, arcname=name)


def _flat_val(raw: Path, labels: list[str]) -> list[str]:
    d = raw / "val"
    files = []
    for i, cls in enumerate(labels, 1):
        name = f"ILSVRC2012_val_{i:08d}.JPEG"
        make_images(d / "tmp", cls, 1, f"v{i}")
        (d / "tmp" / f"v{i}_{cls}_0.JPEG").rename(d / name)
        files.append(name)
    (d / "tmp").rmdir()
    return files


def _prepare(out: Path, raw: Path, *extra: str) -> int:
    return main(
        [
            "data",
            "prepare-imagenet",
            str(out),
            "--train",
            str(raw / "train"),
            "--val",
            str(raw / "val"),
            "--expect-classes",
            "3",
            "--expect-train",
            "6",
            "--expect-val",
            "4",
            *extra,
        ]
    )


@pytest.mark.unit
def test_prepare_imagenet_from_class_tars_and_each_label_format(tmp_path, capsys):
    raw = tmp_path / "raw"
    _write_class_tars(raw, {"n01": 2, "n02": 2, "n03": 2})
    wnids = ["n02", "n01", "n03", "n02"]
    files = _flat_val(raw, wnids)
    plain = raw / "val_labels.txt"
    plain.write_text("".join(f"{f} {w}\n" for f, w in zip(files, wnids, strict=True)))
    assert _prepare(tmp_path / "out", raw, "--labels", str(plain)) == 0
    out = tmp_path / "out"
    assert sorted(p.name for p in (out / "train").iterdir()) == ["n01", "n02", "n03"]
    assert sorted(p.name for p in (out / "val" / "n02").iterdir()) == [files[0], files[3]]
    assert os.stat(out / "val" / "n02" / files[0]).st_ino == os.stat(raw / "val" / files[0]).st_ino
    assert '"val": 4' in capsys.readouterr().out
    # the index training reads is already there, and val is labelled by train's classes
    tr = ImageFolder(out, "train", rank=1)
    va = ImageFolder(out, "val", rank=1, classes_from=tr)
    assert len(tr) == 6 and sorted(va.labels.tolist()) == [0, 1, 1, 2]
    kaggle = raw / "LOC_val_solution.csv"
    with kaggle.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["ImageId", "PredictionString"])
        for name, wnid in zip(files, wnids, strict=True):
            w.writerow([Path(name).stem, f"{wnid} 1 2 30 40 {wnid} 5 6 7 8"])
    assert _prepare(tmp_path / "out2", raw, "--labels", str(kaggle)) == 0
    assert sorted(p.name for p in (tmp_path / "out2" / "val" / "n01").iterdir()) == [files[1]]
    scipy_io = pytest.importorskip("scipy.io")
    ids = {"n01": 7, "n02": 3, "n03": 11}
    synsets = np.array(
        [(i, w) for w, i in ids.items()], dtype=[("ILSVRC2012_ID", "O"), ("WNID", "O")]
    )
    scipy_io.savemat(raw / "meta.mat", {"synsets": synsets})
    truth = raw / "ILSVRC2012_validation_ground_truth.txt"
    truth.write_text("".join(f"{ids[w]}\n" for w in wnids))
    assert (
        _prepare(tmp_path / "out3", raw, "--labels", str(truth), "--meta", str(raw / "meta.mat"))
        == 0
    )
    assert sorted(p.name for p in (tmp_path / "out3" / "val" / "n03").iterdir()) == [files[2]]


@pytest.mark.unit
def test_prepare_imagenet_refuses_bad_sets(tmp_path, capsys):
    raw = tmp_path / "raw"
    for cls in ("n01", "n02", "n03"):
        make_images(raw / "train" / cls, cls, 2, "train")  # class folders: linked, not unpacked
    files = _flat_val(raw, ["n01", "n02", "n03", "n03"])
    labels = raw / "labels.txt"
    labels.write_text(
        "".join(f"{f} {w}\n" for f, w in zip(files, ["n01", "n02", "n09", "n03"], strict=True))
    )
    assert _prepare(tmp_path / "o1", raw, "--labels", str(labels)) != 0
    _refused(capsys, r"val class 'n09' .* is not a train class")
    labels.write_text(
        "".join(f"{f} {w}\n" for f, w in zip(files, ["n01", "n02", "n02", "n02"], strict=True))
    )
    assert _prepare(tmp_path / "o2", raw, "--labels", str(labels)) != 0
    _refused(capsys, r"no images of class 'n03'")
    assert (tmp_path / "o2" / "train").is_symlink()
    labels.write_text(
        "".join(f"{f} {w}\n" for f, w in zip(files[:3], ["n01", "n02", "n03"], strict=True))
    )
    assert _prepare(tmp_path / "o3", raw, "--labels", str(labels)) != 0
    _refused(capsys, r"no label for ILSVRC2012_val_00000004.JPEG")
    labels.write_text(
        "".join(f"{f} {w}\n" for f, w in zip(files, ["n01", "n02", "n03", "n03"], strict=True))
    )
    assert (
        main(
            [
                "data",
                "prepare-imagenet",
                str(tmp_path / "o4"),
                "--train",
                str(raw / "train"),
                "--val",
                str(raw / "val"),
                "--labels",
                str(labels),
                "--expect-classes",
                "3",
            ]
        )
        != 0
    )
    _refused(capsys, r"train/ has 6 images; expected 1281167$")
    assert _prepare(tmp_path / "o5", raw) != 0
    _refused(capsys, "--val .* is flat: --labels is needed")


def _refused(capsys, pattern: str) -> None:
    """The command's error is one line on stderr that matches ``pattern``."""
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(pattern, err), err


def _task_on(world, overrides: list[str]) -> dict:
    """Build the ResNet task on 2 real ranks, counting this rank's directory listings."""
    from scaleout.config import load_config
    from scaleout.train.task import build_task

    calls = {"n": 0}
    saved = (os.scandir, os.listdir)

    def counted(real):
        def f(*a, **k):
            calls["n"] += 1
            return real(*a, **k)

        return f

    os.scandir, os.listdir = counted(saved[0]), counted(saved[1])
    try:
        task = build_task(load_config(None, overrides), world)
        at_build = calls["n"]
        try:
            first = task.batches.micro_batches(0, 1)[0].target.tolist()
        except UserError as exc:
            first = str(exc)
        return {
            "at_build": at_build,
            "rows": task.rows,
            "first": first,
            "sampler": type(task.sampler).__name__,
            "idx": task.sampler.local_indices(0).tolist() if not isinstance(first, str) else None,
            "eval": task.eval_idx.tolist() if not isinstance(first, str) else None,
        }
    finally:
        os.scandir, os.listdir = saved


@pytest.mark.multi_process
def test_task_reads_no_tree_before_the_clock_on_any_layout(tmp_path):
    """data.source=imagenet lists nothing when the task is built (its sizes are known; the counts
    are checked at the first batch, after run_start); data.source=images reads its size from the
    index, which only rank 0 lists; shards get the per-node sampler."""
    root = make_tree(tmp_path / "f", {"n01": 4, "n02": 4}, {"n01": 2, "n02": 2})
    write_shards(root, tmp_path / "s", 0.0005, progress=lambda _: None)
    small = [
        "model.arch=resnet",
        "model.resnet.depth=18",
        "model.resnet.width=4",
        "model.resnet.num_classes=4",
        "model.resnet.image_size=8",
        "train.global_batch=4",
        "data.eval_samples=2",
        f"train.output_dir={tmp_path / 'out'}",
    ]
    imagenet = run_dist(
        _task_on, nproc_per_node=2, args=([*small, "data.source=imagenet", f"data.path={root}"],)
    )
    assert [r["at_build"] for r in imagenet] == [0, 0] and imagenet[0]["rows"] == 1_281_167
    assert "train/ has 2 class folders; expected 1000" in imagenet[0]["first"]
    for p in (root / ".scaleout-index").iterdir():
        p.unlink()  # a fresh tree for the images run
    images = run_dist(
        _task_on, nproc_per_node=2, args=([*small, "data.source=images", f"data.path={root}"],)
    )
    assert images[0]["at_build"] > 0 and images[1]["at_build"] == 0, images
    assert [r["rows"] for r in images] == [8, 8] and images[0]["sampler"] == "ShardedSampler"
    assert images[0]["eval"] == [0, 2]  # a subset spread over the class-sorted val: both classes
    shards = run_dist(
        _task_on,
        nproc_per_node=2,
        args=([*small, "data.source=images", f"data.path={tmp_path / 's'}"],),
    )
    assert [r["at_build"] for r in shards] == [0, 0] and shards[0]["sampler"] == "NodeShardSampler"
    assert [r["rows"] for r in shards] == [8, 8]
    assert not set(shards[0]["idx"]) & set(shards[1]["idx"])  # the node's ranks: disjoint slices
