"""The `scaleout bench ttt` PNG: redrawn from the shipped JSON results without running anything,
one legend entry and one colour per recipe, each entry naming the recipe's median time-to-train."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import matplotlib  # noqa: F401  (the test extra installs it: a missing one is a failure)
import pytest

import scaleout.output
from scaleout.bench import _ttt_plot

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


def _capture(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Record every axis' legend (labels, colours) of the figure just before it is written."""
    seen: list[dict[str, Any]] = []
    real = scaleout.output.save_figure

    def spy(fig: Any, path: Any, dpi: int = 120) -> Path:
        for ax in fig.axes:
            leg = ax.get_legend()
            if ax.get_visible() and leg is not None:
                seen.append(
                    {
                        "title": ax.get_title(),
                        "labels": [t.get_text() for t in leg.get_texts()],
                        "colors": [h.get_color() for h in leg.legend_handles],
                    }
                )
        return real(fig, path, dpi)

    monkeypatch.setattr(scaleout.output, "save_figure", spy)
    return seen


@pytest.mark.unit
@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("ttt-netns-2x2", "scaleout: median 26.1 s (3/3 seeds)"),
        ("ttt-resnet-netns-2x2", "scaleout: median 61.4 s (3/3 seeds)"),
    ],
)
def test_redraw_from_the_shipped_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, says: str
) -> None:
    seen = _capture(monkeypatch)
    out = tmp_path / f"{name}.png"
    assert _ttt_plot.main([str(RESULTS / f"{name}.json"), str(out)]) == 0
    assert out.stat().st_size > 20_000  # a drawn figure, not an empty canvas
    head, why = seen  # two panels: the head to head and the ablation
    assert says in head["labels"]
    assert "emulated cluster" in head["title"] and "netns" not in head["title"]
    assert any(lab.startswith("step 2: + ") for lab in why["labels"])
    for panel in seen:
        assert len(set(panel["labels"])) == len(panel["labels"]), panel["labels"]
        assert len(set(panel["colors"])) == len(panel["colors"]), panel["colors"]


@pytest.mark.unit
def test_a_recipe_short_of_the_target_says_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two of three scaleout seeds miss the target: its median is no number."""
    data = json.loads((RESULTS / "ttt-netns-2x2.json").read_text())
    rows = copy.deepcopy(data["runs"])
    for r in rows:
        if r["recipe"] == "scaleout" and r["seed"] in (1, 2):
            r["ttt_s"], r["reached"] = None, False
    seen = _capture(monkeypatch)
    assert _ttt_plot.plot(rows, data["target"], tmp_path / "x.png", "t") is not None
    assert "scaleout: median > budget (1/3 seeds)" in seen[0]["labels"]
