"""The folders and files a run writes, checked before anything is written or spawned (the launcher's
preflight, then every rank with the input files: scaleout/train/inputs.py).

``train.output_dir`` and ``checkpoint.dir`` must be folders this user can write (or create), and
``checkpoint.dir``'s file system must have room for one checkpoint, estimated from the model's
parameter count and the optimizer's state; ``comm.timeline`` must be a file path in such a folder.
Without this, a path under a regular file or a read-only folder was a traceback from a rank after
half a minute of start-up, and a full disk was found by the first save. Each check is a stat or a
statvfs: O(1) file-system calls, nothing created.
"""

from __future__ import annotations

from scaleout.config.schema import Config
from scaleout.families import FAMILIES
from scaleout.pathcheck import check_room, check_writable_dir, check_writable_file

# Bytes of one fp32 value: weights and optimizer state are saved in fp32 (master weights).
FP32_BYTES = 4
# Optimizer state tensors per parameter: Adam-style moments (LAMB, AdamW) or one momentum buffer.
STATE_TENSORS = {"lamb": 2, "adamw": 2, "lars": 1, "sgd": 1}


def checkpoint_bytes(cfg: Config) -> int:
    """An estimate of one checkpoint's size: the weights plus the optimizer's per-parameter state
    (a sharded optimizer's shards add up to the same total on a shared file system)."""
    params = FAMILIES.get(cfg.model.arch).params(cfg)
    return params * FP32_BYTES * (1 + STATE_TENSORS.get(cfg.optim.name, 2))


def check_outputs(cfg: Config) -> None:
    """One line naming the key when a run could not write where ``cfg`` says."""
    check_writable_dir(cfg.train.output_dir, "train.output_dir")
    if cfg.checkpoint.dir:
        check_room(cfg.checkpoint.dir, checkpoint_bytes(cfg), "checkpoint.dir")
    if cfg.comm.timeline:
        check_writable_file(cfg.comm.timeline, "comm.timeline")
