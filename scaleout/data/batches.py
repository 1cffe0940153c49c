"""Data-only builders of a rank's per-step micro-batches on the CPU: no model, no ``World``, no
process groups, so they pickle cheaply. A task (scaleout/families/task.py) keeps one as
``task.batches``; the prefetch workers (scaleout/train/prefetch.py) receive exactly that object. The
generic pieces are here; each family's builder lives in its folder
(scaleout/families/bert/data/batches.py, scaleout/families/resnet/data/). Data order is a pure
function of the data position (global samples consumed), so a checkpoint only stores that integer
and resume is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class MicroBatch:
    inputs: Any  # what the model takes
    target: Any  # labels (None when the model computes its own loss)
    samples: int  # sequences / images in it (BERT: sequences, not packed rows)
    tokens: int  # real (non-pad) tokens; images count 0
    # training FLOPs of this micro-batch (counted where it is built: never a device read)
    flops: float = 0.0


def no_flops(_batch: Any) -> float:
    return 0.0


def to_device(x: Any, device: torch.device) -> Any:
    """Tensors in ``x`` (nested dicts, lists, tuples) on ``device``, copied asynchronously. To a
    CUDA device, host tensors in pageable memory are pinned first: a copy from pageable memory is
    a synchronous staging copy (the driver may wait for the stream), one from pinned memory an
    asynchronous DMA (the prefetcher's batches come pinned already)."""
    if isinstance(x, torch.Tensor):
        if torch.device(device).type == "cuda" and x.device.type == "cpu" and not x.is_pinned():
            x = x.pin_memory()
        return x.to(device, non_blocking=True)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(to_device(v, device) for v in x)
    return x
