"""Tar shards in the webdataset layout: static per-node shards, an optional decoded-image cache.

Layout (``scaleout data make-image-shards IMAGEFOLDER OUT --shard-mb N`` writes it; any webdataset
shards with the same naming read too)::

    <out>/classes.txt              class names, one a line, in label order (optional)
    <out>/train-000000.tar ...     members <key>.jpg (the encoded image) + <key>.cls (its label,
    <out>/val-000000.tar ...       decimal text), the two members of a sample next to each other

Shards are numbered from 000000 without gaps. A sample's global index is its position in shard
order. The member index (per sample: shard, byte offset and size of the image, label) is built
lazily and cached like the ImageFolder index (scaleout/families/resnet/data/index.py): rank 0 reads
the tar headers once, every other rank reads the one index file; ``make-image-shards`` writes it
as it writes the shards. Its name hashes ``<split>-000000.tar``'s mtime and size (one ``stat``).

**Static per-node shards** (:class:`NodeShardSampler`): node n of N reads only the shards i with
``i % N == n``, so a node's page cache (and its decoded cache) holds its own part of the set, as
NVIDIA's DALI readers do with ``shard_id``/``stick_to_shard``. The node's ranks draw from one
per-node stream: the concatenation of per-epoch permutations of the node's samples, seeded (seed,
epoch, node); each step takes the next B/N samples of it (B = global batch), local rank l the l-th
slice. With balanced nodes (every node's shards hold num_samples/N samples) every sample is drawn
exactly once per epoch across the nodes; otherwise each node covers its own samples exactly once per
node-epoch and the nodes' epochs drift apart by the imbalance (the task reports it).
"""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

from scaleout.data.sampler import ShardedSampler
from scaleout.errors import UserError
from scaleout.families.resnet.data.folder import EXTENSIONS, ImageFolder
from scaleout.families.resnet.data.index import (
    index_dir,
    index_path,
    load_or_build,
    pack_strings,
)

IMAGE_SUFFIXES = tuple(e.lstrip(".") for e in EXTENSIONS)


def shard_name(split: str, i: int) -> str:
    return f"{split}-{i:06d}.tar"


def has_shards(root: str | os.PathLike[str], split: str = "train") -> bool:
    return (Path(root) / shard_name(split, 0)).is_file()


def read_classes(root: Path) -> list[str] | None:
    f = root / "classes.txt"
    return [c for c in f.read_text().splitlines() if c] if f.is_file() else None


def index_shards(root: Path, split: str) -> dict[str, np.ndarray]:
    """Read every shard's tar headers (and its .cls members): the member index of ``split``."""
    shard, offset, size, label = [], [], [], []
    i = 0
    while (root / shard_name(split, i)).is_file():
        path = root / shard_name(split, i)
        pending: dict[str, list] = {}
        try:
            with tarfile.open(path, "r:") as tar:
                for m in tar:
                    if not m.isfile():
                        continue
                    base = m.name.rsplit("/", 1)[-1]
                    key, _, ext = base.partition(".")
                    entry = pending.setdefault(key, [None, None, None])
                    if ext.lower() in IMAGE_SUFFIXES:
                        entry[0], entry[1] = m.offset_data, m.size
                    elif ext == "cls":
                        entry[2] = int(tar.extractfile(m).read().decode().strip())  # type: ignore[union-attr]
        except (tarfile.TarError, ValueError) as exc:
            raise UserError(
                f"data.path={root}: {path.name} is not a readable shard ({exc})"
            ) from exc
        for key, (off, n, cls) in pending.items():
            if off is None or cls is None:
                raise UserError(
                    f"data.path={root}: {path.name} sample {key!r} lacks its "
                    f"{'image' if off is None else '.cls label'}; expected <key>.jpg + <key>.cls"
                )
            shard.append(i)
            offset.append(off)
            size.append(n)
            label.append(cls)
        i += 1
    if not shard:
        raise UserError(
            f"data.path={root}: no samples in {shard_name(split, 0)}...; expected <key>.jpg + "
            "<key>.cls members"
        )
    return member_arrays(root, np.array(shard), np.array(offset), np.array(size), np.array(label))


