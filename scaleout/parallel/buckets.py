"""Gradient buckets: fixed at wrap time, one flat contiguous buffer each, gradients as views into
it.

Assignment follows the DDP paper (Li et al., VLDB 2020, sec. 3.2.3): parameters are taken in
*reverse* ``model.parameters()`` order, because backward produces gradients roughly from the last
layer to the first, so the first bucket fills first and its all-reduce starts earliest. A bucket is
closed once it holds at least ``cap_bytes`` (DDP's ``bucket_cap_mb`` semantics: a bucket may exceed
the cap by one parameter; a parameter larger than the cap gets a bucket of its own). 25 MiB is the
DDP paper's default (fig. 7: larger buckets amortise per-collective latency, smaller ones start
communication earlier). Buckets never mix dtypes or devices: one buffer is one collective.

Each parameter's ``.grad`` is made a view into its bucket (DDP's ``gradient_as_bucket_view``), so
autograd accumulates straight into the buffer that is all-reduced: no copy in, no copy out.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from scaleout.errors import UserError

if TYPE_CHECKING:
    import torch

FINGERPRINT_BITS = 24  # an exact float32 integer: it rides in the step's float32 agreement
MiB = 1 << 20


@dataclass
class Slot:
    """Where one parameter's gradient lives: ``bucket.buffer[offset:offset + numel]``."""

    index: int  # position in the wrapped module's parameter list (the registration order)
    name: str
    param: torch.nn.Parameter
    bucket: int
    offset: int
    numel: int
    view: torch.Tensor = field(repr=False, default=None)  # type: ignore[assignment]


@dataclass
class Bucket:
    index: int
    buffer: torch.Tensor  # 1-D, contiguous, the parameters' dtype
    slots: list[Slot]
    extra: int = 0  # trailing elements after the gradients (the parameter usage, last bucket)
    rider: int = 0  # of which the last ``rider`` carry a caller's values (Reducer.ride)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @property
    def grads(self) -> torch.Tensor:
        """The gradient part of the buffer (without the trailing usage)."""
        return self.buffer.narrow(0, 0, self.buffer.numel() - self.extra)


def assign(
    sizes_bytes: list[int], keys: list[object], cap_bytes: int, first_cap_bytes: int | None = None
) -> list[list[int]]:
    """Group indices (already in bucket-filling order) into buckets of >= ``cap_bytes`` (the
    first bucket of each key: ``first_cap_bytes``); never mix keys."""
    if cap_bytes <= 0:
        raise UserError(f"bucket size {cap_bytes} bytes: expected a positive bucket_mb")
    out: list[list[int]] = []
    open_: dict[object, tuple[list[int], int]] = {}
    closed: set[object] = set()
    for i, (size, key) in enumerate(zip(sizes_bytes, keys, strict=True)):
        members, total = open_.get(key, ([], 0))
        members.append(i)
        total += size
        cap = cap_bytes if key in closed or first_cap_bytes is None else first_cap_bytes
        if total >= cap:
            out.append(members)
            open_.pop(key, None)
            closed.add(key)
        else:
            open_[key] = (members, total)
    out.extend(members for members, _ in open_.values())
    # Buckets are launched in index order; order them by their first (= latest-layer) parameter.
    out.sort(key=lambda b: b[0])
    return out


def fuse(sizes_bytes: list[int], cap_bytes: int) -> list[list[int]]:
    """Horovod's tensor fusion (docs/tensor-fusion.rst), the other bucketing rule: consecutive runs
    of
    *at most* ``cap_bytes`` (a tensor larger than that travels alone; ``cap_bytes`` 0: each alone),
    where
    :func:`assign` closes a bucket once it holds *at least* the cap. Fusion packs what is ready in
    one
    negotiation cycle, so the cap bounds the buffers in flight; DDP's buckets are fixed at wrap
    time."""
    out: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for i, size in enumerate(sizes_bytes):
        if cur and total + size > cap_bytes:
            out.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += size
    if cur:
        out.append(cur)
    return out


def grad_view(buf: torch.Tensor, offset: int, p: torch.Tensor) -> torch.Tensor:
    """``p``'s gradient slot in ``buf`` at ``offset``: with ``p``'s own strides when ``p`` is
    dense (a channels_last convolution weight gets a channels_last gradient, so AccumulateGrad
    and the optimizer's foreach kernels see matching layouts instead of a strided copy; torch
    DDP's bucket views do the same), else row-major."""
    if not p.is_contiguous() and _dense(p):
        return buf.as_strided(p.shape, p.stride(), buf.storage_offset() + offset)
    return buf.narrow(0, offset, p.numel()).view(p.shape)


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: its strides are a permutation of a row-major layout's."""
    expect = 1
    for d in sorted(range(t.dim()), key=t.stride):
        if t.size(d) != 1 and t.stride(d) != expect:
            return False
        expect *= t.size(d)
    return True


