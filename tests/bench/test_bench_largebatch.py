"""`scaleout bench largebatch`: the recipe rule is the same for every run, and unreached targets say
so.

The full measurement (minutes) is the bench itself; here: the plan, the verdict, and one tiny
end-to-end run.
"""

from __future__ import annotations

import argparse
import json
import math

import pytest

from scaleout.bench import largebatch


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    largebatch.add_arguments(p)
    return largebatch.resolve(p.parse_args(list(argv)))


@pytest.mark.unit
def test_plan_one_rule_for_every_optimizer() -> None:
    a = _args(
        "--base-batch",
        "2",
        "--factor",
        "8",
        "--lamb-lr",
        "1e-2",
        "--adamw-lrs",
        "5e-4,1e-3",
        "--base-steps",
        "3200",
        "--eval-every",
        "2",
    )
    base, lamb8, *adamw = largebatch.plan(a)
    assert (base["optimizer"], base["batch"], base["lr"], base["max_steps"]) == (
        "lamb",
        2,
        1e-2,
        3200,
    )
    assert [r["base_lr"] for r in adamw] == [5e-4, 1e-3]
    for r in (
        lamb8,
        *adamw,
    ):  # sqrt(8) LR scaling, same sample budget, same eval interval in samples
        assert r["batch"] == 16 and r["max_steps"] == 400
        assert r["lr"] == pytest.approx(r["base_lr"] * math.sqrt(8))
        assert r["eval_every"] * r["batch"] == base["eval_every"] * base["batch"]
    with pytest.raises(SystemExit, match="warmup"):
        largebatch.plan(
            _args("--base-steps", "80", "optim.warmup_steps=20")
        )  # 10 large steps < 20 warm-up


@pytest.mark.unit
def test_verdict_counts_unreached_as_worse_and_not_as_a_number() -> None:
    row = lambda opt, steps: {"optimizer": opt, "steps": steps, "max_steps": 400}  # noqa: E731
    v = largebatch.verdict(
        [row("lamb", 1000), row("lamb", 190), row("adamw", None), row("adamw", 250)]
    )
    assert v["lamb_large_within_one_fifth"] and v["adamw_large_worse_than_lamb_large"]
    assert v["best_adamw_large_steps"] == 250 and v["lamb_large_steps_over_base"] == pytest.approx(
        0.19
    )
    v = largebatch.verdict([row("lamb", 1000), row("lamb", 201), row("adamw", 150)])
    assert not v["lamb_large_within_one_fifth"] and not v["adamw_large_worse_than_lamb_large"]
    assert largebatch.steps_cell(row("adamw", None)) == "> budget (400)"
    ok = largebatch.verdict([row("lamb", 1000), row("lamb", 150), row("adamw", None)])
    s = largebatch.summary([{"seed": 1, **ok}, {"seed": 2, **v}])  # every seed must pass
    assert not s["lamb_large_within_one_fifth"] and not s["adamw_large_worse_than_lamb_large"]
    assert s["lamb_large_steps_over_base"] == [pytest.approx(0.15), pytest.approx(0.201)]
    assert (
        largebatch.summary([{"seed": 1, **largebatch.verdict([row("lamb", 10), row("lamb", 2)])}])[
            "adamw_large_worse_than_lamb_large"
        ]
        is None
    )  # no AdamW run: no claim


@pytest.mark.full_system
def test_tiny_end_to_end_reports_budget(tmp_path, capsys) -> None:
    out = tmp_path / "lb.json"
    a = _args(
        "--base-batch",
        "1",
        "--factor",
        "2",
        "--base-steps",
        "6",
        "--eval-every",
        "1",
        "--adamw-lrs",
        "1e-3",
        "--seeds",
        "3,4",
        "--out",
        str(out),
        "--png",
        "",
        "optim.warmup_steps=1",
        "train.target=0.99",
        "model.bert.layers=1",
        "data.eval_samples=16",
    )
    assert largebatch.run(a) == 0
    res = json.loads(out.read_text())
    assert [(r["seed"], r["optimizer"], r["batch"], r["max_steps"]) for r in res["runs"]] == [
        (s, *r) for s in (3, 4) for r in [("lamb", 1, 6), ("lamb", 2, 3), ("adamw", 2, 3)]
    ]
    assert all(r["steps"] is None and r["status"] == "max_steps" for r in res["runs"])
    assert [p[0] for p in res["runs"][0]["curve"]] == [2, 4, 6] and [
        p[0] for p in res["runs"][1]["curve"]
    ] == [1, 2, 3]
    assert (
        res["verdict"]["lamb_large_within_one_fifth"] is False
        and len(res["verdict"]["per_seed"]) == 2
    )
    assert "> budget (6)" in capsys.readouterr().out