def member_arrays(
    root: Path, shard: np.ndarray, offset: np.ndarray, size: np.ndarray, label: np.ndarray
) -> dict[str, np.ndarray]:
    classes = read_classes(root) or [str(c) for c in range(int(label.max()) + 1)]
    if label.min() < 0 or label.max() >= len(classes):
        raise UserError(
            f"data.path={root}: a .cls label is {int(label.max())}; expected 0..{len(classes) - 1} "
            "(classes.txt)"
        )
    fblob, foffsets = pack_strings(classes)
    return {
        "shard": shard.astype(np.int32),
        "offset": offset.astype(np.int64),
        "size": size.astype(np.int64),
        "folder": label.astype(np.int32),
        "folders": fblob,
        "folder_offsets": foffsets,
    }


class ShardImages(ImageFolder):
    """The images of ``<root>/<split>-NNNNNN.tar`` (see module docstring); decode, augmentation,
    labels and checks are ImageFolder's."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._files: dict[int, int] = {}

    def _locate(self) -> Path:
        """The split's first shard (its existence is the one check before the lazy index)."""
        first = self.root / shard_name(self.split, 0)
        if not first.is_file():
            raise UserError(
                f"data.path={self.root}: no {shard_name(self.split, 0)}; expected "
                f"{self.root}/{self.split}-000000.tar ... (scaleout data make-image-shards)"
            )
        return first

    def _ensure(self) -> dict[str, np.ndarray]:
        if self._index is None:
            path = index_path(
                index_dir(self.root, self.index_root), f"{self.split}-shards", self.base
            )
            self._index = self._check(load_or_build(path, self._list, self.rank))
        return self._index

    def _list(self) -> dict[str, np.ndarray]:
        return index_shards(self.root, self.split)

    @property
    def shard_of(self) -> np.ndarray:
        """The shard of every sample."""
        return self._ensure()["shard"]

    def path(self, i: int) -> str:
        return f"{self.root / shard_name(self.split, int(self.shard_of[i]))}#{i}"

    def _open(self, i: int) -> io.BytesIO:
        a = self._ensure()
        s = int(a["shard"][i])
        fd = self._files.get(s)
        if fd is None:
            fd = self._files[s] = os.open(self.root / shard_name(self.split, s), os.O_RDONLY)
        return io.BytesIO(os.pread(fd, int(a["size"][i]), int(a["offset"][i])))

    def __getstate__(self) -> dict:
        state = dict(super().__getstate__())
        state["_files"] = {}  # file descriptors stay in the process that opened them
        return state


