"""``scaleout data prepare-imagenet``: the ILSVRC2012 download as the ImageFolder layout, checked.

Inputs, as people have them:

- train: a folder of class folders (``n01440764/*.JPEG``), or the contents of
  ``ILSVRC2012_img_train.tar`` (1,000 ``n*.tar``, one per class: each is unpacked into its class
  folder);
- val: the flat folder of ``ILSVRC2012_val_000000NN.JPEG`` (``ILSVRC2012_img_val.tar`` unpacked),
  with its labels from one of: the devkit's ``ILSVRC2012_validation_ground_truth.txt`` (one
  ILSVRC2012 ID per line, image i on line i) plus the devkit's ``meta.mat`` (ID -> wnid; read with
  scipy), Kaggle's ``LOC_val_solution.csv`` (``ImageId,PredictionString``; the first word is the
  wnid), or a plain text file of ``<file> <wnid>`` lines.

Output ``OUT/train`` (a symlink to a class-foldered train, or the unpacked class tars) and
``OUT/val/<wnid>/`` (hard links to the val files, symlinks across file systems: nothing copied).
Then it checks 1,000 classes, 1,281,167 train and 50,000 val images (``--expect-*`` change the
numbers), and that val's classes are exactly train's; the check builds the lazy file index that
training reads (scaleout/families/resnet/data/index.py), so a run starts without listing the tree.
"""

from __future__ import annotations

import csv
import os
import tarfile
from collections.abc import Callable
from pathlib import Path

from scaleout.errors import UserError
from scaleout.families.resnet.data.folder import EXTENSIONS, ImageFolder
from scaleout.families.resnet.imagenet import IMAGENET_TRAIN_IMAGES

IMAGENET_CLASSES, IMAGENET_VAL = 1000, 50_000


def prepare_imagenet(
    out: str | os.PathLike[str],
    train: str | os.PathLike[str],
    val: str | os.PathLike[str],
    labels: str | os.PathLike[str] | None = None,
    meta: str | os.PathLike[str] | None = None,
    expect_classes: int = IMAGENET_CLASSES,
    expect_train: int = IMAGENET_TRAIN_IMAGES,
    expect_val: int = IMAGENET_VAL,
    progress: Callable[[str], None] = print,
) -> dict[str, int]:
    out, train, val = Path(out), Path(train), Path(val)
    for name, p in (("train", train), ("val", val)):
        if not p.is_dir():
            raise UserError(f"--{name} {p}: not a folder")
    out.mkdir(parents=True, exist_ok=True)
    classes = _prepare_train(out / "train", train, progress)
    _prepare_val(out / "val", val, labels, meta, set(classes), progress)
    progress("checking counts (and building the file index training reads)")
    tr = ImageFolder(out, "train", expect_classes=expect_classes, expect_images=expect_train)
    n_train = len(tr)  # train's counts are checked first
    va = ImageFolder(out, "val", classes_from=tr, expect_images=expect_val)
    n_val = len(va)
    val_classes = sorted({int(c) for c in va.labels})
    if len(val_classes) != len(tr.classes):
        missing = sorted(set(range(len(tr.classes))) - set(val_classes))
        raise UserError(
            f"{out}/val has no images of class {tr.classes[missing[0]]!r} ({len(missing)} in all);"
            f" expected val's classes to be train's {len(tr.classes)}"
        )
    summary = {"classes": len(tr.classes), "train": n_train, "val": n_val}
    progress(f"{out}: {summary['classes']} classes, {summary['train']} train, {n_val} val images")
    return summary


def _prepare_train(dst: Path, train: Path, progress: Callable[[str], None]) -> list[str]:
    """Class folders: ``dst`` links to ``train``; class tars: each is unpacked into dst/<wnid>/."""
    entries = sorted(os.scandir(train), key=lambda e: e.name)
    folders = [e.name for e in entries if e.is_dir() and not e.name.startswith(".")]
    tars = [e for e in entries if e.is_file() and e.name.endswith(".tar")]
    if folders and not tars:
        if dst.resolve() != train.resolve():
            if dst.is_symlink() or dst.exists():
                if not (dst.is_symlink() and dst.resolve() == train.resolve()):
                    raise UserError(
                        f"{dst} exists; expected a new output folder or a link to {train}"
                    )
            else:
                dst.symlink_to(train.resolve(), target_is_directory=True)
        return folders
    if not tars:
        raise UserError(
            f"--train {train}: neither class folders nor class tars (n*.tar from "
            "ILSVRC2012_img_train.tar); expected one of them"
        )
    dst.mkdir(parents=True, exist_ok=True)
    for k, e in enumerate(tars, 1):
        wnid = e.name[: -len(".tar")]
        d = dst / wnid
        if not (d / ".done").is_file():
            d.mkdir(exist_ok=True)
            with tarfile.open(e.path) as t:
                for m in t:
                    if m.isfile() and m.name.lower().endswith(EXTENSIONS):
                        m.name = os.path.basename(m.name)
                        t.extract(m, d, filter="data")
            (d / ".done").touch()
        if k % 50 == 0 or k == len(tars):
            progress(f"train: unpacked {k}/{len(tars)} class tars")
    return [e.name[: -len(".tar")] for e in tars]


