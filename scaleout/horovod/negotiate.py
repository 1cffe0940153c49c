"""Agreeing on what every rank has queued: Horovod's coordinator and response cache on one
all-reduce.

Every round, each rank contributes one int64 vector to a MAX all-reduce on the engine's process
group::

    header: [new request?, joined?, shutdown?, join stamp, hash of the queue, stalled?]
    one entry per response-cache slot: 1 if this rank has a queued request equal to that slot (key
    and metadata), else 0

Each value x travels as the pair (x, -x), so one MAX gives both the maximum and the minimum over
ranks. A rank that has joined sends the neutral value (int64 min) for the slots it has nothing for,
so "max == min == 1" means "queued on every rank that has not joined". In the steady state (a
training loop whose tensors are all cached) a round costs one all-reduce of 16 * (6 + slots) bytes,
like Horovod's response cache (a bit-vector all-reduce), instead of a metadata exchange per tensor.

A request that is not in the cache (new name, or its shape/dtype/op/root differ from the cached
entry) makes the round a full exchange. If no rank has joined and every rank's queue hashes the same
(the usual SPMD case), each rank already holds the answer. Otherwise rank 0 gathers every queue (key
and metadata), decides, and broadcasts the decision (Horovod's coordinator): an operation is ready
when every rank that has not joined has queued it; if their metadata differ, it fails with one line
naming the field and two ranks, on every rank, instead of hanging in a collective. Decisions enter
the cache in the same order on every rank (least-recently-used eviction), so the caches never
diverge.

Keys: a named operation is ``(kind, name)``. Unnamed operations of one kind are matched by order:
the j-th queued unnamed allreduce of every rank is ``(allreduce, j)``. Resolved operations are
always a prefix of that order on every rank, so the positions stay aligned even across ``join`` and
failures (counting calls per rank, as Horovod's generated names do, would drift apart there).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

log = logging.getLogger("scaleout.horovod")

NEUTRAL = -(2**63)
NEW, JOINED, STOP, STAMP, HASH, STALLED = range(6)
HEADER = 6

Kind = Literal[
    "allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier", "timeline"
]

# What every rank must agree on, per kind: the fields of a request's ``meta``, in order.
FIELDS: dict[Kind, tuple[str, ...]] = {
    "allreduce": (
        "dtype",
        "shape",
        "op",
        "prescale_factor",
        "postscale_factor",
        "algorithm",
        "device",
    ),
    "allgather": ("dtype", "shape after the first dimension", "device"),
    "broadcast": ("dtype", "shape", "root_rank", "device"),
    "alltoall": ("dtype", "shape after the first dimension", "device"),
    "reducescatter": ("dtype", "shape", "op", "prescale_factor", "postscale_factor", "device"),
    "barrier": (),
    "timeline": ("timeline started",),
}
# Horovod refuses these while a rank has joined (a joined rank has no tensor to contribute).
NO_JOIN = ("allgather", "broadcast", "alltoall", "reducescatter")

Key = tuple  # (kind, name) or (kind, position among the unnamed of that kind)


def label(key: Key) -> str:
    kind, name = key
    return f"{kind}.{name}" if isinstance(name, str) else f"{kind}.noname#{name}"


def keyed(pending: list[Any]) -> list[tuple[Key, Any]]:
    counters: dict[str, int] = {}
    out = []
    for r in pending:
        if r.name is None:
            j = counters.get(r.kind, 0)
            counters[r.kind] = j + 1
            out.append(((r.kind, j), r))
        else:
            out.append(((r.kind, r.name), r))
    return out


def check(key: Key, metas: dict[int, tuple], any_joined: bool) -> str | None:
    """The error every rank reports for this operation, or None."""
    kind = key[0]
    ranks = sorted(metas)
    first = metas[ranks[0]]
    for r in ranks[1:]:
        if metas[r] != first:
            i = next(i for i, (a, b) in enumerate(zip(first, metas[r], strict=True)) if a != b)
            return (
                f"Mismatched {label(key)}: {FIELDS[kind][i]} {first[i]} on rank {ranks[0]} "
                f"but {metas[r][i]} on rank {r}"
            )
    if any_joined and kind in NO_JOIN:
        return (
            f"{label(key)}: {kind} is not supported while a rank has called hvd.join() "
            "(as in Horovod)"
        )
    return None


def coordinate(
    reports: list[tuple[bool, list[tuple[Key, tuple]]]],
) -> tuple[list[tuple], dict[Key, list[int]]]:
    """Rank 0's decision from every rank's (joined, queue): (resolved [(key, meta, error)], waiting
    {key: ranks that have not queued it})."""
    active = [r for r, (joined, _) in enumerate(reports) if not joined]
    any_joined = len(active) < len(reports)
    table: dict[Key, dict[int, tuple]] = {}
    for r, (_, items) in enumerate(reports):
        for key, meta in items:
            table.setdefault(key, {})[r] = meta
    resolved, waiting = [], {}
    for key, metas in table.items():
        missing = [r for r in active if r not in metas]
        if missing:
            waiting[key] = missing
        else:
            resolved.append((key, metas[min(metas)], check(key, metas, any_joined)))
    return resolved, waiting


class ResponseCache:
    """Slots of (key, metadata) that every rank holds identically (updated only from agreed
    decisions)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.slots: list[tuple[Key, tuple]] = []
        self.index: dict[Key, int] = {}
        self.used: list[int] = []

    def lookup(self, key: Key, meta: tuple) -> int | None:
        i = self.index.get(key)
        return i if i is not None and self.slots[i][1] == meta else None

    def put(self, key: Key, meta: tuple, now: int) -> None:
        if self.capacity <= 0:
            return
        i = self.index.get(key)
        if i is None:
            if len(self.slots) < self.capacity:
                i = len(self.slots)
                self.slots.append((key, meta))
                self.used.append(now)
            else:  # least recently used; ties -> lowest slot, the same choice on every rank
                i = min(range(len(self.slots)), key=self.used.__getitem__)
                del self.index[self.slots[i][0]]
            self.index[key] = i
        self.slots[i] = (key, meta)
        self.used[i] = now


