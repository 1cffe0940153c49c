"""Straggler and desync attribution, carried by the step's one agreement all-reduce.

Every rank measures its own phase times of the step (:data:`PHASES`) and a fingerprint of the
step's gradient collectives (count, bytes, bucket layout: ``GradientSync.collectives``,
scaleout/parallel/buckets.py ``fingerprint``); :func:`scaleout.train.agreement.agree_on_step`
puts them into the *same* SUM all-reduce that already carries the step's flags and loss, so every
rank learns, per phase, the slowest and the fastest rank and the median, and whether every rank ran
the same collectives, without a collective of its own.

Encoding. The agreement's head (flags, loss, FLOPs) is summed as before, bit for bit. After it comes
a block of ``ROWS x world`` float32, one column per rank: rank r writes its values into column r and
zeros elsewhere, so the SUM is an exact gather (x + 0 = x; a 24-bit fingerprint is an exact
float32). Max, argmax, min, argmin and median per row are then taken on the device and join the
step's one host read (5 floats per phase + 2, whatever the world size); a fingerprint mismatch
(min != max) costs a second read of one row, on the error path only.

Why a world-sized block and not O(1) per rank. A MAX all-reduce of ``(quantised time << 11 | rank)``
returns the slowest rank in 8 bytes, but the agreement must also *sum* (the loss mean, the FLOPs),
and no single reduction does both: a MAX cannot count, a SUM cannot take a maximum. Moving the
agreement to MAX would need the losses per rank (O(world) again) or a second collective. The block
is the one exact design in one all-reduce.

Cost at 2,048 ranks: (7 + 8 x 2,048) x 4 B = 66 KB per step (today's agreement without phase
times: 28 B). That all-reduce is still latency-bound: its bandwidth term is about 2 x 66 KB / 25
GB/s = 5 us against a latency of tens to hundreds of microseconds at that scale (ring 2(p-1)a, tree
2 log2(p) a), and against a gradient all-reduce of hundreds of MB the added bytes are < 0.05 %. The
device work is one max, one min and one median over an 8 x world matrix. ``scaleout bench
agreement`` measures the step-time ratio, old agreement vs this one, interleaved.

Phase times are this rank's intervals of the step (``time.perf_counter``):

* ``data``: waiting for the step's batches;
* ``compute``: forward + backward, less the gradient sync's exposed wait;
* ``arrival``: step start -> this rank launched its first gradient bucket (DataParallel), else the
  end of backward; a late rank here holds every peer in that bucket's all-reduce;
* ``sync_wait``: backward's wait for the gradient collectives after its last gradient (the
  *victims* of a straggler wait here; the straggler itself waits least);
* ``optimizer``: the optimizer step, of the *previous* step (it runs after the agreement);
* ``intra``: the row phases of the hierarchical / torus2d all-reduce (intra-node reduce-scatter
  and all-gather) and of the sharded optimizer's two-phase reduce-scatter / all-gather;
* ``inter_allreduce``: their column phase (the inter-node all-reduce of each shard among the
  same-local-rank peers of every node).

``intra`` and ``inter_allreduce`` come from :mod:`scaleout.comm.phasetime`: on gloo host time
around the host's waits, summed over the step's buckets; on CUDA timing events recorded on the comm
stream and read one step late (no host sync: they were completed by the previous step's agreement
read), so there they describe the step before. The flat algorithm is one collective whose intra-
and inter-node hops interleave inside the ring: it has no phases (both stay 0; its wait is
``sync_wait``). On a GPU the other host times are launch times unless the host blocks, so they
attribute host-side slowness (input, Python, launch); a slow device shows in ``sync_wait`` of its
peers.

A step names at most one straggler per cause (:data:`CAUSES`): the slowest rank, when its time is
at least ``train.straggler_threshold`` x the median over ranks *and* its excess over the median is
at least :data:`MIN_SHARE` of the step time (a 20 us data wait against a 10 us median is not a
straggler). A rank is reported when it was a cause's straggler on :data:`MIN_PERSIST` of the steps
(and 2). ``sync_wait``, ``intra`` and ``inter_allreduce`` as measured only feed the spread: a long
wait there is the effect, and a rank's peers wait in the same phase as the rank that holds them.

**A slow link** (:func:`link_credit`). A transfer between two nodes runs at the slower end's rate,
so the inter-node phase takes the same time on both ends of a slow link, and on every rank of a
ring or of a column that crosses it: the times alone cannot tell the slow end from its peers (with
two nodes, no measurement of that one link can). The rule is ``scaleout doctor``'s
(scaleout/goodput/doctor.py ``node_bandwidth``): each rank's link rate (the tc rate on its
interface, as on
the emulated cluster, else ``/sys/class/net/<if>/speed``) is exchanged once at start-up; a rank
whose link is faster than the slowest link in the run was held back by that link, so its
``inter_allreduce`` time is credited to its own link only in the ratio of the speeds: ``inter_link
= inter_allreduce x slowest rate / own rate``. The rank on the slow NIC keeps its whole time, its
peers keep a fraction: the slowest ``inter_link`` names the node whose own send and receive are
slow, never the peers that waited for it, and the straggler is reported with phase
``inter_allreduce``. With equal or unknown rates nothing is credited and no ``inter_link`` row is
formed (a degraded link at its nominal rate is then doctor's to find, by its pairwise probes). The
row is computed on the device from the gathered block, so it costs no byte on the wire.

A node whose ranks were a phase's straggler on at least half the steps (:data:`QUARANTINE_PERSIST`)
at 2x the median or more (:data:`QUARANTINE_SLOWDOWN`) is also a quarantine verdict (source
``straggler``, :func:`quarantine_verdicts`): rank 0 appends it to
``<train.output_dir>/quarantine.json`` at the end of the run, which the Slurm supervisor reads
before the next start. The bar is above being reported: a quarantined node leaves the next
allocation, and a few noisy steps on a shared machine must not put it there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from scaleout.errors import UserError

PHASES = (
    "data",
    "compute",
    "arrival",
    "sync_wait",
    "optimizer",
    "intra",
    "inter_allreduce",
)
LINK = "inter_link"  # inter_allreduce x the link credit: computed on the device, not sent
INTER = PHASES.index("inter_allreduce")
# The phases that can name a straggler, and the name a straggler of each is reported under.
CAUSES = ("data", "compute", "arrival", "optimizer", LINK)
REPORTED_AS = {LINK: "inter_allreduce"}
ROWS = len(PHASES) + 1  # the phases, then the collective fingerprint
MIN_SHARE = 0.05  # a straggler's excess over the median must be >= this share of the step time
# A rank is reported when it was the straggler of a phase on at least this share of the steps
# observed (and on 2 of them): one step's hiccup on a shared machine is noise, not a slow node.
MIN_PERSIST = 0.1
# A node is quarantined (source "straggler") when its ranks were a phase's straggler on at least
# this share of the steps, at this slowdown or more on average: it then leaves the next allocation.
QUARANTINE_PERSIST = 0.5
QUARANTINE_SLOWDOWN = 2.0
# ... and only when the phase was observed on at least this many steps: an attempt preempted after
# 3 steps (a notice right after the first checkpoint) on a loaded CI host quarantined a healthy
# node and cost the job a second requeue, as if the node were broken.
QUARANTINE_MIN_STEPS = 5
# Phases whose stragglers are never quarantined: a rank waiting for its data is starved by its
# input pipeline (workers still starting, a shared file system), which another node does not fix
# (a short run's first steps made a healthy node a 21x data straggler and cost it the requeue),
# and its late arrival at the first bucket follows from that wait or from a slow compute (which
# "compute" names on its own).
NOT_QUARANTINED = ("data", "arrival")


def link_credit(speeds: Sequence[float | None]) -> list[float] | None:
    """Per rank, the share of its inter-node phase time its own link is credited with (module
    docstring): the slowest known rate / its own rate (1.0 where its rate is unknown). None when
    nothing is credited (fewer than two known rates, or all equal)."""
    known = [s for s in speeds if s and s > 0]
    if len(known) < 2 or min(known) == max(known):
        return None
    low = min(known)
    return [low / s if s and s > 0 else 1.0 for s in speeds]


def quarantine_verdicts(report: dict[str, Any], node_names: Sequence[str]) -> list[tuple[str, str]]:
    """(host, reason) per node that is a straggler over the quarantine bar, for
    :func:`scaleout.goodput.quarantine.record` with source ``straggler``: from
    :meth:`SkewTracker.report`,
    a node's ranks together were a phase's straggler on at least :data:`QUARANTINE_PERSIST` of
    the steps, at :data:`QUARANTINE_SLOWDOWN` x the median or more on average, in a phase observed
    on at least :data:`QUARANTINE_MIN_STEPS` steps. Stricter than being reported: a node leaves
    the next allocation, so a few noisy steps must not put it there."""
    seen = {p: s["steps"] for p, s in report.get("spread", {}).get("phases", {}).items()}
    by_node: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for s in report.get("stragglers", []):
        node = s.get("node")
        if node is not None and 0 <= node < len(node_names):
            by_node.setdefault((node, s["phase"]), []).append(s)
    out = []
    for (node, phase), entries in sorted(by_node.items()):
        steps = sum(s["steps"] for s in entries)
        slowdown = sum(s["slowdown"] * s["steps"] for s in entries) / steps
        observed = seen.get(phase, steps)
        if observed < QUARANTINE_MIN_STEPS or steps < QUARANTINE_PERSIST * observed:
            continue
        if slowdown < QUARANTINE_SLOWDOWN:
            continue
        if phase in NOT_QUARANTINED:
            continue
        ranks = ", ".join(str(s["rank"]) for s in sorted(entries, key=lambda s: s["rank"]))
        excess = sum(s["excess_s"] * s["steps"] for s in entries) / steps
        out.append(
            (
                node_names[node],
                f"straggler in {phase} (ranks {ranks}): {slowdown:.1f}x the median on {steps} of "
                f"{seen.get(phase, steps)} steps (+{excess * 1e3:.0f} ms a step)",
            )
        )
    return out


class CollectiveDesync(UserError):
    """Ranks ran different gradient collectives in one step (a different bucket layout, count or
    size): raised on every rank at the step boundary, before a collective could hang."""


@dataclass(frozen=True)
class PhaseSkew:
    """One phase of one step over the ranks (seconds)."""

    max_s: float
    max_rank: int
    min_s: float
    min_rank: int
    median_s: float

    @property
    def slowdown(self) -> float:
        """The slowest rank's time / the median (1.0 when both are ~0)."""
        return (
            self.max_s / self.median_s
            if self.median_s > 1e-9
            else (1.0 if self.max_s <= 1e-9 else math.inf)
        )


