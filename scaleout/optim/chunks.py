"""Cache-blocked multi-tensor application: the CPU analogue of apex's ``multi_tensor_apply``.

A ``torch._foreach_*`` op applies one elementwise op to every tensor of a list. On CUDA one launch
covers the whole list, so the optimizers hand it whole tensors. On CPU every op is a full pass over
memory, and an optimizer step that chains 8-12 ops over 110 M parameters re-reads each array from
DRAM every time. apex splits tensors into 65536-element chunks for its kernels; we do the same one
level up: the flattened tensors are cut into pieces and grouped into chunks of about ``chunk``
elements, and the whole chain of foreach ops runs on one chunk (a list of views) before moving to
the next, so all but the first touch of each array hit the cache. The chunk size comes from the
cache sizes the machine reports (:func:`cpu_chunk`): machines of this kind differ (an AMD EPYC with
1 MiB L2 per core and 32 MiB L3, an Intel Sapphire Rapids with 2 MiB L2 and 105 MiB L3). The Python
loop is over chunks (~400 for BERT-base), never over parameters; ``split`` builds all pieces of a
tensor in one call.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

SYSFS_CACHE = "/sys/devices/system/cpu/cpu0/cache"
# fp32 arrays one LAMB chunk keeps hot between its foreach ops: w, g, m, v, the kept update u, and
# the two temporaries of direction() (sqrt(v) + eps, then m / that). lamb.py's phase 1 touches all
# of them per chunk.
LAMB_ARRAYS = 7
# Below 2**16 elements the per-call cost of a foreach op (a few us, paid ~14 times per chunk)
# dominates: measured on BERT-base shapes with `scaleout bench optim --chunks` (docs/optim.md),
# whatever the caches.
MIN_CPU_CHUNK = 1 << 16
# When the machine reports no cache sizes: the size measured best on the development machine (AMD
# EPYC, 1 MiB L2 per core, 32 MiB L3; 2**17..2**19 within noise there).
FALLBACK_CPU_CHUNK = 1 << 18
_SIZE = re.compile(r"^(\d+)\s*([KMG]?)B?$", re.IGNORECASE)


def _cpus(cpu_list: str) -> int:
    """Number of CPUs in a sysfs list such as "0-3,8,10-11"."""
    n = 0
    for part in filter(None, cpu_list.strip().split(",")):
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    return max(n, 1)


def cache_levels(sysfs: str | os.PathLike[str] = SYSFS_CACHE) -> dict[int, tuple[int, int]]:
    """{level: (bytes, CPUs sharing it)} of the data and unified caches CPU 0 reports (Linux sysfs
    ``cache/index*/{level,type,size,shared_cpu_list}``); {} where there is no such directory."""
    out: dict[int, tuple[int, int]] = {}
    for d in sorted(Path(sysfs).glob("index*")):
        try:
            kind = (d / "type").read_text().strip()
            level = int((d / "level").read_text())
            m = _SIZE.match((d / "size").read_text().strip())
            shared = (
                (d / "shared_cpu_list").read_text() if (d / "shared_cpu_list").exists() else "0"
            )
        except (OSError, ValueError):
            continue
        if kind == "Instruction" or m is None:
            continue
        out[level] = (
            int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()],
            _cpus(shared),
        )
    return out


def chunk_for_caches(
    levels: dict[int, tuple[int, int]], elem_bytes: int = 4, arrays: int = LAMB_ARRAYS
) -> int:
    """Elements per chunk: the largest power of two whose ``arrays`` arrays fit this CPU's share
    of its L2 and larger caches (each level's size / the CPUs sharing it), at least
    MIN_CPU_CHUNK. L1 is left out: no chunk worth its per-op cost fits there. No level 2+ cache
    reported: FALLBACK_CPU_CHUNK."""
    budget = sum(size // shared for level, (size, shared) in levels.items() if level >= 2)
    if budget <= 0:
        return FALLBACK_CPU_CHUNK
    fit = budget // (arrays * elem_bytes)
    return max(MIN_CPU_CHUNK, 1 << (fit.bit_length() - 1) if fit else 0)


@functools.cache
def cpu_chunk() -> int:
    """The chunk size for this machine's caches (read once per process)."""
    return chunk_for_caches(cache_levels())


def default_chunk(device: torch.device) -> int | None:
    """Chunk size for tensors on ``device``: cache-sized on CPU, whole tensors (None) on
    accelerators."""
    return cpu_chunk() if device.type == "cpu" else None


@dataclass(frozen=True)
class ChunkPlan:
    """How tensors of the given sizes are cut into pieces and grouped into chunks.

    ``sizes[i]`` are the piece lengths of tensor i (in order, summing to its numel); ``bounds[c]``
    is the [start, end) range of chunk c in the concatenated piece list; ``owner[c]`` gives, for
    each piece of chunk c, the index of the tensor it came from (for per-tensor norms).
    """

    numels: tuple[int, ...]
    sizes: tuple[tuple[int, ...], ...]
    bounds: tuple[tuple[int, int], ...]
    owner: tuple[torch.Tensor, ...]

    @property
    def num_chunks(self) -> int:
        return len(self.bounds)


def plan_chunks(
    numels: Sequence[int],
    chunk: int | None,
    splittable: Sequence[bool] | None = None,
    device: torch.device | str = "cpu",
) -> ChunkPlan:
    """Greedy packing of tensors (in order) into chunks of about ``chunk`` elements.

    ``chunk=None`` puts every tensor whole into one chunk (the accelerator layout). A tensor that is
    not ``splittable`` (non-contiguous parameter) stays whole, possibly making its chunk larger.
    """
    numels = tuple(int(n) for n in numels)
    if chunk is None:
        owner = torch.arange(len(numels), device=device)
        return ChunkPlan(
            numels,
            tuple((n,) for n in numels),
            ((0, len(numels)),) if numels else (),
            (owner,) if numels else (),
        )
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1")
    sizes: list[tuple[int, ...]] = []
    bounds: list[tuple[int, int]] = []
    owners: list[list[int]] = []
    cur: list[int] = []
    fill = 0
    start = 0
    npieces = 0
    for i, n in enumerate(numels):
        mine: list[int] = []
        if splittable is not None and not splittable[i]:
            cuts = [n]
        else:
            cuts = []
            left = n
            room = chunk - fill
            while left > 0:
                take = min(left, room)
                cuts.append(take)
                left -= take
                room = chunk
        for k, take in enumerate(cuts):
            mine.append(take)
            cur.append(i)
            npieces += 1
            fill += take
            last = k == len(cuts) - 1
            if fill >= chunk or (not last):
                bounds.append((start, npieces))
                owners.append(cur)
                start, cur, fill = npieces, [], 0
        sizes.append(tuple(mine) if mine else (0,))
        if not cuts:  # an empty tensor still gets one (empty) piece so lists stay aligned
            cur.append(i)
            npieces += 1
    if cur:
        bounds.append((start, npieces))
        owners.append(cur)
    return ChunkPlan(
        numels,
        tuple(sizes),
        tuple(bounds),
        tuple(torch.tensor(o, dtype=torch.long, device=device) for o in owners),
    )


def pieces(tensors: Sequence[torch.Tensor], plan: ChunkPlan) -> list[list[torch.Tensor]]:
    """Views of ``tensors`` cut as ``plan`` says, grouped by chunk.

    A tensor kept whole is passed as is (any shape and strides); split tensors are flattened, which
    needs a contiguous tensor for the in-place targets (parameters and state; the planner knows) and
    makes a contiguous copy of a read-only input such as a non-contiguous gradient.
    """
    flat: list[torch.Tensor] = []
    for t, sz in zip(tensors, plan.sizes, strict=True):
        if len(sz) == 1:
            flat.append(t)
        else:
            flat.extend(t.reshape(-1).split(sz))
    return [flat[a:b] for a, b in plan.bounds]
