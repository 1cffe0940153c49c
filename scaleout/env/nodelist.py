"""Slurm hostlist grammar: ``gpu[001-004,007]``, ``rack[1-2]-n[01-02]``, ``a,b[1-3],c-d``.

A recursive-descent parser, not a regex: a list is items separated by top-level commas; an item is a
sequence of literal text and bracket groups; a bracket group is a comma list of ``N`` or ``LO-HI``
whose zero padding is the width of ``LO`` (as Slurm does). Several bracket groups in one item expand
as a cartesian product with the leftmost group varying slowest, which is what ``scontrol show
hostnames`` prints.

Also how a run names its nodes (:func:`node_names`, from each rank's :func:`link_record`): doctor's
verdicts and the trainer's quarantine verdicts use the same names.
"""

from __future__ import annotations

import itertools
import os
import re
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from scaleout.errors import NodelistError
from scaleout.netinfo import env_netns, link_speed_bps, route_to

_MAX_HOSTS = 1_000_000


def _split_top(text: str, full: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            if depth:
                raise NodelistError(f"nodelist {full!r}: nested '[' at position {i}")
            depth = 1
        elif ch == "]":
            if not depth:
                raise NodelistError(f"nodelist {full!r}: ']' without '[' at position {i}")
            depth = 0
        elif ch == "," and not depth:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise NodelistError(f"nodelist {full!r}: unclosed '['")
    items.append(text[start:])
    return items


def _expand_range(spec: str, full: str) -> list[str]:
    out: list[str] = []
    for part in spec.split(","):
        part = part.strip()
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise NodelistError(
                f"nodelist {full!r}: bad range {part!r} in '[{spec}]' (expected N or LO-HI digits)"
            )
        width = len(lo)
        a, b = int(lo), int(hi) if dash else int(lo)
        if b < a:
            raise NodelistError(f"nodelist {full!r}: descending range {part!r}")
        if b - a >= _MAX_HOSTS:
            raise NodelistError(
                f"nodelist {full!r}: range {part!r} has more than {_MAX_HOSTS} hosts"
            )
        out.extend(str(n).zfill(width) for n in range(a, b + 1))
    return out


def _expand_item(item: str, full: str, budget: int) -> list[str]:
    """One item's hosts; ``budget`` is how many hosts the whole list may still add (checked
    before the cartesian product is built, so ``n[0-999999]b[0-9]`` never materialises ten
    million names)."""
    pieces: list[list[str]] = []
    i = 0
    while i < len(item):
        if item[i] == "[":
            j = item.index("]", i)
            inner = item[i + 1 : j]
            if not inner:
                raise NodelistError(f"nodelist {full!r}: empty '[]'")
            pieces.append(_expand_range(inner, full))
            i = j + 1
        else:
            j = item.find("[", i)
            j = len(item) if j < 0 else j
            pieces.append([item[i:j]])
            i = j
    count = 1
    for piece in pieces:
        count *= len(piece)
        if count > budget:
            raise NodelistError(f"nodelist {full!r}: more than {_MAX_HOSTS} hosts")
    return ["".join(combo) for combo in itertools.product(*pieces)]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm nodelist into host names, in the order ``scontrol show hostnames`` gives."""
    if nodelist is None or not nodelist.strip():
        raise NodelistError(f"nodelist {nodelist!r} is empty (expected e.g. 'gpu[001-004]')")
    text = nodelist.strip()
    if any(ch.isspace() for ch in text):
        raise NodelistError(f"nodelist {nodelist!r}: contains whitespace")
    hosts: list[str] = []
    for item in _split_top(text, nodelist):
        if not item:
            raise NodelistError(f"nodelist {nodelist!r}: empty item between commas")
        hosts.extend(_expand_item(item, nodelist, _MAX_HOSTS - len(hosts)))
    return hosts


def parse_tasks_per_node(spec: str, nnodes: int | None = None) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` such as ``2(x3),1`` -> ``[2, 2, 2, 1]``. Node counts are checked
    against ``nnodes`` (or the host cap) before anything is expanded."""
    limit = _MAX_HOSTS if nnodes is None else nnodes
    items: list[tuple[int, int]] = []
    for part in spec.strip().split(","):
        count, paren, rep = part.partition("(x")
        if paren and not rep.endswith(")"):
            raise NodelistError(
                f"SLURM_TASKS_PER_NODE={spec!r}: unclosed '(x' in {part!r} (expected N or N(xR))"
            )
        try:
            n = int(count)
            r = int(rep[:-1]) if paren else 1
        except ValueError:
            raise NodelistError(
                f"SLURM_TASKS_PER_NODE={spec!r}: bad item {part!r} (expected N or N(xR))"
            ) from None
        if n < 0 or r < 1:
            raise NodelistError(f"SLURM_TASKS_PER_NODE={spec!r}: bad item {part!r}")
        items.append((n, r))
        total = sum(r for _, r in items)
        if total > limit:
            what = f"expected {nnodes}" if nnodes is not None else f"expected at most {_MAX_HOSTS}"
            raise NodelistError(
                f"SLURM_TASKS_PER_NODE={spec!r} describes at least {total} nodes, {what}"
            )
    out = [n for n, r in items for _ in range(r)]
    if nnodes is not None and len(out) != nnodes:
        raise NodelistError(
            f"SLURM_TASKS_PER_NODE={spec!r} describes {len(out)} nodes, expected {nnodes}"
        )
    return out


def compress_hostlist(hosts: list[str]) -> str:
    """The inverse of :func:`expand_nodelist` for a plain list: ``n1, n2, n3, n7, gpu`` ->
    ``gpu,n[1-3,7]``, each name once. Names that end in digits are grouped by the text before them
    and the digits' width (``n01`` and ``n1`` stay apart, so expanding gives the names back), runs
    of consecutive numbers become ``LO-HI``; a group of one keeps its plain name."""
    groups: dict[tuple[str, int], set[int]] = {}
    plain: set[str] = set()
    for host in hosts:
        m = re.fullmatch(r"(.*?)(\d+)", host)
        if m is None or "[" in host or "," in host:
            plain.add(host)
            continue
        digits = m.group(2)
        width = len(digits) if digits.startswith("0") else 0
        groups.setdefault((m.group(1), width), set()).add(int(digits))
    items: list[tuple[str, str]] = [(h, h) for h in plain]
    for (prefix, width), numbers in groups.items():
        nums = sorted(numbers)
        if len(nums) == 1:
            name = f"{prefix}{str(nums[0]).zfill(width)}"
            items.append((name, name))
            continue
        runs, start = [], nums[0]
        for a, b in itertools.pairwise([*nums, None]):
            if b is None or b != a + 1:
                lo, hi = str(start).zfill(width), str(a).zfill(width)
                runs.append(lo if start == a else f"{lo}-{hi}")
                start = b
        items.append((prefix, f"{prefix}[{','.join(runs)}]"))
    return ",".join(text for _, text in sorted(items))


def node_names(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """One name per node: its host name when every node has its own, else (several emulated nodes
    on one host) the netns namespace (``<cluster>-n<i>``) or ``<host>-node<i>``."""
    by_node: dict[int, str] = {}
    for r in records:
        by_node.setdefault(int(r["node"]), str(r["host"]))
    k = max(by_node) + 1 if by_node else 0
    hosts = [by_node.get(i, "?") for i in range(k)]
    if len(set(hosts)) == k:
        return hosts
    netns = {int(r["node"]): r.get("netns") for r in records}
    return [f"{netns[i]}-n{i}" if netns.get(i) else f"{hosts[i]}-node{i}" for i in range(k)]


def link_record(world: Any) -> dict[str, Any]:
    """This rank's node, host and inter-node link rate, as doctor records them: what the trainer
    exchanges once at start-up to credit a slow link (scaleout/train/skew.py) and to name nodes
    in its quarantine verdicts the way doctor does (:func:`node_names`). Under Slurm the host is
    Slurm's node name (``SLURMD_NODENAME``: what ``--exclude`` takes, also where several slurmd
    share one machine)."""
    iface = route_to(world.master_addr or "127.0.0.1")["iface"]
    return {
        "rank": world.rank,
        "node": world.node_of[world.rank],
        "host": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        "netns": env_netns(),
        # loopback (ranks emulating nodes on one host) has no rate: skip asking tc
        "link_bps": link_speed_bps(iface) if iface and iface != "lo" else None,
    }
