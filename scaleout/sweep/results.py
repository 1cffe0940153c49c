"""A sweep's measurements: one row per point from its report.json, scaling efficiency,
CSV/JSON/Markdown.

Efficiency is computed against the smallest world in the sweep (the base b, normally 1 rank):

- weak scaling (per-rank batch fixed): per-rank throughput at N / per-rank throughput at b
  = (X_N / N) / (X_b / b), X in samples/s;
- strong scaling (global batch fixed): T_b · b / (N · T_N), T = seconds per step of the same global
  batch (T1 / (N · TN) when b = 1).

Both measure the timed steps only (``train.timing_skip_steps`` drops the warm-up), on rank 0; every
step ends in a collective (the finite-gradient vote), so rank 0's step time is the slowest rank's.
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from scaleout.errors import UserError
from scaleout.output import format_table, write_json
from scaleout.sweep.plan import SweepPoint

# The breakdown columns: compute = forward + backward minus the exposed wait (the trainer already
# moved that into exposed_comm); "other" = step time - the named phases (the per-step vote,
# zero_grad, and waiting for a slower rank).
PHASES = ("data", "compute", "exposed_comm", "optimizer", "other")


@dataclass
class PointResult:
    point: SweepPoint
    status: str  # "ok" or why not ("failed: ...")
    wall_s: float = 0.0  # launch to exit, including startup and the final evaluation
    steps: int = 0  # timed steps
    samples: int = 0
    tokens: int = 0
    seconds: float = 0.0  # sum of timed step times
    breakdown_s: dict[str, float] = field(default_factory=dict)  # mean per timed step, PHASES
    efficiency: float | None = None
    ideal_samples_per_s: float | None = None
    simulated_efficiency: float | None = None
    report: str | None = None
    runs: int = 1  # successful repeats this point's numbers were chosen from (the median step time)
    # (fastest, slowest) step time over those repeats
    step_s_range: tuple[float, float] | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def step_s(self) -> float:
        return self.seconds / self.steps if self.steps else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def row(self) -> dict[str, Any]:
        p = self.point
        out: dict[str, Any] = {
            "world": p.world,
            "nodes": p.nodes,
            "ranks_per_node": p.ranks_per_node,
            "global_batch": p.global_batch,
            "per_rank_batch": p.per_rank_batch,
            "status": self.status,
            "timed_steps": self.steps,
            "step_s": self.step_s,
            "samples_per_s": self.samples_per_s,
            "samples_per_s_per_rank": self.samples_per_s / p.world,
            "tokens_per_s": self.tokens_per_s,
        }
        out.update({f"{k}_s": self.breakdown_s.get(k, 0.0) for k in PHASES})
        out.update(
            efficiency=self.efficiency,
            ideal_samples_per_s=self.ideal_samples_per_s,
            simulated_efficiency=self.simulated_efficiency,
            wall_s=self.wall_s,
            report=self.report,
            runs=self.runs,
            step_s_min=self.step_s_range[0] if self.step_s_range else self.step_s,
            step_s_max=self.step_s_range[1] if self.step_s_range else self.step_s,
        )
        return out


def breakdown(report_breakdown: dict[str, float], step_s: float) -> dict[str, float]:
    """The trainer's phases (data, forward, backward, exposed_comm, optimizer) -> PHASES."""
    b = {k: float(v) for k, v in report_breakdown.items()}
    out = {
        "data": b.get("data", 0.0),
        "compute": b.get("forward", 0.0) + b.get("backward", 0.0),
        "exposed_comm": b.get("exposed_comm", 0.0),
        "optimizer": b.get("optimizer", 0.0),
    }
    out["other"] = max(step_s - sum(out.values()), 0.0)
    return out


def read_point(point: SweepPoint, report_path: str | Path, wall_s: float) -> PointResult:
    """A PointResult from the trainer's report.json (needs its "timed" block:
    train.timing_skip_steps)."""
    path = Path(report_path)
    if not path.is_file():
        return PointResult(point, f"failed: no report at {path}", wall_s)
    data = json.loads(path.read_text())
    timed = data.get("timed")
    if not timed or not timed.get("steps"):
        return PointResult(point, f"failed: {path} has no timed steps", wall_s, report=str(path))
    if data.get("devices") not in (None, point.world):
        return PointResult(
            point,
            f"failed: {path} ran on {data.get('devices')} ranks, expected {point.world}",
            wall_s,
            report=str(path),
        )
    res = PointResult(
        point,
        "ok",
        wall_s,
        int(timed["steps"]),
        int(timed["samples"]),
        int(timed.get("tokens", 0)),
        float(timed["seconds"]),
        report=str(path),
    )
    res.breakdown_s = breakdown(data.get("breakdown_s", {}), res.step_s)
    return res


