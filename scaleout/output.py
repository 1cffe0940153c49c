"""Output helpers shared by the library and the driver side: Markdown tables, JSON with the
machine's description, and an optional matplotlib. Standard library only at import time
(``torch`` and ``matplotlib`` are imported when used), so ``scaleout --help`` and the rank-side
report stay light."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (readable in a terminal and pasteable into an issue)."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
        return str(v)

    cells = [[cell(v) for v in r] for r in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)
    ]

    def line(vals: Sequence[str]) -> str:
        return "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths, strict=True)) + " |"

    out = [line(list(headers)), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells]
    return "\n".join(out)


def machine_info() -> dict[str, Any]:
    """Where a result was measured: host, cores, torch, Python, CUDA, time."""
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
    """``payload`` plus ``machine`` as indented JSON at ``path`` (folders made); None when
    ``path`` is empty."""
    if not path:
        return None
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"machine": machine_info(), **payload}, indent=2, default=str))
    return p


def pyplot(say: bool = True) -> Any:
    """matplotlib.pyplot on the headless Agg backend, or None (after one line, if ``say``) when
    matplotlib is not installed: PNGs are optional everywhere (``pip install 'scaleout[plot]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if say:
            print("(no PNG: matplotlib is not installed; pip install 'scaleout[plot]')", flush=True)
        return None
    return plt


def save_figure(fig: Any, path: str | os.PathLike[str], dpi: int = 120) -> Path:
    """Write ``fig`` to ``path`` (folders made), close it, and say where."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=dpi, bbox_inches="tight")
    fig.clf()
    print(f"wrote {p}", flush=True)
    return p
