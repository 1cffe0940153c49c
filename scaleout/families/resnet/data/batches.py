"""This rank's image micro-batches, built on the CPU (in the prefetcher's workers when
``data.num_workers > 0``): data only, so it pickles cheaply."""

from __future__ import annotations

from typing import Any

import numpy as np

from scaleout.data.batches import MicroBatch


class ImageBatches:
    """This rank's image micro-batches on the CPU (decode + augmentation happen here). Data only."""

    def __init__(self, images: Any, sampler: Any, rows: int):
        self.images, self.sampler, self.rows = images, sampler, rows
        self.flops_per_image = 0.0  # set by the task once the model exists

    def micro_batches(self, position: int, grad_accum: int) -> list[MicroBatch]:
        idx = self.sampler.local_indices(position)
        epoch = position // max(self.rows, 1)
        out = []
        for part in np.array_split(idx, grad_accum):
            x, y = self.images.get(part, epoch)
            out.append(MicroBatch(x, y, len(part), 0, self.flops_per_image * len(part)))
        return out