def build_buckets(
    named_params: list[tuple[str, torch.nn.Parameter]],
    bucket_mb: float,
    usage: int = 0,
    first_bucket_mb: float | None = None,
    order: list[int] | None = None,
    rider: int = 0,
) -> tuple[list[Bucket], list[Slot]]:
    """Buckets over the parameters that require grad, in reverse order; ``usage`` extra elements
    are appended to the last bucket (see :mod:`scaleout.parallel.reducer`). ``first_bucket_mb``
    caps the first bucket separately (torch DDP uses 1 MiB, ``dist._DEFAULT_FIRST_BUCKET_BYTES``,
    so that the first all-reduce starts after the last layer's gradients instead of after 25 MiB
    of them). ``order``: parameter indices in bucket-filling order (default: reverse registration
    order). ``rider``: further elements after the usage, for a caller's own values
    (:meth:`scaleout.parallel.reducer.Reducer.ride`)."""
    import torch  # a torch-free module at import: the simulator and the schema read it

    if not isinstance(bucket_mb, (int, float)) or bucket_mb <= 0:
        raise UserError(
            f"bucket_mb={bucket_mb!r}: expected a positive number of MiB (default 25, the DDP "
            "paper's)"
        )
    if first_bucket_mb is not None and (
        not isinstance(first_bucket_mb, (int, float)) or first_bucket_mb <= 0
    ):
        raise UserError(
            f"first_bucket_mb={first_bucket_mb!r}: expected a positive number of MiB or None"
        )
    params = [(i, n, p) for i, (n, p) in enumerate(named_params) if p.requires_grad]
    if not params:
        raise UserError("DataParallel: the model has no parameters that require gradients")
    for _, n, p in params:
        if not p.is_floating_point():
            raise UserError(
                f"parameter {n!r} has dtype {p.dtype}: gradients to all-reduce must be floating "
                "point"
            )
    if order is None:
        order = params[::-1]
    else:
        by_index = {i: (i, n, p) for i, n, p in params}
        if sorted(order) != sorted(by_index):
            raise UserError(
                f"bucket order {order}: expected each of the parameter indices {sorted(by_index)} "
                "once"
            )
        order = [by_index[i] for i in order]
    groups = assign(
        [p.numel() * p.element_size() for _, _, p in order],
        [(p.dtype, p.device) for _, _, p in order],
        max(1, int(bucket_mb * MiB)),
        max(1, int(first_bucket_mb * MiB)) if first_bucket_mb is not None else None,
    )
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    for b, members in enumerate(groups):
        first = order[members[0]][2]
        last = b == len(groups) - 1
        extra = usage + rider if last else 0
        total = sum(order[m][2].numel() for m in members)
        buf = torch.zeros(total + extra, dtype=first.dtype, device=first.device)
        bucket_slots = []
        off = 0
        for m in members:
            idx, name, p = order[m]
            s = Slot(idx, name, p, b, off, p.numel())
            s.view = grad_view(buf, off, p)
            off += p.numel()
            bucket_slots.append(s)
        buckets.append(Bucket(b, buf, bucket_slots, extra, rider if last else 0))
        slots.extend(bucket_slots)
    return buckets, slots


# -- the fingerprint of a step's gradient collectives (scaleout/train/skew.py)
def fingerprint(count: int, nbytes: int, layout: int) -> int:
    """The step's collectives as a 24-bit value: bucket collectives, their bytes, the layout
    hash (deterministic across processes: crc32, not Python's salted ``hash``)."""
    return zlib.crc32(f"{count}:{nbytes}:{layout}".encode()) & ((1 << FINGERPRINT_BITS) - 1)


def fold(fp: int, value: int) -> int:
    """``fp`` with ``value`` folded in, still a 24-bit fingerprint (the trainer folds in the steps
    skipped so far: a rank that skipped alone then differs from its peers)."""
    return zlib.crc32(f"{fp}:{value}".encode()) & ((1 << FINGERPRINT_BITS) - 1)


def layout_hash(buckets: Iterable[Iterable[Any]]) -> int:
    """crc32 of a bucket layout given as one iterable of items per bucket (parameter names,
    shapes, dtype), in launch order: equal models wrapped equally give equal hashes."""
    h = 0
    for b, items in enumerate(buckets):
        h = zlib.crc32(f"{b}:{'|'.join(map(str, items))};".encode(), h)
    return h


def bucket_layout(buckets: list[Bucket]) -> list[list[str]]:
    """Each bucket's dtype, length and (name, shape) of its parameters, for :func:`layout_hash`."""
    return [
        [f"{b.buffer.dtype}x{b.buffer.numel()}"]
        + [f"{s.name}{tuple(s.param.shape)}" for s in b.slots]
        for b in buckets
    ]
