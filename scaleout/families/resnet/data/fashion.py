"""Fashion-MNIST written once as PNG class folders: the ResNet CPU time-to-train data.

Debian's ``dataset-fashion-mnist`` (installed by scripts/setup.sh) ships the original idx files::

    /usr/share/datasets/fashion-mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz

``prepare(out)`` writes them as 28x28 grayscale PNGs into the class-foldered layout that
``ImageFolder`` reads (``data.source: images``), so the real decode, crop and eval path trains::

    <out>/train/<class>/<i>.png     60,000 images
    <out>/val/<class>/<i>.png       10,000 images (the t10k test set)

Classes are ``0_tshirt`` ... ``9_ankle_boot`` (sorted order = label order). The tree is built in a
temporary sibling directory and renamed into place, then a marker (``<out>/.fashion-mnist.json``,
counts per split) is written: a second call, or a concurrent one that lost the rename race, returns
at once. ``ensure_prepared`` is what training calls on first use (``data.prepare: fashion-mnist``).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np

from scaleout.errors import UserError

SOURCE_DIR = Path("/usr/share/datasets/fashion-mnist")
CLASSES = (
    "0_tshirt",
    "1_trouser",
    "2_pullover",
    "3_dress",
    "4_coat",
    "5_sandal",
    "6_shirt",
    "7_sneaker",
    "8_bag",
    "9_ankle_boot",
)
SPLITS = {"train": "train", "val": "t10k"}  # our split -> the idx file prefix
MARKER = ".fashion-mnist.json"
DEFAULT_OUT = "runs/data/fashion-mnist"
_DTYPES = {0x08: np.uint8}


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """An idx file (gzipped or not): ``[n]`` labels or ``[n, rows, cols]`` images, uint8."""
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    try:
        with opener(p, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:
        raise UserError(
            f"{p}: cannot read ({e}); expected an idx file (apt-get install dataset-fashion-mnist)"
        ) from e
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _DTYPES:
        raise UserError(f"{p}: not an unsigned-byte idx file (magic {data[:4].hex()!r})")
    ndim = data[3]
    dims = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise UserError(f"{p}: {body.size} bytes of data for dimensions {dims}")
    return body.reshape(dims)


def write_idx(path: str | os.PathLike[str], array: np.ndarray) -> None:
    """Writes a uint8 array as a gzipped idx file (the inverse of ``read_idx``; tests use it)."""
    a = np.ascontiguousarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, a.ndim]) + struct.pack(f">{a.ndim}I", *a.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + a.tobytes())


def load_split(source: str | os.PathLike[str], prefix: str) -> tuple[np.ndarray, np.ndarray]:
    src = Path(source)
    images = read_idx(src / f"{prefix}-images-idx3-ubyte.gz")
    labels = read_idx(src / f"{prefix}-labels-idx1-ubyte.gz")
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise UserError(
            f"{src}/{prefix}-*: images {images.shape} and labels {labels.shape} do not match; "
            "expected [n, 28, 28] and [n]"
        )
    if labels.size and int(labels.max()) >= len(CLASSES):
        raise UserError(f"{src}/{prefix}-labels: label {int(labels.max())}; expected 0-9")
    return images, labels


def prepared(out: str | os.PathLike[str]) -> dict | None:
    """The marker's counts when ``out`` holds a finished tree, else None."""
    try:
        return json.loads((Path(out) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def prepare(
    out: str | os.PathLike[str] = DEFAULT_OUT,
    source: str | os.PathLike[str] = SOURCE_DIR,
    limit: int | None = None,
) -> dict:
    """Writes ``out``/{train,val}/<class>/<i>.png once; returns the counts (see module docstring).
    ``limit`` keeps the first N images of each split (tests)."""
    out = Path(out)
    done = prepared(out)
    if done is not None:
        return done
    if out.exists() and any(out.iterdir()):
        raise UserError(
            f"--out {out}: exists without {MARKER} (an unfinished or foreign tree); remove it or "
            "pick another directory"
        )
    from PIL import Image  # deferred: PIL only when writing

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        counts: dict = {"source": str(source), "classes": list(CLASSES)}
        for split, prefix in SPLITS.items():
            images, labels = load_split(source, prefix)
            if limit is not None:
                images, labels = images[:limit], labels[:limit]
            for name in CLASSES:
                (tmp / split / name).mkdir(parents=True)
            for i, (im, y) in enumerate(zip(images, labels, strict=True)):
                Image.fromarray(im).save(tmp / split / CLASSES[y] / f"{i}.png")
            counts[split] = len(labels)
            counts[f"{split}_per_class"] = np.bincount(labels, minlength=len(CLASSES)).tolist()
        (tmp / MARKER).write_text(json.dumps(counts, indent=1) + "\n")
        if out.exists():
            out.rmdir()  # empty (checked above); a concurrent writer may have won meanwhile
        os.rename(tmp, out)
    except OSError:
        done = prepared(out)  # another process finished first: use its tree
        if done is None:
            raise
        return done
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return counts


def ensure_prepared(out: str | os.PathLike[str], world) -> dict:
    """Training's first-use hook: global rank 0 writes, everyone waits at a barrier; a rank that
    still sees no tree (node-local disks) has its node's local rank 0 write one too."""

    def barrier() -> None:
        if world.world_size > 1:
            world.barrier()

    if world.rank == 0:
        prepare(out)
    barrier()
    if prepared(out) is None and world.local_rank == 0:
        prepare(out)
    barrier()
    counts = prepared(out)
    if counts is None:
        raise UserError(f"data.path={out}: Fashion-MNIST was not written (see rank 0's error)")
    return counts
