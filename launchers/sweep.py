"""Start the runs of a scaling sweep, one point after another, and collect each point's report.json.

Every point (:class:`scaleout.sweep.SweepPoint`: nodes x ranks per node, overrides) is one
``scaleout train`` started through a registered launcher (launchers/base.py: ``local``, ``netns``,
``slurm``, ``submit``) and waited for; its :class:`LaunchResult` says how it ended.

Points run one at a time on purpose: two points sharing nodes (or, here, cores) would measure each
other. Each point's rank output goes to ``<point dir>/launch.log``; the sweep prints one progress
line per point.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from scaleout.errors import UserError
from scaleout.launchers.base import Launcher
from scaleout.sweep import PointResult, SweepPoint, point_overrides, read_point
from scaleout.sweep.results import median_run

POINT_FILE = "point.json"  # the command of a point's finished run (what --resume compares)


def _tail(path: Path, lines: int = 12) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def check_launcher(launcher: Launcher, points: Sequence[SweepPoint]) -> None:
    """The launcher's one-line errors for these points, before the first one starts."""
    launcher.check([(p.nodes, p.ranks_per_node) for p in points])


def _finished(point: SweepPoint, pdir: Path, argv: list[str]) -> PointResult | None:
    """The result of an earlier run of exactly ``argv`` in ``pdir`` if it finished well, else
    None."""
    try:
        done = json.loads((pdir / POINT_FILE).read_text())
    except (OSError, ValueError):
        return None
    if done.get("argv") != argv:
        return None
    res = read_point(point, pdir / "report.json", float(done.get("wall_s", 0.0)))
    return res if res.ok else None


def run_sweep(
    launcher: Launcher,
    points: Sequence[SweepPoint],
    config: str,
    overrides: Sequence[str],
    steps: int,
    warmup: int,
    out_dir: str | Path,
    extra_overrides: Sequence[str] = (),
    progress: Callable[[str], None] = print,
    repeats: int = 1,
    resume: bool = False,
    timeout_s: float | None = None,
) -> list[PointResult]:
    """Run every point in order, ``repeats`` rounds; a failed run is recorded (with its log's tail)
    and the sweep goes on. Returns one result per point: the median-step-time run of its rounds.

    ``resume``: a run whose folder already holds a good report of the very same command
    (``point.json`` records it) is read instead of run again, so an interrupted sweep continues
    where it stopped. ``timeout_s``: the most one run may take (None: the launcher's own limit,
    if any)."""
    if repeats < 1:
        raise UserError(f"--repeats={repeats}: expected an integer >= 1")
    out = Path(out_dir).resolve()
    runs: dict[SweepPoint, list[PointResult]] = {p: [] for p in points}
    total = len(points) * repeats
    with launcher:
        launcher.prepare(max(p.nodes for p in points))
        for k, (rnd, p) in enumerate(((r, p) for r in range(repeats) for p in points), 1):
            i = f"{k}/{total}"
            pdir = out / "points" / p.name / (f"round{rnd + 1}" if repeats > 1 else "")
            pdir.mkdir(parents=True, exist_ok=True)
            report = pdir / "report.json"
            argv = [
                "train",
                config,
                *overrides,
                *extra_overrides,
                *point_overrides(p, steps, warmup, str(pdir)),
            ]
            done = _finished(p, pdir, argv) if resume else None
            if done is not None:
                progress(
                    f"[{i}] world {p.world}: done before (--resume), {done.step_s * 1e3:.1f} "
                    "ms/step, "
                    f"{done.samples_per_s:.1f} samples/s ({report})"
                )
                runs[p].append(done)
                continue
            report.unlink(missing_ok=True)  # never read a previous sweep's report as this one's
            (pdir / POINT_FILE).unlink(missing_ok=True)
            progress(
                f"[{i}] world {p.world} = {p.nodes} node(s) x {p.ranks_per_node}, global batch "
                f"{p.global_batch} ({p.per_rank_batch}/rank), {steps} steps: running (log "
                f"{pdir / 'launch.log'})"
            )
            t0 = time.perf_counter()
            job = launcher.start(
                ["scaleout", *argv],
                p.nodes,
                p.ranks_per_node,
                log=pdir / "launch.log",
                name=f"sweep-{p.name}",
            )
            run = job.wait(timeout_s)
            wall = time.perf_counter() - t0
            if run.returncode != 0:
                res = PointResult(p, f"failed: {run.message}", wall)
                tail = _tail(pdir / "launch.log")
                progress(
                    f"[{i}] world {p.world}: FAILED after {wall:.1f} s: {run.message}"
                    + (f"\n{tail}" if tail else "")
                )
            else:
                res = read_point(p, report, wall)
                if res.ok:
                    (pdir / POINT_FILE).write_text(json.dumps({"argv": argv, "wall_s": wall}))
                    progress(
                        f"[{i}] world {p.world}: done in {wall:.1f} s: {res.step_s * 1e3:.1f} "
                        f"ms/step, {res.samples_per_s:.1f} samples/s"
                    )
                else:
                    progress(f"[{i}] world {p.world}: {res.status}")
            runs[p].append(res)
    return [median_run(runs[p]) for p in points]
