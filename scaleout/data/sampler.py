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
from typing import Any

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
        self.epoch_len = num_samples  # stream positions per epoch (every sample once)
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
            epoch, off = divmod(pos, self.epoch_len)
            take = min(self.epoch_len - off, start + count - pos)
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
        return position / self.epoch_len

    def iterate(self, position: int = 0) -> Iterator[tuple[int, np.ndarray]]:
        """Yield (data position after this batch, local indices) forever, starting at
        ``position``."""
        while True:
            idx = self.local_indices(position)
            position += self.global_batch
            yield position, idx


class DistributedSamplerOrder(ShardedSampler):
    """The order a plain torch loop reads: ``DistributedSampler(shuffle=shuffle, seed=seed,
    drop_last=True)`` with ``set_epoch(e)`` before epoch ``e``, under ``DataLoader(batch_size=B/W,
    drop_last=True)`` (``data.order: torch``). Epoch ``e`` is ``torch.randperm(n)`` drawn from a
    generator seeded ``seed + e``, cut to a multiple of the world size; rank r reads every W-th
    index from r, in batches of B/W, and an epoch ends after the last full batch (what does not
    fill one is never read). As a stream: step s of the epoch holds rank 0's batch s, then rank
    1's, ...; positions stay the data position a checkpoint stores. Same batches, same order as
    the torch loop, so a comparison with it (``scaleout bench ttt``'s ablation, ``scaleout bench
    framework``) measures the framework, not a luckier order."""

    def __init__(self, *args: Any, **kwargs: Any):  # ShardedSampler's arguments
        super().__init__(*args, **kwargs)
        num_samples, global_batch, world_size = self.num_samples, self.global_batch, self.world_size
        self.steps_per_epoch = (num_samples // world_size) // self.local_batch
        if self.steps_per_epoch < 1:
            raise ConfigError(
                f"data.order=torch: {num_samples} samples give rank batches of "
                f"{num_samples // world_size} < {self.local_batch} (train.global_batch="
                f"{global_batch} / {world_size} ranks); expected at least one full batch"
            )
        self.epoch_len = self.steps_per_epoch * global_batch

    def epoch_order(self, epoch: int) -> np.ndarray:
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        import torch  # deferred: only this order draws from torch's generator

        n, w, lb = self.num_samples, self.world_size, self.local_batch
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            perm = torch.randperm(n, generator=g).numpy()
        else:
            perm = np.arange(n)
        per_rank = perm[: (n // w) * w].reshape(-1, w).T  # row r: perm[r::w]
        used = per_rank[:, : self.steps_per_epoch * lb].reshape(w, self.steps_per_epoch, lb)
        order = np.ascontiguousarray(used.transpose(1, 0, 2)).reshape(-1)  # step, rank, row
        self._cache = (epoch, order)
        return order


ORDERS = {"scaleout": ShardedSampler, "torch": DistributedSamplerOrder}


def make_sampler(
    order: str,
    num_samples: int,
    global_batch: int,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
) -> ShardedSampler:
    """The sampler of ``data.order``: ``scaleout`` (every sample once per epoch, batches may
    straddle epochs) or ``torch`` (:class:`DistributedSamplerOrder`)."""
    if order not in ORDERS:
        raise ConfigError(f"data.order={order!r}: expected one of {', '.join(ORDERS)}")
    return ORDERS[order](num_samples, global_batch, rank, world_size, seed=seed)
