"""Slurm nodelist grammar: a table of cases plus a property test against an independent expansion.

Agreement with the real ``scontrol show hostnames`` is checked in tests/launchers/test_slurm.py
(needs Slurm).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scaleout.env.nodelist import expand_nodelist, parse_tasks_per_node
from scaleout.errors import NodelistError

CASES = [
    ("n1", ["n1"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("gpu[001-004,007]", ["gpu001", "gpu002", "gpu003", "gpu004", "gpu007"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("a,b[1-2],c-d", ["a", "b1", "b2", "c-d"]),
    ("node-[1,3]-ib", ["node-1-ib", "node-3-ib"]),
    ("x[1-2]y[3]z", ["x1y3z", "x2y3z"]),
    ("dgx-a100-[0001-0002]", ["dgx-a100-0001", "dgx-a100-0002"]),
    ("n[1-2],m[5]", ["n1", "n2", "m5"]),
    ("[1-2]", ["1", "2"]),
    ("h[7]", ["h7"]),
]


@pytest.mark.unit
@pytest.mark.parametrize(("text", "hosts"), CASES)
def test_expand_table(text: str, hosts: list[str]) -> None:
    assert expand_nodelist(text) == hosts


@pytest.mark.unit
@pytest.mark.parametrize(
    "bad",
    [
        "",
        "   ",
        "n[1-3",
        "n1-3]",
        "n[]",
        "n[3-1]",
        "n[a-b]",
        "n[1-]",
        "a,,b",
        "n[1[2]]",
        "n[1 -2]",
        "n[1-2],",
    ],
)
def test_bad_nodelists_name_the_input(bad: str) -> None:
    with pytest.raises(NodelistError) as exc:
        expand_nodelist(bad)
    msg = str(exc.value)
    assert "\n" not in msg and repr(bad) in msg


@pytest.mark.unit
def test_tasks_per_node() -> None:
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("8(x256)") == [8] * 256
    assert parse_tasks_per_node("4,2,4", nnodes=3) == [4, 2, 4]
    with pytest.raises(NodelistError, match="expected 2"):
        parse_tasks_per_node("2(x3)", nnodes=2)
    with pytest.raises(NodelistError, match="bad item"):
        parse_tasks_per_node("2(xz)")


# -- property test: build a random nodelist from parts, render it, and expand it independently
# ----------
_prefix = st.text(alphabet="abcxyz-", min_size=1, max_size=4).filter(lambda s: not s[-1].isdigit())


@st.composite
def _ranges(draw):
    """A bracket body plus its independent expansion (list of zero-padded strings)."""
    width = draw(st.integers(1, 4))
    parts, expanded = [], []
    for _ in range(draw(st.integers(1, 3))):
        lo = draw(st.integers(0, 10**width - 1))
        hi = draw(st.integers(lo, min(lo + 5, 10**width - 1)))
        lo_s = f"{lo:0{width}d}"
        if hi == lo and draw(st.booleans()):
            parts.append(lo_s)
            expanded.append(lo_s)
        else:
            parts.append(f"{lo_s}-{hi}")
            # Slurm pads every host to the width of the low bound, whatever the high bound is
            # written as.
            expanded.extend(f"{n:0{width}d}" for n in range(lo, hi + 1))
    return ",".join(parts), expanded


@st.composite
def _item(draw):
    text, hosts = draw(_prefix), [""]
    hosts = [text]
    for _ in range(draw(st.integers(0, 2))):
        body, exp = draw(_ranges())
        suffix = draw(st.sampled_from(["", "-", "-ib", "x"]))
        text += f"[{body}]{suffix}"
        hosts = [h + e + suffix for h in hosts for e in exp]  # leftmost group varies slowest
    return text, hosts


@pytest.mark.multi_process
@settings(max_examples=300, deadline=None)
@given(st.lists(_item(), min_size=1, max_size=4))
def test_expand_matches_independent_expansion(items) -> None:
    text = ",".join(t for t, _ in items)
    expected = [h for _, hs in items for h in hs]
    assert expand_nodelist(text) == expected