@dataclass(frozen=True)
class StepSkew:
    """Every phase of one step over the ranks, and this rank's collective fingerprint (the
    same on every rank: a mismatch raises :class:`CollectiveDesync` instead)."""

    phases: dict[str, PhaseSkew]
    fingerprint: int = 0

    @classmethod
    def from_values(cls, values: list[float], fp: int, names: Sequence[str] = PHASES) -> StepSkew:
        """From the agreement's summary: per phase (max, argmax, min, argmin, median), in that
        order of blocks of ``len(names)`` (see :func:`scaleout.train.agreement.agree_on_step`;
        ``names``: :data:`PHASES`, then :data:`LINK` when links are credited)."""
        n = len(names)
        mx, amx, mn, amn, med = (values[i * n : (i + 1) * n] for i in range(5))
        return cls(
            {
                p: PhaseSkew(mx[i], int(amx[i]), mn[i], int(amn[i]), med[i])
                for i, p in enumerate(names)
            },
            fp,
        )


def desync_message(step: int | None, fps: list[int], mine: str) -> str:
    """One line naming the ranks whose fingerprint differs from the majority's."""
    counts: dict[int, list[int]] = {}
    for r, f in enumerate(fps):
        counts.setdefault(f, []).append(r)
    major = max(counts, key=lambda f: (len(counts[f]), -counts[f][0]))
    odd = sorted(r for f, rs in counts.items() if f != major for r in rs)
    parts = ", ".join(f"rank {r} 0x{fps[r]:06x}" for r in odd[:8])
    more = f" and {len(odd) - 8} more" if len(odd) > 8 else ""
    at = f"step {step}: " if step is not None else ""
    return (
        f"{at}gradient collectives differ between ranks (desync): {parts}{more} against "
        f"0x{major:06x} on the other {len(counts[major])} ranks; {mine}; a rank built its model "
        "or buckets differently, or skipped a step the others took (its reduced gradients "
        "non-finite, theirs not): stopping before a collective hangs or replicas drift"
    )


