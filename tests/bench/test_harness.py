"""The benchmark harness and the shared argument parsers: interleaving order, the comparison with
the baseline, and one-line errors for bad comma lists and sizes."""

from __future__ import annotations

import argparse

import pytest

from scaleout.argtypes import csv_of, fmt_bytes, parse_csv, parse_size, parse_sizes
from scaleout.bench._harness import Timing, compare, interleave, paired, sum_rounds
from scaleout.errors import UserError
from scaleout.output import format_table

pytestmark = pytest.mark.unit


def test_interleave_alternates_the_order_and_skips_the_warmup() -> None:
    calls: list[str] = []
    variants = {k: (lambda k=k: calls.append(k) or k) for k in "abc"}
    out = interleave(variants, repeats=3, warmup=1)
    assert calls == list("abccbaabccba")  # round 0 is the warm-up
    assert {k: len(v) for k, v in out.items()} == {"a": 3, "b": 3, "c": 3}
    assert [t.value for t in out["b"]] == ["b"] * 3
    calls.clear()
    interleave(variants, repeats=2, alternate=False, after_round=lambda i: calls.append(f"#{i}"))
    assert calls == ["a", "b", "c", "#0", "a", "b", "c", "#1"]


def test_compare_and_paired_ratios_against_the_baseline() -> None:
    samples = {
        "base": [Timing(2.0, 1.0), Timing(4.0, 2.0), Timing(3.0, 1.5)],
        "fast": [Timing(1.0, 1.0), Timing(1.0, 1.0), Timing(3.0, 1.0)],
    }
    rows = {r.name: r for r in compare(samples, baseline="base")}
    assert rows["base"].speedup == rows["base"].paired_speedup == 1.0
    assert rows["fast"].median_s == 1.0 and rows["fast"].speedup == 3.0  # median 3 / median 1
    assert rows["fast"].paired_speedup == 2.0  # median of 2/1, 4/1, 3/3
    assert rows["fast"].cpu_speedup == paired(samples["base"], samples["fast"], "cpu") == 1.5
    assert (rows["fast"].min_s, rows["fast"].max_s, rows["fast"].times_s) == (
        1.0,
        3.0,
        [1.0, 1.0, 3.0],
    )


def test_sum_rounds_groups_variants_round_by_round() -> None:
    samples = {
        ("packed", 0): [Timing(1.0, 0.5), Timing(2.0, 1.0)],
        ("padded", 0): [Timing(3.0, 3.0), Timing(3.0, 3.0)],
        ("packed", 1): [Timing(1.0, 0.5), Timing(1.0, 0.5)],
    }
    out = sum_rounds(samples, group=lambda key: key[0])
    assert [(t.wall, t.cpu) for t in out["packed"]] == [(2.0, 1.0), (3.0, 1.5)]
    assert [(t.wall, t.cpu) for t in out["padded"]] == [(3.0, 3.0), (3.0, 3.0)]


def test_comma_lists_and_sizes() -> None:
    assert parse_csv(" 1, 2,4 ", "--world", int, at_least=1) == [1, 2, 4]
    assert parse_csv("", "--chunks", int, allow_empty=True) == []
    for bad, match in (
        ("1,x", "--world='1,x': expected a comma list of integers"),
        ("0,2", "expected integers >= 1"),
        ("", "--world=''"),
    ):
        with pytest.raises(UserError, match=match):
            parse_csv(bad, "--world", int, at_least=1)
    with pytest.raises(UserError, match="--models: 'gpt' is not one of bert, resnet"):
        parse_csv("bert,gpt", "--models", choices=("bert", "resnet"))
    with pytest.raises(argparse.ArgumentTypeError, match="expected a comma list of numbers"):
        csv_of(float)("1e-3,x")
    assert csv_of(float)("1e-3, 2e-3") == [1e-3, 2e-3]
    assert (
        parse_sizes("4KiB..64KiB,1M") == [4096, 16384, 65536, 1 << 20]
        and parse_size("8", "-b") == 8
    )
    with pytest.raises(UserError, match="-e: '4QB' is not a size"):
        parse_size("4QB", "-e")
    assert [fmt_bytes(n) for n in (4096, 3 << 20, 3000)] == ["4KiB", "3MiB", "3000B"]


def test_format_table_is_markdown() -> None:
    text = format_table(["a", "bb"], [[1.23456, "x"], [12345.6, "yy"]])
    assert text.splitlines() == [
        "| a     | bb |",
        "|-------|----|",
        "| 1.235 | x  |",
        "| 12346 | yy |",
    ]