@dataclass
class Outcome:
    resolved: list[
        tuple[Key, tuple, str | None, Any]
    ]  # (key, meta, error, this rank's request or None)
    stop: bool = False
    all_joined: bool = False
    last_joined: int = -1


def _hash(items: list[tuple[Key, tuple]]) -> int:
    digest = hashlib.blake2b(repr(items).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2  # < 2**62: its negation stays above NEUTRAL


class Negotiator:
    def __init__(self, group: Any, size: int, rank: int, cache_capacity: int):
        self.group, self.size, self.rank = group, size, rank
        self.cache = ResponseCache(cache_capacity)
        self.uncached_rounds = 0  # rounds that needed more than the cache (observability, tests)
        # warn while blocked this long waiting for the other ranks (0: never)
        self.stall_check_s = 0.0

    def _wait(self, work: Any, pending: list[Any]) -> None:
        """Wait for the round's all-reduce; while the other ranks do not come (they have not queued
        anything), warn every ``stall_check_s`` seconds with what this rank is waiting to run."""
        if self.stall_check_s > 0 and pending:  # a joined or shutting-down rank waiting is no stall
            done = threading.Event()
            work.get_future().add_done_callback(lambda _f: done.set())
            waited = 0.0
            while not done.wait(self.stall_check_s):
                waited += self.stall_check_s
                names = [r.label for r in pending][:10]
                log.warning(
                    "scaleout.horovod rank %d: waited %.0f s for the other ranks to join a "
                    "negotiation; queued here: %s (HOROVOD_STALL_CHECK_TIME_SECONDS)",
                    self.rank,
                    waited,
                    names,
                )
        work.wait()

    def negotiate(
        self,
        pending: list[Any],
        joined: bool,
        stop: bool,
        stamp: int | None,
        stalled: list[Any],
        now: int,
    ) -> Outcome:
        entries = keyed(pending)
        local = dict(entries)
        items = [(key, r.meta) for key, r in entries]
        if self.size == 1:
            out = Outcome(
                [(k, m, None, local[k]) for k, m in items],
                stop,
                joined,
                self.rank if joined else -1,
            )
            return out
        hits = {self.cache.lookup(k, m) for k, m in items}
        new = None in hits
        bits = [1 if i in hits else (None if joined else 0) for i in range(len(self.cache.slots))]
        header = [
            int(new),
            int(joined),
            int(stop),
            stamp,
            None if joined else _hash(items),
            int(bool(stalled)),
        ]
        values = header + bits
        n = len(values)
        vec = torch.tensor(
            [NEUTRAL if v is None else v for v in values]
            + [NEUTRAL if v is None else -v for v in values],
            dtype=torch.int64,
        )
        self._wait(
            dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=self.group, async_op=True), pending
        )
        mx, neg = vec[:n].tolist(), vec[n:].tolist()
        mn = [None if v == NEUTRAL else -v for v in neg]
        out = Outcome([], stop=mx[STOP] == 1, all_joined=mn[JOINED] == 1)
        if out.all_joined:
            out.last_joined = mx[STAMP] % self.size
        if out.stop:
            return out
        any_joined = mx[JOINED] == 1
        if mx[NEW] == 1 or mx[STALLED] == 1:
            self.uncached_rounds += 1
            if not any_joined and mx[STALLED] == 0 and mn[HASH] == mx[HASH]:
                resolved = [(k, m, None) for k, m in items]  # every queue is the same
            else:
                resolved = self._coordinate(joined, items, loud=mx[STALLED] == 1)
            for k, m, err in resolved:
                if err is None:
                    self.cache.put(k, m, now)
        else:
            resolved = []
            for i, (k, m) in enumerate(self.cache.slots[: n - HEADER]):
                if mx[HEADER + i] == 1 and mn[HEADER + i] == 1:
                    self.cache.used[i] = now
                    metas = {0: m}
                    resolved.append((k, m, check(k, metas, any_joined)))
        out.resolved = [(k, m, err, local.get(k)) for k, m, err in resolved]
        return out

    def _coordinate(self, joined: bool, items: list[tuple[Key, tuple]], loud: bool) -> list[tuple]:
        gathered: list[Any] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object((joined, items), gathered, dst=0, group=self.group)
        box: list[Any] = [None]
        if self.rank == 0:
            assert gathered is not None
            resolved, waiting = coordinate(gathered)
            for key, missing in waiting.items():
                (log.warning if loud else log.debug)(
                    "scaleout.horovod: %s is waiting for ranks %s", label(key), missing
                )
            box[0] = resolved
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]
