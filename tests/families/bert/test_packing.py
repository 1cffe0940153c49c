"""Sequence packing: algorithms, exact histograms, sequence assignment, histogram files,
``scaleout data pack``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import WIKI_HIST as WIKI  # noqa: E402 -- the packaged copy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scaleout.cli import main as cli_main
from scaleout.errors import UserError
from scaleout.families.bert.packing import (
    ALGORITHMS,
    Strategy,
    assign_sequences,
    histogram_from_lengths,
    load_histogram,
    pack_histogram,
    parse_histogram,
    speedup_ceiling,
)

# SQuAD 1.1 at max_len 384 (Graphcore's histograms.py, arXiv 2107.02027): a QA histogram unlike
# Wikipedia's
SQUAD = Path(__file__).parents[2] / "data" / "squad_1_1_seqlen_hist_384.txt"


@pytest.fixture(scope="module")
def wiki() -> np.ndarray:
    return load_histogram(WIKI, 512)


@pytest.mark.multi_process
def test_wikipedia_bars(wiki):
    """The bars: <=3 per pack >= 0.9975 in <= 1 s, <=12 per pack >= 0.9981 in <= 50 ms; ours
    (lphp) beats the published NNLSHP (0.9975) and LPFHP (0.9981) at both depths."""
    assert speedup_ceiling(wiki) == pytest.approx(2.0013, abs=1e-4)
    lp3 = pack_histogram(wiki, 512, 3, "lphp")
    assert lp3.efficiency >= 0.9988 and max(lp3.depth_histogram()) <= 3
    assert (
        lp3.cpu_seconds < 1.0
    )  # ~0.3 s CPU here (wall time swings with the other jobs on this box)
    lp12 = pack_histogram(wiki, 512, 12, "lphp")
    assert lp12.efficiency >= 0.9997 and max(lp12.depth_histogram()) <= 12
    lf12 = pack_histogram(wiki, 512, 12, "lpfhp")
    assert lf12.efficiency >= 0.9981 and lf12.cpu_seconds < 0.05
    sp12 = pack_histogram(wiki, 512, 12, "spfhp")
    assert sp12.efficiency == pytest.approx(0.99604, abs=5e-5)  # the paper's SPFHP number
    auto3 = pack_histogram(wiki, 512, 3, "auto")
    assert auto3.algorithm == "lphp" and auto3.num_packs == lp3.num_packs
    assert (
        "nnlshp" in auto3.notes["auto_skipped"]
    )  # too big for auto's NNLS; lphp beats it (see below)
    for s in (lp3, lp12, lf12, sp12):
        assert np.array_equal(s.histogram(), wiki)  # every sequence exactly once
        assert s.speedup == pytest.approx(s.num_sequences / s.num_packs)


def _random_hist(rng: np.random.Generator, max_len: int) -> np.ndarray:
    h = np.zeros(max_len + 1, dtype=np.int64)
    lengths = rng.integers(1, max_len + 1, size=int(rng.integers(1, 400)))
    np.add.at(h, lengths, rng.integers(1, 50, size=len(lengths)))
    return h


@pytest.mark.unit
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_strategies_reproduce_random_histograms(algorithm):
    rng = np.random.default_rng(7)
    for trial in range(6):
        max_len = int(rng.choice([8, 33, 64, 128]))
        k = int(rng.integers(1, 6))
        h = _random_hist(rng, max_len)
        s = pack_histogram(h, max_len, k, algorithm)
        assert np.array_equal(s.histogram(), h), (trial, algorithm)
        for pack, n in s.packs.items():
            assert n > 0 and len(pack) <= k and sum(pack) <= max_len
        assert s.num_packs >= -(
            -int((h * np.arange(len(h))).sum()) // max_len
        )  # never beats the bound
        if k == 1:
            assert s.num_packs == h.sum()


@pytest.mark.unit
def test_lphp_not_worse_than_baselines_on_skewed_histograms():
    """Ours vs the published ones on BERT-like shapes (many short + a spike at max_len)."""
    rng = np.random.default_rng(3)
    for max_len in (64, 128):
        lengths = np.clip(rng.gamma(2.0, max_len / 6, size=100_000).astype(int) + 1, 1, max_len)
        lengths[:20_000] = max_len
        h = histogram_from_lengths(lengths, max_len)
        ours = pack_histogram(h, max_len, 3, "lphp").efficiency
        for base in ("spfhp", "lpfhp", "nnlshp"):
            assert ours >= pack_histogram(h, max_len, 3, base).efficiency - 1e-9, base


@pytest.mark.unit
def test_assignment_exactly_once_and_deterministic():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 65, size=3000)
    ids = rng.permutation(10_000)[:3000] + 100
    s = pack_histogram(histogram_from_lengths(lengths, 64), 64, 3, "lphp")
    a = assign_sequences(s, lengths, seed=5, ids=ids)
    flat = np.concatenate([np.array(p) for p in a.packs()])
    assert sorted(flat.tolist()) == sorted(ids.tolist())  # every sequence exactly once
    length_of = dict(zip(ids.tolist(), lengths.tolist(), strict=True))
    got: dict[tuple, int] = {}
    for p in a.packs():
        key = tuple(sorted((length_of[i] for i in p), reverse=True))
        got[key] = got.get(key, 0) + 1
    assert got == s.packs  # the packs follow the strategy
    b = assign_sequences(s, lengths, seed=5, ids=ids)
    c = assign_sequences(s, lengths, seed=6, ids=ids)
    assert np.array_equal(a.ids, b.ids) and not np.array_equal(a.ids, c.ids)
    with pytest.raises(UserError, match="length"):
        assign_sequences(s, lengths[:-1], seed=0)


@pytest.mark.unit
def test_strategy_json_roundtrip():
    s = pack_histogram(histogram_from_lengths([5, 7, 9, 30, 31, 32], 32), 32, 2, "lpfhp")
    t = Strategy.from_json(json.dumps(s.to_json()))
    assert t.packs == s.packs and t.max_len == 32
    with pytest.raises(UserError, match="not a packing strategy"):
        Strategy.from_json({"algorithm": "x"})


@pytest.mark.unit
@pytest.mark.parametrize(
    "text, max_len, match",
    [
        ("5 10\n6 -3\n", 512, "count -3 for length 6 must be >= 0"),
        ("5 10\n600 3\n", 512, "length 600 is longer than max_len=512"),
        ("5 10\nabc 3\n", 512, "expected two integers"),
        ("5 ten\n", 512, "expected two integers"),
        ("# only comments\n\n", 512, "empty histogram"),
        ("5 0\n6 0\n", 512, "empty histogram"),
        ("5 1 2\n", 512, "expected 'length count'"),
        ("0 4\n", 512, "length 0 must be >= 1"),
        ("5 1\n5 2\n", 512, "appears twice"),
        ("5 1\n", 0, "max_len=0 must be an integer >= 1"),
    ],
)
def test_bad_histogram_text(text, max_len, match):
    with pytest.raises(UserError, match=match) as info:
        parse_histogram(text, max_len, source="h.txt")
    assert "\n" not in str(info.value)


@pytest.mark.unit
def test_bad_arguments():
    h = histogram_from_lengths([3, 7], 8)
    with pytest.raises(UserError, match="max_per_pack=0"):
        pack_histogram(h, 8, 0)
    with pytest.raises(UserError, match="'magic' is not one of"):
        pack_histogram(h, 8, 2, "magic")
    with pytest.raises(UserError, match="longer than max_len=4"):
        pack_histogram(h, 4, 2)
    with pytest.raises(UserError, match="outside 1..max_len=8"):
        histogram_from_lengths([3, 9], 8)


@pytest.mark.full_system
def test_cli_pack(tmp_path, capsys):
    hist = tmp_path / "h.txt"
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 129, size=5000)
    h = histogram_from_lengths(lengths, 128)
    hist.write_text("# test\n" + "".join(f"{i} {c}\n" for i, c in enumerate(h) if i))
    out = tmp_path / "s.json"
    assert (
        cli_main(
            [
                "data",
                "pack",
                str(hist),
                "--max-len",
                "128",
                "--max-per-pack",
                "3",
                "--out",
                str(out),
                "--packing",
                "spfhp,lpfhp,lphp",
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    for name in ("spfhp", "lpfhp", "lphp", "efficiency"):
        assert name in table
    data = json.loads(out.read_text())
    s = Strategy.from_json(data)
    assert np.array_equal(s.histogram(), h)
    assert data["efficiency"] == max(
        c["efficiency"] for c in data["compared"]
    )  # the best one is written
    assert {c["algorithm"] for c in data["compared"]} == {"spfhp", "lpfhp", "lphp"}
    # a dataset of lengths: packed data (ids per pack) is written too
    lens = tmp_path / "lengths.txt"
    lens.write_text("\n".join(map(str, lengths)))
    packed = tmp_path / "packed.npz"
    assert (
        cli_main(
            [
                "data",
                "pack",
                "--lengths",
                str(lens),
                "--max-len",
                "128",
                "--packing",
                "lpfhp",
                "--out",
                str(out),
                "--packed-out",
                str(packed),
            ]
        )
        == 0
    )
    z = np.load(packed)
    assert sorted(z["ids"].tolist()) == list(range(len(lengths)))
    assert len(z["offsets"]) - 1 == Strategy.from_json(json.loads(out.read_text())).num_packs
    bad = tmp_path / "bad.txt"
    bad.write_text("5 10\n7 -1\n")
    assert cli_main(["data", "pack", str(bad), "--max-len", "128"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "count -1 for length 7" in err
    assert cli_main(["data", "pack", str(hist), "--max-len", "0"]) == 2
    assert "max_len=0" in capsys.readouterr().err


@pytest.mark.multi_process
@pytest.mark.slow
def test_nnlshp_reaches_the_paper_on_wikipedia(wiki):
    """The paper's procedure (every composition of 512 into <= 3 lengths, 0.09 weight on lengths
    <= 8, rint, (l, 512 - l) residual packs): 0.9975 published; ours 0.99746. lphp stays above
    it."""
    s = pack_histogram(wiki, 512, 3, "nnlshp")
    assert round(s.efficiency, 4) == 0.9975 and s.efficiency >= 0.99745
    assert s.speedup == pytest.approx(1.99625, abs=2e-4)  # the paper's "achieved speed-up"
    assert pack_histogram(wiki, 512, 3, "lphp").efficiency > s.efficiency


@pytest.mark.multi_process
def test_squad_auto_beats_every_candidate_and_nnlshp_matches_the_paper_code():
    """On SQuAD-384 at depth 3 lphp alone loses to LPFHP and SPFHP (its balanced filter); auto
    does not. NNLSHP must equal what Graphcore's nnlshp.py gives on this histogram (0.97386, run
    with their code's procedure); before the fix (patterns through present lengths only) it gave
    0.95782."""
    h = load_histogram(SQUAD, 384)
    got = {a: pack_histogram(h, 384, 3, a) for a in ("spfhp", "lpfhp", "lphp", "nnlshp")}
    assert (
        got["lphp"].efficiency < got["lpfhp"].efficiency
    )  # the reported weakness, still true of lphp alone
    assert got["nnlshp"].efficiency == pytest.approx(0.973863, abs=2e-6)
    auto = pack_histogram(h, 384, 3, "auto")
    assert auto.num_packs <= min(s.num_packs for s in got.values())
    assert auto.efficiency >= 0.9879 and auto.algorithm == "lphp-full"
    assert set(auto.notes["auto"]) == {"spfhp", "lpfhp", "lphp", "lphp-full", "nnlshp"}
    assert np.array_equal(auto.histogram(), h)


@st.composite
def histograms(draw):
    """Random histograms of three shapes: uniform-random lengths, BERT-like skew (a gamma body
    plus a spike at max_len) and a few isolated lengths (sparse, where exact-fill packs are
    rare)."""
    max_len = draw(st.integers(8, 96))
    kind = draw(st.sampled_from(["random", "skewed", "sparse"]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    h = np.zeros(max_len + 1, dtype=np.int64)
    if kind == "random":
        lengths = rng.integers(1, max_len + 1, size=int(rng.integers(1, 200)))
        np.add.at(h, lengths, rng.integers(1, 60, size=len(lengths)))
    elif kind == "skewed":
        n = int(rng.integers(50, 3000))
        lengths = np.clip(
            rng.gamma(float(rng.uniform(0.5, 4)), max_len / 6, size=n).astype(int) + 1, 1, max_len
        )
        h += np.bincount(lengths, minlength=max_len + 1)
        h[max_len] += int(rng.integers(0, n // 2 + 1))
    else:
        for length in rng.choice(
            np.arange(1, max_len + 1), size=int(rng.integers(1, 6)), replace=False
        ):
            h[length] = int(rng.integers(1, 500))
    return h, max_len, draw(st.integers(1, 4))


@pytest.mark.multi_process
@given(histograms())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_auto_is_never_worse_than_spfhp_lpfhp_nnlshp(case):
    """Property: at the same depth auto needs no more packs (= is at least as efficient) than
    SPFHP, LPFHP and NNLSHP, and packs the histogram exactly within the limits."""
    h, max_len, k = case
    auto = pack_histogram(h, max_len, k, "auto")
    assert np.array_equal(auto.histogram(), h)
    assert all(len(p) <= k and sum(p) <= max_len for p in auto.packs)
    assert not auto.notes["auto_skipped"]  # small problems: every candidate ran
    for name in ("spfhp", "lpfhp", "nnlshp"):
        assert auto.num_packs <= pack_histogram(h, max_len, k, name).num_packs, name


@pytest.mark.unit
@pytest.mark.parametrize(
    "packs, match",
    [
        ({(5, 3): 0}, "count 0"),
        ({(5, 3, 1): 2}, "holds 3 sequences"),
        ({(6, 5): 1}, "11 tokens"),
        ({(5, 3): 1}, "packs 0 sequences of length 2"),
    ],
)
def test_strategy_validate_raises_real_errors(packs, match):
    """Strategy.validate guards what reaches training: UserError (one line), not an assert that
    -O drops."""
    h = histogram_from_lengths([5, 3], 8)
    if "length 2" in match:
        h = histogram_from_lengths([5, 3, 2], 8)
    with pytest.raises(UserError, match=match) as info:
        Strategy("t", 8, 2, packs).validate(h)
    assert "\n" not in str(info.value)


@pytest.mark.full_system
def test_strategy_validate_survives_python_O(tmp_path):
    import subprocess
    import sys

    code = (
        "from scaleout.families.bert.packing import Strategy, histogram_from_lengths\n"
        "try:\n    Strategy('t', 8, 2, {(5, 3): 1}).validate(histogram_from_lengths([5, 3, 2], "
        "8))\n"
        "except Exception as e:\n    print(type(e).__name__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-O", "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[3],
    )
    assert out.stdout.strip() == "UserError"
