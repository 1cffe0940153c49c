"""Deterministic, rank-sharded, resumable sample order for data-parallel training.

The global sample stream is the concatenation of per-epoch permutations (epoch e shuffled with the
seed (seed, e)), so it is the same on every rank without communication. Step s consumes the global
positions [s*B, (s+1)*B) of that stream (B = global batch); rank r takes the contiguous slice
[r*B/W, (r+1)*B/W) of it. The only state is the *data position* (global samples consumed), an
integer the checkpoint stores: resuming at position p continues exactly where an uninterrupted run
would be. A global batch may straddle an epoch boundary; nothing is dropped or repeated.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from scaleout.errors import ConfigError, UserError


class ShardedSampler:
    def __init__(
        self,
        num_samples: int,
        global_batch: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ):
        if num_samples < 1:
            raise UserError(
                f"the data set is empty (num_samples={num_samples}); expected at least one sample"
            )
        if world_size < 1 or not 0 <= rank < world_size:
            raise UserError(f"rank {rank} is not in a world of size {world_size}")
        if global_batch % world_size:
            raise ConfigError(
                f"train.global_batch={global_batch} must be divisible by the world size "
                f"{world_size}"
            )
        self.num_samples, self.global_batch = num_samples, global_batch
        self.rank, self.world_size = rank, world_size
        self.local_batch = global_batch // world_size
        self.seed, self.shuffle = seed, shuffle
        self._cache: tuple[int, np.ndarray] | None = None

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The permutation of epoch ``epoch`` (identity when shuffle is off)."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        else:
            order = np.arange(self.num_samples)
        self._cache = (epoch, order)
        return order

    def positions_to_indices(self, start: int, count: int) -> np.ndarray:
        """Sample indices at global stream positions [start, start + count)."""
        out, pos = [], start
        while pos < start + count:
            epoch, off = divmod(pos, self.num_samples)
            take = min(self.num_samples - off, start + count - pos)
            out.append(self.epoch_order(epoch)[off : off + take])
            pos += take
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def local_indices(self, position: int) -> np.ndarray:
        """This rank's share of the global batch that starts at data position ``position``."""
        if position < 0:
            raise UserError(f"data position {position} must be >= 0")
        return self.positions_to_indices(position + self.rank * self.local_batch, self.local_batch)

    def global_indices(self, position: int) -> np.ndarray:
        return self.positions_to_indices(position, self.global_batch)

    def epoch(self, position: int) -> float:
        return position / self.num_samples

    def iterate(self, position: int = 0) -> Iterator[tuple[int, np.ndarray]]:
        """Yield (data position after this batch, local indices) forever, starting at
        ``position``."""
        while True:
            idx = self.local_indices(position)
            position += self.global_batch
            yield position, idx