class NodeShardSampler(ShardedSampler):
    """:class:`ShardedSampler`'s interface over static per-node shards (see module docstring).

    ``node`` of ``num_nodes``; ``local`` of ``local_size`` ranks on the node. Stateless apart from
    caches: the data position is the only state, as for ShardedSampler."""

    def __init__(
        self,
        images: ShardImages,
        num_samples: int,
        global_batch: int,
        rank: int,
        world_size: int,
        node: int,
        num_nodes: int,
        local: int,
        local_size: int,
        seed: int = 0,
    ):
        super().__init__(num_samples, global_batch, rank, world_size, seed)
        if num_nodes * local_size != world_size:
            raise UserError(
                f"per-node shards need the same number of ranks on every node, got {num_nodes} "
                f"nodes x {local_size} ranks != world size {world_size}"
            )
        self.images, self.node, self.num_nodes = images, node, num_nodes
        self.local, self.local_size = local, local_size
        self._mine: np.ndarray | None = None

    def node_samples(self, node: int | None = None) -> np.ndarray:
        """The samples of the shards ``i % num_nodes == node`` (default: this rank's node)."""
        node = self.node if node is None else node
        if node == self.node and self._mine is not None:
            return self._mine
        shard = self.images.shard_of
        mine = np.flatnonzero(shard % self.num_nodes == node)
        if len(mine) == 0:
            raise UserError(
                f"data.path={self.images.root}: {int(shard.max()) + 1} shards for {self.num_nodes}"
                f" nodes leave node {node} none; expected at least one shard per node "
                "(make-image-shards with a smaller --shard-mb)"
            )
        if node == self.node:
            self._mine = mine
        return mine

    def node_order(self, epoch: int, node: int | None = None) -> np.ndarray:
        node = self.node if node is None else node
        if node == self.node and self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        mine = self.node_samples(node)
        order = mine[np.random.default_rng([self.seed, epoch, node]).permutation(len(mine))]
        if node == self.node:
            self._cache = (epoch, order)
        return order

    def _node_stream(self, node: int, start: int, count: int) -> np.ndarray:
        n = len(self.node_samples(node))
        out, pos = [], start
        while pos < start + count:
            epoch, off = divmod(pos, n)
            take = min(n - off, start + count - pos)
            out.append(self.node_order(epoch, node)[off : off + take])
            pos += take
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def local_indices(self, position: int) -> np.ndarray:
        if position < 0:
            raise UserError(f"data position {position} must be >= 0")
        q = position // self.num_nodes + self.local * self.local_batch
        return self._node_stream(self.node, q, self.local_batch)

    def global_indices(self, position: int) -> np.ndarray:
        """Every rank's samples of the global batch at ``position``, in rank order of (node,
        local rank)."""
        per_node = self.global_batch // self.num_nodes
        return np.concatenate(
            [
                self._node_stream(n, position // self.num_nodes, per_node)
                for n in range(self.num_nodes)
            ]
        )

    def positions_to_indices(self, start: int, count: int) -> np.ndarray:
        raise NotImplementedError("per-node shards have no single global stream")


def write_shards(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    shard_mb: float,
    splits: tuple[str, ...] = ("train", "val"),
    progress=print,
) -> dict[str, dict[str, int]]:
    """An ImageFolder (``src/<split>/<class>/<image>``) as tar shards in ``out`` (module docstring)
    of about ``shard_mb`` MB each, with their member index. Train's classes label every split."""
    src, out = Path(src), Path(out)
    if shard_mb <= 0:
        raise UserError(f"--shard-mb {shard_mb}: expected a size in MB > 0")
    train = ImageFolder(src, "train")
    classes = train.classes  # lists src (a bad source fails here, before out is created)
    out.mkdir(parents=True, exist_ok=True)
    (out / ".scaleout-index").mkdir(exist_ok=True)  # before any index name hashes out's files
    (out / "classes.txt").write_text("".join(f"{c}\n" for c in classes))
    summary = {}
    for split in splits:
        if not (src / split).is_dir():
            continue
        images = train if split == "train" else ImageFolder(src, split, classes_from=train)
        n, limit = len(images), shard_mb * 1e6
        shard, offset, size = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64)
        s, used, tar = 0, 0, None
        for i in range(n):
            path = images.path(i)
            nbytes = os.path.getsize(path)
            if tar is not None and used + nbytes > limit:
                tar.close()
                s, used, tar = s + 1, 0, None
            if tar is None:
                tar = tarfile.open(out / shard_name(split, s), "w", format=tarfile.USTAR_FORMAT)
            key = f"{i:08d}"
            ext = Path(path).suffix.lower().lstrip(".")
            ext = "jpg" if ext in ("jpeg", "jpg") else ext
            info = tar.gettarinfo(path, arcname=f"{key}.{ext}")
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with open(path, "rb") as f:
                tar.addfile(info, f)
            shard[i], size[i] = s, nbytes
            offset[i] = tar.offset - _padded(nbytes)  # the data block just written
            label = f"{int(images.labels[i])}".encode()
            cls = tarfile.TarInfo(f"{key}.cls")
            cls.size, cls.mtime = len(label), int(info.mtime)
            tar.addfile(cls, io.BytesIO(label))
            used += nbytes + 2048
            if (i + 1) % 10000 == 0:
                progress(f"{split}: {i + 1}/{n} images, {s + 1} shards")
        if tar is not None:
            tar.close()
        for stale in range(s + 1, s + 1 + 10**6):  # shards of an earlier, bigger run
            old = out / shard_name(split, stale)
            if not old.is_file():
                break
            old.unlink()
        arrays = member_arrays(out, shard, offset, size, images.labels)
        path = index_path(index_dir(out, None), f"{split}-shards", out / shard_name(split, 0))
        load_or_build(path, lambda a=arrays: a, rank=0)
        summary[split] = {"images": n, "shards": s + 1}
        progress(f"{split}: {n} images in {s + 1} shards")
    return summary


def _padded(n: int) -> int:
    return -(-n // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