@dataclass
class _Straggler:
    steps: int = 0
    slowdown_sum: float = 0.0
    slowdown_max: float = 0.0
    excess_sum: float = 0.0


@dataclass
class _Spread:
    steps: int = 0
    max_sum: float = 0.0
    min_sum: float = 0.0
    median_sum: float = 0.0
    max_max: float = 0.0
    max_rank: int = 0  # the rank of max_max


@dataclass
class SkewTracker:
    """Accumulates the agreed :class:`StepSkew` of every step into the report's ``stragglers``
    and ``spread`` (the same on every rank: its input is agreed)."""

    node_of: tuple[int, ...] | list[int]
    threshold: float = 1.3
    # a name per node (scaleout.goodput.doctor.node_names: the host, or the emulated node's
    # namespace),
    # for the quarantine file; set by the trainer when it exchanged them at start-up
    node_names: list[str] = field(default_factory=list)
    stragglers: dict[tuple[int, str], _Straggler] = field(default_factory=dict)
    spread: dict[str, _Spread] = field(default_factory=dict)
    # how the compute row was timed: "device" (CUDA events, scaleout/train/devicetime.py) or
    # "host" (the same regions on the host clock): the report's slow devices say which
    compute_timing: str = "host"

    def add(self, skew: StepSkew | None, step_s: float) -> None:
        if skew is None:
            return
        for phase, s in skew.phases.items():
            if phase != LINK:  # derived from inter_allreduce: the spread shows the measured one
                sp = self.spread.setdefault(phase, _Spread())
                sp.steps += 1
                sp.max_sum, sp.min_sum, sp.median_sum = (
                    sp.max_sum + s.max_s,
                    sp.min_sum + s.min_s,
                    sp.median_sum + s.median_s,
                )
                if s.max_s > sp.max_max:
                    sp.max_max, sp.max_rank = s.max_s, s.max_rank
            excess = s.max_s - s.median_s
            if phase not in CAUSES or excess < MIN_SHARE * step_s:
                continue
            slow = s.slowdown
            if slow < self.threshold:
                continue
            key = (s.max_rank, REPORTED_AS.get(phase, phase))
            st = self.stragglers.setdefault(key, _Straggler())
            st.steps += 1
            st.slowdown_sum += min(slow, 1e6)
            st.slowdown_max = max(st.slowdown_max, min(slow, 1e6))
            st.excess_sum += excess

    def report(self) -> dict[str, Any]:
        """``{"stragglers": [...], "spread": {...}}`` for report.json and metrics.jsonl."""
        out = []
        for (rank, phase), st in self.stragglers.items():
            seen = self.spread[phase].steps if phase in self.spread else st.steps
            if st.steps < max(2, MIN_PERSIST * seen):
                continue
            node = self.node_of[rank] if rank < len(self.node_of) else None
            out.append(
                {
                    "rank": rank,
                    "node": node,
                    "phase": phase,
                    "slowdown": st.slowdown_sum / st.steps,  # rank's time / median, mean
                    "slowdown_max": st.slowdown_max,
                    "excess_s": st.excess_sum / st.steps,  # rank's time - median, mean
                    "steps": st.steps,
                }
            )
        out.sort(key=lambda d: (-d["steps"], -d["excess_s"]))
        spread = {
            p: {
                "steps": s.steps,
                "max_s": s.max_sum / s.steps,
                "min_s": s.min_sum / s.steps,
                "median_s": s.median_sum / s.steps,
                "worst_s": s.max_max,
                "worst_rank": s.max_rank,
            }
            for p, s in self.spread.items()
            if s.steps
        }
        return {
            "stragglers": out,
            # a compute straggler is a slow device: its own forward + backward, not its waits
            "slow_devices": [
                {**s, "timing": self.compute_timing} for s in out if s["phase"] == "compute"
            ],
            "spread": {
                "threshold": self.threshold,
                "min_share": MIN_SHARE,
                "min_persist": MIN_PERSIST,
                "phases": spread,
            },
        }

    def reset(self) -> None:
        self.stragglers.clear()
        self.spread.clear()
