"""The PNG of ``scaleout bench ttt``, and a redraw of it from the JSON the bench wrote.

Per cluster two panels: the head to head (best baseline, scaleout, sharded scaleout) and where the
gain comes from (the baseline's learning-rate sweep in grey, then the ablation chain). Each recipe
has one colour; each seed is a thin line of that colour, and a dashed vertical line of the same
colour marks the recipe's median time-to-train over seeds, so the claim reads off the x axis.

Redraw without rerunning anything::

    python3 -m scaleout.bench._ttt_plot docs/results/ttt-netns-2x2.json \
        docs/results/ttt-netns-2x2.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

# Fixed colours for the recipes that appear in both panels, so a reader matches them by eye.
BASELINE, SCALEOUT, SHARDED, SWEEP = "#333333", "#1f5fbf", "#e07b00", "#b0b0b0"
# The ablation's steps: distinct hues, none of them close to the four above.
STEPS = ["#9b59b6", "#2ca02c", "#d62728", "#8c564b", "#17becf"]
CHAIN = {
    "bert": ["abl-framework", "abl-packing", "abl-comm", "abl-lamb"],
    "resnet": ["abl-framework", "abl-lars", "abl-groupbn", "abl-comm"],
    "llama": ["abl-framework", "abl-docmask", "abl-comm"],
}
# each task's metric, as the tables and the y axis name it
METRIC = {"bert": "masked-LM accuracy", "resnet": "top-1", "llama": "log-perplexity"}


def _median_ttt(runs: list[dict[str, Any]]) -> float | None:
    """Median over seeds with an unreached seed as +inf: a number only when most seeds reached."""
    ttts = sorted(r["ttt_s"] if r["ttt_s"] is not None else float("inf") for r in runs)
    m = statistics.median(ttts) if ttts else float("inf")
    return None if m == float("inf") else m


def _where(cluster: str, info: dict[str, Any] | None) -> str:
    """The cluster in words (the panels' title), not the bench's short name."""
    if not info:
        return cluster
    n, g = info["nnodes"], info["nproc_per_node"]
    shape = f"{n} node{'s' if n != 1 else ''} x {g} rank{'s' if g != 1 else ''}"
    if cluster == "netns":
        rate = f", {info['rate']} links" if info.get("rate") else ""
        return f"emulated cluster (network namespaces): {shape}{rate}"
    return f"one machine: {shape} (loopback, no rate limit)"


def _draw(
    ax: Any,
    runs: list[dict[str, Any]],
    color: str,
    name: str,
    lw: float = 1.0,
    alpha: float = 0.55,
) -> None:
    """Every seed thin in one colour; the median ttt as a dashed vertical; one legend entry."""
    if not runs:
        return
    for r in runs:
        ax.plot(
            [p[0] for p in r["curve"]],
            [p[2] for p in r["curve"]],
            color=color,
            lw=lw,
            alpha=alpha,
        )
    med = _median_ttt(runs)
    reached = sum(1 for r in runs if r["reached"])
    said = f"median {med:.1f} s" if med is not None else "median > budget"
    if med is not None:
        ax.axvline(med, color=color, lw=1.6, ls="--")
    # The legend entry: a thick line of the recipe's colour with its median and seed count.
    ax.plot([], [], color=color, lw=2.5, label=f"{name}: {said} ({reached}/{len(runs)} seeds)")


def _axes(ax: Any, target: float, metric: str, title: str) -> None:
    ax.axhline(target, color="k", lw=0.8, ls=":")
    ax.plot([], [], color="k", lw=0.8, ls=":", label=f"target {metric} {target:g}")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("wall time since MLPerf run_start (s)")
    ax.set_ylabel(metric)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.25)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=1, frameon=False)


def plot(
    rows: list[dict[str, Any]],
    target: float,
    path: str | Path,
    title: str,
    metric: str = "eval masked-LM accuracy",
    clusters: dict[str, dict[str, Any]] | None = None,
    task: str = "bert",
) -> Path | None:
    """Accuracy against wall time since run_start; per cluster a head-to-head panel and, when
    the run had a sweep or an ablation, a panel of both. ``clusters``: name -> {nnodes,
    nproc_per_node, rate} (the JSON's ``results[name]["cluster"]``) for the panel titles."""
    from scaleout.output import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return None
    names = sorted({r["cluster"] for r in rows}, key=lambda c: c != "netns")
    chain = CHAIN.get(task, CHAIN["bert"])
    fig, axes = plt.subplots(
        len(names), 2, figsize=(14, 6.2 * len(names)), squeeze=False, sharey="row"
    )
    for (ax_head, ax_why), c in zip(axes, names, strict=True):
        mine = [r for r in rows if r["cluster"] == c]

        def runs(recipe: str, mine: list[dict[str, Any]] = mine) -> list[dict[str, Any]]:
            return sorted((r for r in mine if r["recipe"] == recipe), key=lambda r: r["seed"])

        base = runs("baseline")
        base_name = "baseline: torch DDP + " + (
            f"{base[0]['label'].split(' + ')[-1]} lr {base[0]['lr']:g}, batch {base[0]['batch']}"
            if base
            else "?"
        )
        where = _where(c, (clusters or {}).get(c))
        _draw(ax_head, base, BASELINE, base_name)
        _draw(ax_head, runs("scaleout"), SCALEOUT, "scaleout", lw=1.3, alpha=0.8)
        _draw(ax_head, runs("scaleout-sharded"), SHARDED, "scaleout, sharded optimizer")
        _axes(ax_head, target, metric, f"head to head, every seed\n{where}")

        sweep = [r for r in mine if r.get("sweep")]
        steps = [(s, runs(s)) for s in chain if runs(s)]
        if not sweep and not steps:
            ax_why.set_visible(False)
            continue
        for r in sweep:
            ax_why.plot([p[0] for p in r["curve"]], [p[2] for p in r["curve"]], color=SWEEP, lw=0.9)
        if sweep:
            ax_why.plot([], [], color=SWEEP, lw=2.5, label=f"baseline sweep ({len(sweep)} runs)")
        _draw(ax_why, base, BASELINE, "baseline (best of the sweep)")
        for k, (_, these) in enumerate(steps):
            label = f"step {k + 1}: " + ("" if k == 0 else "+ ") + these[0]["label"]
            _draw(ax_why, these, STEPS[k % len(STEPS)], label)
        everything = "scaleout (every ingredient on)"
        _draw(ax_why, runs("scaleout"), SCALEOUT, everything, lw=1.3, alpha=0.8)
        why = "where the gain comes from, one ingredient at a time"
        _axes(ax_why, target, metric, f"{why}\n{where}")
    fig.suptitle(title)
    fig.text(
        0.5,
        -0.01,
        "thin lines: one run per seed; dashed verticals: median time-to-train over seeds "
        "(MLPerf run_start -> run_stop); a run stops when it reaches the target",
        ha="center",
        fontsize=8,
    )
    fig.tight_layout()
    out = save_figure(fig, path, dpi=110)
    plt.close(fig)
    return out


def redraw(json_path: str | Path, png_path: str | Path) -> Path | None:
    """Draw the PNG again from a ``scaleout bench ttt --out`` JSON, without running anything."""
    data = json.loads(Path(json_path).read_text())
    return plot(
        data["runs"],
        data["target"],
        png_path,
        f"{data['config']}: time to train to {data['target']:g}",
        f"eval {METRIC[data.get('task', 'bert')]}",
        clusters={k: v["cluster"] for k, v in data.get("results", {}).items()},
        task=data.get("task", "bert"),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="the JSON a `scaleout bench ttt --out` run wrote")
    ap.add_argument("png", help="where to write the PNG")
    args = ap.parse_args(argv)
    return 0 if redraw(args.json, args.png) else 1


if __name__ == "__main__":
    raise SystemExit(main())