def read_val_labels(labels: Path, meta: Path | None, files: list[str]) -> dict[str, str]:
    """{val file name: wnid} from the devkit ground truth (+ meta.mat), Kaggle's CSV, or
    ``<file> <wnid>`` lines."""
    text = labels.read_text()
    lines = [x.split() for x in text.splitlines() if x.strip()]
    if labels.suffix == ".csv":
        out = {}
        for row in csv.DictReader(text.splitlines()):
            if "ImageId" not in row or "PredictionString" not in row:
                raise UserError(f"{labels}: expected Kaggle's columns ImageId,PredictionString")
            out[row["ImageId"]] = row["PredictionString"].split()[0]
        stems = {Path(f).stem: f for f in files}
        return {stems.get(k, k): v for k, v in out.items()}
    if lines and all(len(x) == 2 for x in lines):
        return {Path(f).name: w for f, w in lines}
    if lines and all(len(x) == 1 and x[0].isdigit() for x in lines):
        if meta is None:
            raise UserError(
                f"{labels}: devkit ground truth (ILSVRC2012 IDs) needs --meta (the devkit's "
                "meta.mat, ID -> wnid)"
            )
        ids = _devkit_ids(meta)
        ordered = sorted(files)
        if len(ordered) != len(lines):
            raise UserError(
                f"{labels} has {len(lines)} labels but the val folder {len(ordered)} images; "
                "expected one label per image"
            )
        try:
            return {f: ids[int(x[0])] for f, x in zip(ordered, lines, strict=True)}
        except KeyError as exc:
            raise UserError(f"{labels}: ILSVRC2012 ID {exc} is not in {meta}") from exc
    raise UserError(
        f"{labels}: expected ILSVRC2012_validation_ground_truth.txt (one ID a line), "
        "LOC_val_solution.csv or '<file> <wnid>' lines"
    )


def _devkit_ids(meta: Path) -> dict[int, str]:
    try:
        from scipy.io import loadmat  # deferred: optional, only the devkit's meta.mat needs it
    except ImportError as exc:
        raise UserError(
            f"--meta {meta}: reading meta.mat needs scipy (pip install scipy), or pass "
            "LOC_val_solution.csv / '<file> <wnid>' labels instead"
        ) from exc
    synsets = loadmat(str(meta), squeeze_me=True)["synsets"]
    return {int(s["ILSVRC2012_ID"]): str(s["WNID"]) for s in synsets}


def _prepare_val(
    dst: Path,
    val: Path,
    labels: str | os.PathLike[str] | None,
    meta: str | os.PathLike[str] | None,
    classes: set[str],
    progress: Callable[[str], None],
) -> None:
    entries = list(os.scandir(val))
    files = sorted(e.name for e in entries if e.is_file() and e.name.lower().endswith(EXTENSIONS))
    if not files:
        if any(e.is_dir() for e in entries):  # already class-foldered
            if dst.resolve() != val.resolve() and not dst.exists():
                dst.symlink_to(val.resolve(), target_is_directory=True)
            return
        raise UserError(f"--val {val}: no images; expected ILSVRC2012_val_*.JPEG")
    if labels is None:
        raise UserError(
            f"--val {val} is flat: --labels is needed (ILSVRC2012_validation_ground_truth.txt "
            "with --meta, LOC_val_solution.csv, or '<file> <wnid>' lines)"
        )
    label_of = read_val_labels(Path(labels), Path(meta) if meta else None, files)
    unlabelled = [f for f in files if f not in label_of]
    if unlabelled:
        raise UserError(
            f"--labels {labels} has no label for {unlabelled[0]} ({len(unlabelled)} in all); "
            "expected one per val image"
        )
    alien = sorted({label_of[f] for f in files} - classes)
    if alien:
        raise UserError(
            f"--labels {labels}: val class {alien[0]!r} ({len(alien)} in all) is not a train "
            f"class; expected val's classes among train's {len(classes)}"
        )
    for k, f in enumerate(files, 1):
        d = dst / label_of[f]
        d.mkdir(parents=True, exist_ok=True)
        target = d / f
        if not target.exists():
            try:
                os.link(val / f, target)
            except OSError:  # another file system, or no hard links: a symlink
                target.symlink_to((val / f).resolve())
        if k % 5000 == 0 or k == len(files):
            progress(f"val: filed {k}/{len(files)} images")