def median_run(runs: list[PointResult]) -> PointResult:
    """The repeat with the median step time (the lower one of an even count), with the spread
    recorded.

    On a shared machine a point's speed drifts with everything else that runs; repeating the whole
    sweep in rounds (1, 2, 4, 1, 2, 4, ...) and taking each point's median exposes every point to
    the same drift.
    """
    ok = sorted((r for r in runs if r.ok), key=lambda r: r.step_s)
    if not ok:
        return runs[-1]
    pick = ok[(len(ok) - 1) // 2]
    pick.runs = len(ok)
    pick.step_s_range = (ok[0].step_s, ok[-1].step_s)
    return pick


def add_efficiency(results: list[PointResult], mode: str) -> PointResult | None:
    """Fill efficiency and the ideal throughput of every ok point; return the base point (or
    None)."""
    ok = [r for r in results if r.ok]
    if not ok:
        return None
    base = min(ok, key=lambda r: r.point.world)
    b = base.point.world
    for r in ok:
        n = r.point.world
        r.ideal_samples_per_s = base.samples_per_s * n / b
        if mode == "weak":
            r.efficiency = (
                (r.samples_per_s / n) / (base.samples_per_s / b) if base.samples_per_s else None
            )
        elif mode == "strong":
            r.efficiency = (base.step_s * b) / (n * r.step_s) if r.step_s else None
        else:
            raise UserError(f"mode {mode!r}: expected weak or strong")
    return base


def table_rows(
    results: list[PointResult], simulated: bool = False
) -> tuple[list[str], list[list[Any]]]:
    headers = [
        "GPUs",
        "nodes x ranks",
        "global batch",
        "step ms",
        "step ms range",
        "samples/s",
        "per rank",
        "ideal samples/s",
        "efficiency",
        "compute ms",
        "exposed comm ms",
        "optimizer ms",
        "data ms",
        "other ms",
    ]
    if simulated:
        headers.append("simulated eff.")
    rows = []
    for r in results:
        p = r.point
        if not r.ok:
            rows.append(
                [p.world, f"{p.nodes}x{p.ranks_per_node}", p.global_batch, r.status]
                + ["-"] * (len(headers) - 4)
            )
            continue
        ms = {k: r.breakdown_s.get(k, 0.0) * 1e3 for k in PHASES}
        lo, hi = r.step_s_range or (r.step_s, r.step_s)
        row = [
            p.world,
            f"{p.nodes}x{p.ranks_per_node}",
            p.global_batch,
            r.step_s * 1e3,
            f"{lo * 1e3:.4g}-{hi * 1e3:.4g} ({r.runs})",
            r.samples_per_s,
            r.samples_per_s / p.world,
            r.ideal_samples_per_s,
            f"{r.efficiency:.1%}" if r.efficiency is not None else "-",
            ms["compute"],
            ms["exposed_comm"],
            ms["optimizer"],
            ms["data"],
            ms["other"],
        ]
        if simulated:
            row.append(
                f"{r.simulated_efficiency:.1%}" if r.simulated_efficiency is not None else "-"
            )
        rows.append(row)
    return headers, rows


def markdown(results: list[PointResult], meta: dict[str, Any], notes: list[str]) -> str:
    headers, rows = table_rows(
        results, simulated=any(r.simulated_efficiency is not None for r in results)
    )
    title = (
        f"scaleout sweep: {meta['config']}, {meta['mode']} scaling, {meta['steps']} steps "
        f"({meta['warmup']} warm-up not timed), launcher {meta['launcher']}"
    )
    body = format_table(headers, rows)
    return "\n".join([f"## {title}", "", body, "", *[f"note: {n}" for n in notes]]) + "\n"


def write_outputs(
    out_dir: str | Path, results: list[PointResult], meta: dict[str, Any], notes: list[str]
) -> dict[str, Path]:
    """sweep.csv, sweep.json and sweep.md in ``out_dir``; returns their paths."""

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [r.row() for r in results]
    paths = {"csv": out / "sweep.csv", "json": out / "sweep.json", "md": out / "sweep.md"}
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["world"])
        w.writeheader()
        w.writerows(rows)
    write_json(
        paths["json"],
        {**meta, "notes": notes, "points": rows, "plan": [asdict(r.point) for r in results]},
    )
    paths["md"].write_text(markdown(results, meta, notes))
    return paths
