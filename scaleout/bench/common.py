"""Helpers shared by the benchmarks: timing, tables, JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def median_time(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> tuple[float, list[float]]:
    """Median wall time of ``fn()`` in seconds over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), times


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (readable in a terminal and pasteable into an issue)."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
        return str(v)

    cells = [[cell(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths, strict=True)) + " |"  # noqa: E731
    out = [line(list(headers)), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells]
    return "\n".join(out)


def machine_info() -> dict[str, Any]:
    import torch

    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.is_available(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def write_json(path: str | os.PathLike[str] | None, payload: dict[str, Any]) -> Path | None:
    if not path:
        return None
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"machine": machine_info(), **payload}, indent=2, default=str))
    return p


# -- one-shot: a bench that runs inside ranks can also start them itself --------------------------------
_ONE_SHOT = {"--nnodes": True, "--nproc-per-node": True, "--netns": False, "--rate": True}


def add_one_shot_arguments(p: Any) -> None:
    """``--nnodes/--nproc-per-node/--netns/--rate``: start the ranks from here (see :func:`one_shot`)."""
    one = p.add_argument_group("one-shot (start the ranks from here)")
    one.add_argument("--nnodes", type=int, default=None, help="start this many emulated nodes via scaleout launch")
    one.add_argument("--nproc-per-node", type=int, default=1, help="ranks per emulated node (one-shot)")
    one.add_argument("--netns", action="store_true", help="one-shot in an emulated cluster (root): up, run, always down")
    one.add_argument("--rate", default="1gbit", help="link rate of the emulated cluster (default 1gbit)")


def one_shot(args: Any) -> int:
    """Re-run this very command line inside ``scaleout launch``, minus the one-shot flags.

    A subprocess, so rank-side code never imports ``launchers``; every other flag passes through unchanged,
    and relative paths still resolve (ranks inherit the working directory, also inside namespaces).
    """
    import subprocess
    import sys

    argv, rest, i = list(args._argv), [], 0
    while i < len(argv):
        flag, _, inline = argv[i].partition("=")
        if flag in _ONE_SHOT:
            i += 1 if inline or not _ONE_SHOT[flag] else 2
            continue
        rest.append(argv[i])
        i += 1
    cmd = [sys.executable, "-m", "scaleout", "launch", "--nnodes", str(args.nnodes),
           "--nproc-per-node", str(args.nproc_per_node)]
    if args.netns:
        cmd += ["--netns", "--rate", args.rate]
    return subprocess.run([*cmd, "--", "scaleout", *rest]).returncode


def pyplot(say: bool = True) -> Any:
    """matplotlib.pyplot on the headless Agg backend, or None (after one line, if ``say``) when matplotlib
    is not installed: PNGs are optional everywhere (``pip install 'scaleout[plot]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if say:
            print("(no PNG: matplotlib is not installed; pip install 'scaleout[plot]')", flush=True)
        return None
    return plt
