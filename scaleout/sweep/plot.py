"""PNG of a sweep: throughput and efficiency vs GPUs with the ideal line, and the step-time
breakdown."""

from __future__ import annotations

from pathlib import Path

from scaleout.output import pyplot
from scaleout.sweep.results import PHASES, PointResult


def plot(results: list[PointResult], path: str | Path, title: str) -> Path | None:
    """Three panels; returns the path, or None when matplotlib is missing or no point succeeded."""
    plt = pyplot(say=False)
    if plt is None:
        return None
    ok = [r for r in results if r.ok]
    if not ok:
        return None
    n = [r.point.world for r in ok]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.5))
    ax1.plot(n, [r.samples_per_s for r in ok], "o-", label="measured")
    ax1.plot(n, [r.ideal_samples_per_s for r in ok], "k--", label=f"ideal (linear from {n[0]})")
    ax1.set(xlabel="GPUs (ranks)", ylabel="samples/s", title="throughput")
    eff = [r.efficiency for r in ok]
    ax2.plot(n, [e * 100 if e is not None else float("nan") for e in eff], "o-", label="measured")
    sim = [r.simulated_efficiency for r in ok]
    if any(s is not None for s in sim):
        ax2.plot(
            n, [s * 100 if s is not None else float("nan") for s in sim], "s:", label="simulated"
        )
    ax2.axhline(100, color="k", linestyle="--", label="ideal")
    ax2.set(
        xlabel="GPUs (ranks)",
        ylabel="scaling efficiency (%)",
        title="efficiency",
        ylim=(0, max([110.0] + [e * 110 for e in eff + sim if e is not None])),
    )
    bottom = [0.0] * len(ok)
    labels = [str(x) for x in n]
    for phase in PHASES:
        vals = [r.breakdown_s.get(phase, 0.0) * 1e3 for r in ok]
        ax3.bar(labels, vals, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax3.set(xlabel="GPUs (ranks)", ylabel="ms per step (rank 0)", title="step time breakdown")
    for ax in (ax1, ax2):
        if n[-1] / n[0] >= 4:
            ax.set_xscale("log", base=2)
        ax.set_xticks(n, labels)
        ax.grid(alpha=0.3)
    for ax in (ax1, ax2, ax3):
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
