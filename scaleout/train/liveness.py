"""Naming the rank behind a failed collective.

A collective that times out tells a rank only that *some* peer did not answer (gloo: "Timed out
waiting 20000ms for recv operation"); with a hierarchical or torus schedule the rank it waited on
may itself be waiting on the culprit. So every rank of a training run beats a heartbeat into the
rendezvous store (its own key, a counter, every ``period_for(timeout)`` seconds, from a daemon
thread with its own store connection), and when a collective fails the first rank to notice reads
every heartbeat twice, two periods apart: a rank whose counter did not move is stopped, hung or dead
(a SIGSTOPped process beats no more; a rank blocked in a collective still does). It publishes the
verdict in the store, and every other failing rank prints the same verdict instead of repeating the
scan.

A rank can also be alive and still be the culprit: stuck in its data loader, in a forward that
never ends, in a checkpoint write while the others wait at the barrier. So each beat also carries
where the rank is (:class:`Progress`): the step, the phase (the trainer marks its phase boundaries
with ``progress.at(step, phase)``, a plain attribute write) and how many collectives it has issued
(the trainer's own, plus the gradient sync's ``issued`` counter). With every heartbeat alive, the
verdict names the rank that is *behind* -- lowest step, then fewest collectives issued, then the
earliest phase -- against where the others are: "rank 3 (node 1, local rank 1) is behind: step 12
in forward, collective #40 while the others are at #41 (step 12, grad-sync)". The failing ranks
print it as a ``verdict:`` line (scaleout/goodput/verdict.py) that the launcher reads back for its
own last
line. Nothing of this touches the step: the beat thread reads the attributes, the step never
calls the store.

Cost at 2,048 ranks: one small ``set`` per rank per period (68/s at a 120 s step timeout), and on
failure two reads of every key by one rank. The store lives in rank 0's process: if rank 0 is the
stopped one, the store does not answer either, and that is the verdict.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from scaleout.world import World

_PREFIX = "scaleout/heartbeat"

# Where a rank can be, in the order it passes them: init, then per step index s the evaluation and
# checkpoint after s steps, then step s's data, forward, backward, the wait for the gradient sync,
# the step's agreement and the optimizer; finish after the last. "Earlier" in a verdict is this
# order.
PHASES = (
    "init",
    "eval",
    "checkpoint",
    "data",
    "forward",
    "backward",
    "grad-sync",
    "agreement",
    "optimizer",
    "finish",
)
_ORDER = {p: i for i, p in enumerate(PHASES)}


def period_for(timeout_s: float) -> float:
    """Heartbeat period for a collective timeout: four beats per timeout, between 1 s and 30 s,
    so a rank that stopped before a collective timed out has missed at least two beats by the
    time anyone looks."""
    return min(30.0, max(1.0, timeout_s / 4.0))


def _client(world: World, timeout_s: float) -> Any:
    """A new connection to the rendezvous store (not the one the process groups use: a read here
    must not queue behind, or hold up, anything else)."""
    return dist.TCPStore(
        str(world.master_addr),
        int(world.master_port),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def describe_rank(world: World, rank: int) -> str:
    node = world.node_of[rank] if rank < len(world.node_of) else "?"
    nodes = world.ranks_per_node
    local = nodes[node].index(rank) if isinstance(node, int) and rank in nodes[node] else "?"
    return f"rank {rank} (node {node}, local rank {local})"


class Progress:
    """Where this rank is, for its heartbeat to publish: ``point`` = (step, phase) as the trainer
    marked it last (:meth:`at`), and the collectives it has issued: ``collectives`` (the trainer's
    own: the agreement, barriers) plus ``issued`` of every object it :meth:`watch`-es (the gradient
    sync counts its bucket launches; its ``waiting`` flag turns the phase into "grad-sync"). Plain
    attribute writes, no lock, no call into the store: the heartbeat thread reads them (a tuple
    store is atomic under the GIL, so step and phase never tear)."""

    __slots__ = ("point", "collectives", "_sources")

    def __init__(self) -> None:
        self.point: tuple[int, str] = (0, "init")
        self.collectives = 0
        self._sources: list[Any] = []

    def at(self, step: int, phase: str) -> None:
        """This rank enters ``phase`` of step ``step`` (a step index; eval/checkpoint: the steps
        done)."""
        self.point = (step, phase)

    def watch(self, source: Any) -> None:
        """Also count ``source.issued`` (collectives) and read ``source.waiting`` (grad-sync)."""
        self._sources.append(source)

    def snapshot(self) -> dict[str, Any]:
        step, phase = self.point
        seq = self.collectives
        for source in self._sources:
            seq += int(getattr(source, "issued", 0))
            if getattr(source, "waiting", False):
                phase = "grad-sync"
        return {"step": step, "phase": phase, "seq": seq}


class Heartbeat:
    """A daemon thread that bumps this rank's counter in the store every ``period()`` seconds,
    with where :attr:`progress` says the rank is."""

    def __init__(self, world: World, period: Callable[[], float]):
        self.world, self.period = world, period
        self.progress = Progress()
        self._stop = threading.Event()
        self._store: Any = None
        self._thread: threading.Thread | None = None
        if world.world_size < 2:
            return
        try:
            self._store = _client(world, 30.0)
            self._store.set(f"{_PREFIX}/{world.rank}", self._value(0))
        except Exception:  # noqa: BLE001 -- no store to beat into (e.g. an external init): no diagnosis
            self._store = None
            return
        self._thread = threading.Thread(
            target=self._loop, name=f"scaleout-heartbeat-r{world.rank}", daemon=True
        )
        self._thread.start()

    def at(self, step: int, phase: str) -> None:
        """``self.progress.at``: this rank enters ``phase`` of step ``step``."""
        self.progress.at(step, phase)

    def _value(self, beats: int) -> str:
        return json.dumps({"beat": beats, **self.progress.snapshot()})

    def _loop(self) -> None:
        # Wakes at least every second and beats once a period has passed since the last beat: the
        # period follows the collective timeout, which shrinks after the first step (600 s at init
        # -> a 30 s period; train.step_timeout_s=8 -> 2 s), and a beat slept through at the old
        # period would leave a healthy rank looking stopped.
        beats, last = 0, time.monotonic()
        while not self._stop.wait(min(1.0, self.period())):
            if time.monotonic() - last < self.period():
                continue
            beats, last = beats + 1, time.monotonic()
            try:
                self._store.set(f"{_PREFIX}/{self.world.rank}", self._value(beats))
            except Exception:  # noqa: BLE001 -- a slow or stopped store host: keep trying, never raise
                continue

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=35.0)  # at most one store call (30 s timeout) in flight
        self._thread, self._store = None, None


def _beats(store: Any, keys: list[str]) -> list[dict[str, Any] | None]:
    present = [k for k in keys if store.check([k])]
    values = (
        dict(zip(present, (v.decode() for v in store.multi_get(present)), strict=True))
        if present
        else {}
    )
    return [_parse(values.get(k)) for k in keys]


def _parse(raw: str | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        beat = json.loads(raw)
    except ValueError:
        return {"beat": raw}
    return beat if isinstance(beat, dict) else {"beat": beat}


def unresponsive_verdict(world: World, timeout_s: float) -> str:
    """One sentence naming the root cause of a failed collective (:func:`unresponsive`)."""
    return unresponsive(world, timeout_s)[0]


def unresponsive(world: World, timeout_s: float) -> tuple[str, list[int]]:
    """(one sentence naming the root cause of a failed collective: the ranks whose heartbeat
    stopped, else the rank that is behind; the ranks whose heartbeat stopped: [0] when the store
    on rank 0 did not answer, [] when every heartbeat is alive). Call on every rank whose
    collective failed; the Slurm supervisor quarantines the nodes of the stopped ranks.

    Runs in a daemon thread with a hard deadline: a TCPStore client talking to a stopped (not dead)
    host can block past its own timeout (the kernel still accepts the connection), and a diagnosis
    must never be the next hang.
    """
    window = 2.0 * period_for(timeout_s)
    limit = 2.0 * window + 10.0
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["verdict"] = _verdict(world, window, limit)
        except Exception as exc:  # noqa: BLE001 -- reported below
            box["error"] = next(
                (x.strip() for x in str(exc).splitlines() if x.strip()), type(exc).__name__
            )[:160]

    t = threading.Thread(target=work, name="scaleout-liveness", daemon=True)
    t.start()
    t.join(limit)
    if "verdict" in box:
        return box["verdict"]["text"], list(box["verdict"].get("stale", []))
    why = box.get("error", f"no answer within {limit:.0f} s")
    return (
        f"{describe_rank(world, 0)}, which hosts the rendezvous store, did not answer ({why}): "
        "stopped, hung or dead, or its host is unreachable"
    ), [0]


def _verdict(world: World, window: float, limit: float) -> dict[str, Any]:
    store = _client(world, limit)
    # the first to look scans; the others read its verdict
    if store.add(f"{_PREFIX}/claim", 1) == 1:
        verdict = _scan(world, store, window)
        store.set(f"{_PREFIX}/verdict", json.dumps(verdict))
    else:
        verdict = json.loads(store.get(f"{_PREFIX}/verdict").decode())
    readers = store.add(f"{_PREFIX}/read", 1)
    # hosts the store: stay until every other failing rank has read the verdict (bounded)
    if world.rank == 0:
        deadline = time.monotonic() + window
        expected = world.world_size - len(verdict["culprits"])  # a culprit never comes to read
        while readers < expected and time.monotonic() < deadline:
            time.sleep(0.2)
            readers = store.add(f"{_PREFIX}/read", 0)
    return verdict


def _scan(world: World, store: Any, window: float) -> dict[str, Any]:
    keys = [f"{_PREFIX}/{r}" for r in range(world.world_size)]
    first = _beats(store, keys)
    time.sleep(window)
    second = _beats(store, keys)
    return judge(first, second, window, lambda r: describe_rank(world, r))


def _where(beat: Mapping[str, Any]) -> str:
    return f"step {beat.get('step', '?')} in {beat.get('phase', '?')}"


def _key(beat: Mapping[str, Any]) -> tuple[int, int, int]:
    """Who is further: more steps, then more collectives issued, then a later phase."""
    return (
        int(beat.get("step", 0)),
        int(beat.get("seq", 0)),
        _ORDER.get(str(beat.get("phase")), len(PHASES)),
    )


def _waiting_in(live: list[dict[str, Any] | None]) -> tuple[Any, Any, int] | None:
    """(step, phase, collective #) where most live ranks are: the collective they wait in."""
    points = Counter(
        (b.get("step"), b.get("phase"), b.get("seq"))
        for b in live
        if b is not None and isinstance(b.get("seq"), int)
    )
    return points.most_common(1)[0][0] if points else None


def _since(beat: Mapping[str, Any], waiting: tuple[Any, Any, int] | None) -> str:
    """A stopped rank's last beat can be a period old (one beat per period keeps the store's
    load flat at 2,048 ranks): where the live ranks wait says how far it really got, at no cost.
    It joined every collective they completed, so it stopped before the one they wait in."""
    seq = beat.get("seq")
    if waiting is None or not isinstance(seq, int) or seq >= waiting[2] - 1:
        return ""
    step, phase, at = waiting
    return (
        f"; it then took part in every collective up to #{at - 1}: the others wait for it in "
        f"#{at} at step {step}, {phase}"
    )


def judge(
    first: list[dict[str, Any] | None],
    second: list[dict[str, Any] | None],
    window: float,
    describe: Callable[[int], str],
) -> dict[str, Any]:
    """The verdict from every rank's heartbeat read twice, ``window`` seconds apart (each a beat
    as published: ``{"beat", "step", "phase", "seq"}``, or None where a rank never beat).

    Ranks whose beat did not move are stopped, hung or dead: they are the culprits. With every
    heartbeat alive, the culprits are the ranks that are behind (lowest step, then fewest
    collectives issued, then the earliest phase: :data:`PHASES`), described against where most of
    the others are. Returns ``{"text": one sentence, "culprits": [ranks], "stale": [ranks whose
    heartbeat stopped]}`` ("stale" only when some did)."""
    n = len(second)
    stale = [
        r
        for r in range(n)
        if second[r] is None
        or (first[r] is not None and second[r].get("beat") == first[r].get("beat"))
    ]
    if stale:
        waiting = _waiting_in([second[r] for r in range(n) if r not in stale])
        named = ", ".join(
            describe(r)
            + (
                f" (last seen at {_where(second[r])}, collective #{second[r].get('seq', '?')}"
                f"{_since(second[r], waiting)})"
                if second[r] is not None and "step" in second[r]
                else ""
            )
            for r in stale[:8]
        )
        more = f" and {len(stale) - 8} more" if len(stale) > 8 else ""
        return {
            "text": f"{named}{more} sent no heartbeat for {window:.0f} s: stopped, hung or dead",
            "culprits": stale,
            "stale": stale,
        }
    beats = [b for b in second if b is not None]
    keys = [_key(b) for b in beats]
    lowest = min(keys)
    behind = [r for r in range(n) if keys[r] == lowest]
    if len(behind) == n:
        return {
            "text": (
                f"every rank's heartbeat is alive, all at {_where(beats[0])}, collective "
                f"#{beats[0].get('seq', '?')}: a rank is blocked elsewhere (collectives issued "
                "in a different order?) or the network between ranks failed"
            ),
            "culprits": [],
        }
    b = beats[behind[0]]
    rest = [r for r in range(n) if r not in behind]
    points = Counter(
        (beats[r].get("step"), beats[r].get("phase"), beats[r].get("seq")) for r in rest
    )
    (step, phase, seq), count = points.most_common(1)[0]
    others = "the others are" if count == len(rest) else f"{count} of the other {len(rest)} are"
    named = ", ".join(describe(r) for r in behind[:8])
    more = f" and {len(behind) - 8} more" if len(behind) > 8 else ""
    verb = "is" if len(behind) == 1 else "are"
    return {
        "text": (
            f"{named}{more} {verb} behind: {_where(b)}, collective #{b.get('seq', '?')} while "
            f"{others} at #{seq} (step {step}, {phase})"
        ),
        "culprits": behind,
    }
