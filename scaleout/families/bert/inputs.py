"""The files a BERT run reads, sniffed before anything is written or spawned
(``Family.check_input_files``, called by scaleout/train/inputs.py):

* ``model.init_checkpoint``: read as the BERT loader reads it (memory-mapped: names and shapes, no
  tensor data), so a non-torch file or a torch-saved non-state-dict is refused here.
* ``data.path`` (``data.source: wikipedia``): the first shard of each folder must carry its
  format's signature (HDF5, or zip for .npz). One file per folder, not every shard: a start stays
  O(1) file-system calls per rank.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from scaleout.errors import UserError

NPZ_SIGNATURE = b"PK\x03\x04"  # .npz is a zip archive


def check_input_files(cfg: Any) -> None:
    d, b = cfg.data, cfg.model.bert
    # settings a rank would refuse after spawning (BertTask, the shard loader): refused here first
    if d.max_seq_len > b.max_position:
        raise UserError(
            f"data.max_seq_len={d.max_seq_len} exceeds model.bert.max_position={b.max_position}"
        )
    if d.source == "wikipedia" and not d.path:
        raise UserError("data.source=wikipedia needs data.path (a directory of MLPerf BERT shards)")
    if cfg.model.init_checkpoint:
        from scaleout.families.bert.convert import read_state_dict  # deferred: torch

        read_state_dict(cfg.model.init_checkpoint)
    if cfg.data.source == "wikipedia" and cfg.data.path:
        check_shard_path(cfg.data.path)


def check_shard_path(path: str) -> None:
    """The first shard of ``path`` (or of its train/ and eval/ folders) is a readable shard
    file."""
    from scaleout.families.bert.data.shard_format import (  # deferred: numpy
        ShardReader,
        h5py_module,
    )

    root = Path(path)
    split = (root / "train").is_dir() and (root / "eval").is_dir()
    for folder in (root / "train", root / "eval") if split else (root,):
        first = first_shard(folder)
        if first.suffix == ".npz":
            with open(first, "rb") as f:
                ok, kind = f.read(len(NPZ_SIGNATURE)) == NPZ_SIGNATURE, "a .npz (zip)"
        else:
            ok, kind = h5py_module().is_hdf5(str(first)), "an HDF5"
        if not ok:
            raise UserError(
                f"data.path={path}: {first} is not {kind} file; expected MLPerf BERT shards "
                "(.hdf5/.h5/.hdf, or .npz; docs/training-blocks.md)"
            )
        # the signature is not the content: open it as a rank will (the zip's directory, the
        # HDF5 datasets' names), so a torn archive or foreign datasets fail here, not in a rank
        ShardReader(first).close()


def first_shard(path: Path) -> Path:
    """``path`` itself (a shard file) or its first shard by name, from one directory scan: the
    entries' types come with the scan (no stat per shard), so a folder of 4,320 shards costs the
    same few calls as one of 4 (``shard_format.shard_files`` stats every entry)."""
    from scaleout.families.bert.data.shard_format import SUFFIXES, shard_files  # deferred: numpy

    if not path.is_dir():
        return shard_files(path)[0]  # a file, or the one-line error for a missing path
    with os.scandir(path) as entries:
        names = [e.name for e in entries if Path(e.name).suffix in SUFFIXES and e.is_file()]
    if not names:
        raise UserError(f"data.path={path} has no {'/'.join(SUFFIXES)} shards")
    return path / min(names)
