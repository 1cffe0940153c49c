"""`scaleout doctor` (scaleout/goodput/doctor.py): the verdict logic on synthetic figures, the
quarantine
file (scaleout/goodput/quarantine.py), the exclusion hostlist, per-node link rates of the emulated
cluster,
the whole check on a pooled 2 x 2 gloo world, and the bar drill: on a netns 2 x 2 cluster whose
node 1 has 1/10 of the others' link rate, `scaleout doctor` names node 1 in one line, quickly, and
exits non-zero."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from distutil import run_dist

from scaleout.cli import build_parser
from scaleout.env.nodelist import compress_hostlist, expand_nodelist
from scaleout.errors import UserError
from scaleout.goodput import doctor, quarantine
from scaleout.launchers.netns import Cluster, parse_node_rates

ROOT = Path(__file__).resolve().parents[2]
NAMES = [f"n{i}" for i in range(4)]


def _ring_pairs(caps: list[float]) -> list[tuple[int, int, float]]:
    """What the probe measures on k nodes of these link capacities: at each stride, node i's
    stream to i + stride runs at the slower end's rate."""
    k = len(caps)
    return [
        (i, (i + s) % k, min(caps[i], caps[(i + s) % k]))
        for s in doctor.strides(k)
        for i in range(k)
    ]


@pytest.mark.unit
def test_four_nodes_the_slow_one_is_named_from_measurements_alone() -> None:
    caps = [110e6, 118e6, 11e6, 105e6]
    verdicts = doctor.bandwidth_verdicts(_ring_pairs(caps), [None] * 4, NAMES, 0.5)
    assert [v.line() for v in verdicts] == [
        "node 2 (n2): inter-node bandwidth 11.0 MB/s, 0.10x the median 110 MB/s: slow link or NIC"
    ]
    # healthy spread (0.7x) is no verdict; a stricter threshold names the slowest
    caps = [110e6, 118e6, 80e6, 105e6]
    assert doctor.bandwidth_verdicts(_ring_pairs(caps), [None] * 4, NAMES, 0.5) == []
    assert [v.node for v in doctor.bandwidth_verdicts(_ring_pairs(caps), [None] * 4, NAMES, 0.8)]


@pytest.mark.unit
def test_two_nodes_a_slow_pair_is_pinned_on_the_end_with_the_slower_link() -> None:
    pairs = [(0, 1, 12.4e6), (1, 0, 12.3e6)]
    names = NAMES[:2]
    (v,) = doctor.bandwidth_verdicts(pairs, [1e9, 1e8], names, 0.5)
    assert v.node == 1 and v.kind == "bandwidth"
    assert v.line() == (
        "node 1 (n1): inter-node bandwidth 12.4 MB/s, 0.10x the median 124 MB/s: slow link or NIC "
        "(its link 100 Mbit/s, the others' 1 Gbit/s)"
    )
    # equal or unknown speeds: the one pair cannot say which end is slow, so no node is named
    assert doctor.bandwidth_verdicts(pairs, [1e9, 1e9], names, 0.5) == []
    assert doctor.bandwidth_verdicts(pairs, [None, 1e8], names, 0.5) == []


@pytest.mark.unit
def test_versions_interfaces_store_and_intra_verdicts() -> None:
    def rec(rank: int, node: int, **kw):
        base = {
            "rank": rank,
            "node": node,
            "host": f"h{node}",
            "python": "3.11.7",
            "torch": "2.13.0",
            "scaleout": "0.1.0",
            "cuda": None,
            "nccl": None,
            "subnet": "10.0.0.0/24",
            "if_problems": [],
            "store_rtt_s": 0.001,
            "store_error": None,
        }
        return base | kw

    records = [rec(0, 0), rec(1, 0), rec(2, 1), rec(3, 1, torch="2.1.0")]
    records += [rec(4, 2, subnet="10.0.9.0/24"), rec(5, 2, subnet="10.0.9.0/24")]
    records += [rec(6, 3, if_problems=["GLOO_SOCKET_IFNAME=eth9 names no interface here"])]
    records += [rec(7, 3, store_error="ConnectionRefusedError: [Errno 111]")]
    names, verdicts = doctor.analyse(records, [], [900e6, 880e6, 910e6, 90e6], 0.5)
    lines = [v.line() for v in verdicts]
    assert names == ["h0", "h1", "h2", "h3"]
    assert (
        "node 1 (h1): torch 2.1.0 on rank 3 differs from the majority's 2.13.0 (ranks 0, 1, 2, 4, "
        "5, 6, 7): mismatched install" in lines
    )
    assert any(x.startswith("node 2 (h2): subnet 10.0.9.0/24 on rank 4-5") for x in lines)
    assert "node 3 (h3): GLOO_SOCKET_IFNAME=eth9 names no interface here (rank 6)" in lines
    assert any(x.startswith("node 3 (h3): rank 7 cannot reach the store") for x in lines)
    assert any(x.startswith("node 3 (h3): intra-node all-reduce 90.0 MB/s, 0.10x") for x in lines)
    assert not [v for v in verdicts if v.node == 0]
    two = [records[0], records[2]]
    _, (v,) = doctor.analyse(two, [], [None, None], 0.5, [(0, 1, "TimeoutError: timed out")])
    assert v.line() == (
        "node 1 (h1): no stream from node 0 (h0) arrived: TimeoutError: timed out: unreachable or "
        "broken link"
    )
    assert doctor.verdict_hosts(verdicts) == ["h1", "h2", "h3"]


@pytest.mark.unit
def test_ifname_checks_follow_nccl_and_gloo_syntax() -> None:
    here = ["lo", "veth0", "ib0"]
    assert doctor.check_ifname_vars({"GLOO_SOCKET_IFNAME": "veth0"}, here) == []
    assert doctor.check_ifname_vars({"NCCL_SOCKET_IFNAME": "veth"}, here) == []  # a prefix
    assert doctor.check_ifname_vars({"NCCL_SOCKET_IFNAME": "^docker"}, here) == []  # exclusion
    (p,) = doctor.check_ifname_vars({"NCCL_SOCKET_IFNAME": "=veth"}, here)  # exact: no such one
    assert p.startswith("NCCL_SOCKET_IFNAME==veth names no interface here")
    (p,) = doctor.check_ifname_vars({"GLOO_SOCKET_IFNAME": "veth0,eth9"}, here)
    assert "GLOO_SOCKET_IFNAME=veth0,eth9" in p and "lo, veth0, ib0" in p


@pytest.mark.unit
def test_node_names_on_one_host_use_the_namespace() -> None:
    recs = [{"rank": r, "node": r // 2, "host": "vm", "netns": "so1a"} for r in range(4)]
    assert doctor.node_names(recs) == ["so1a-n0", "so1a-n1"]
    recs = [{"rank": r, "node": r // 2, "host": "vm"} for r in range(4)]
    assert doctor.node_names(recs) == ["vm-node0", "vm-node1"]
    recs = [{"rank": r, "node": r // 2, "host": f"gpu{r // 2:03d}"} for r in range(4)]
    assert doctor.node_names(recs) == ["gpu000", "gpu001"]


@pytest.mark.unit
def test_compress_hostlist_round_trips_through_the_slurm_grammar() -> None:
    for hosts, text in [
        (["n1", "n2", "n3", "n7", "gpu"], "gpu,n[1-3,7]"),
        (["gpu001", "gpu002", "gpu010"], "gpu[001-002,010]"),
        (["so1-n1"], "so1-n1"),
        (["n9", "n10", "n11", "n01"], "n[9-11],n01"),
    ]:
        assert compress_hostlist(hosts) == text
        assert sorted(expand_nodelist(text)) == sorted(hosts)


@pytest.mark.unit
def test_quarantine_appends_merges_and_rejects_a_corrupt_file(tmp_path: Path) -> None:
    path = tmp_path / "q" / "quarantine.json"
    assert quarantine.load(path) == {"nodes": {}}
    quarantine.record(path, [("n1", "slow link")], "doctor")
    data = quarantine.record(path, [("n1", "again"), ("n3", "torch differs")], "doctor")
    assert [e["reason"] for e in data["nodes"]["n1"]] == ["slow link", "again"]
    assert quarantine.load(path) == data and quarantine.hosts(data) == ["n1", "n3"]
    assert set(data["nodes"]["n3"][0]) == {"reason", "source", "time"}
    assert sorted(p.name for p in path.parent.iterdir()) == [".quarantine.json.lock", path.name]
    other = quarantine.add({"nodes": {}}, "n2", "hung at step 7", "train", "2026-01-01T00:00:00Z")
    merged = quarantine.merge(data, other, data)  # exact duplicates are kept once
    assert quarantine.hosts(merged) == ["n1", "n2", "n3"] and len(merged["nodes"]["n1"]) == 2
    path.write_text('{"nodes": {"n1": "slow"}}')
    with pytest.raises(UserError, match=r"quarantine file .*quarantine.json.*: node 'n1'"):
        quarantine.load(path)
    path.write_text("{not json")
    with pytest.raises(UserError, match="not JSON"):
        quarantine.load(path)


@pytest.mark.unit
def test_per_node_link_rates_of_the_emulated_cluster() -> None:
    c = Cluster(4, "1gbit", name="tdoc", node_rates="1=100mbit,3=none")
    assert [c.rate_of(i) for i in range(4)] == ["1gbit", "100mbit", "1gbit", "none"]
    assert c.rank_env()["SCALEOUT_LINK_RATE_BPS"] == str(int(1e8))  # the slowest link
    assert parse_node_rates({2: "10mbit"}, 4) == {2: "10mbit"}
    for spec, msg in [
        ("1=fast", "--node-rate 1='fast': expected a tc rate"),
        ("1:10mbit", "--node-rate='1:10mbit': expected NODE=RATE"),
        ("x=10mbit", "node 'x' is not a node index"),
        ("5=10mbit", "node 5 does not exist (the cluster has nodes 0-3)"),
        ("1=10mbit,1=5mbit", "node 1 is given twice"),
    ]:
        with pytest.raises(UserError, match=re.escape(msg)):
            Cluster(4, "1gbit", name="tdoc", node_rates=spec)


def _diagnose(world, argv):
    args = build_parser().parse_args(["doctor", *argv])
    result = doctor.diagnose(world, args)
    return [v.line() for v in result.verdicts], result.text, result.summary


@pytest.mark.multi_process
def test_doctor_on_a_local_2x2_gloo_world_passes_and_prints_its_table() -> None:
    results = run_dist(_diagnose, nnodes=2, nproc_per_node=2, args=(["--probe-bytes", "2MiB"],))
    verdicts, text, summary = results[0]
    assert verdicts == [], text
    assert all(r[0] == [] and r[1] == "" for r in results[1:])  # one table, from rank 0
    rows = [line.split() for line in text.splitlines()]
    assert rows[1][:3] == ["node", "host", "ranks"]
    assert [r[0] for r in rows[2:4]] == ["0", "1"] and [r[2] for r in rows[2:4]] == ["0-1", "2-3"]
    assert "pairs (2.00 MiB each way" in text and "0->1" in text and "1->0" in text
    assert "inter-node all-reduce" in text
    m = re.match(r"scaleout doctor: OK, no verdict; 4 ranks on 2 nodes in (\d+\.\d) s", summary)
    assert m and float(m.group(1)) < 20, summary  # the check itself, not the ranks' start-up


@pytest.mark.netns
@pytest.mark.full_system
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("tc") is None or shutil.which("ip") is None,
    reason="needs root and iproute2 (ip, tc)",
)
def test_netns_drill_doctor_names_the_node_with_a_tenth_of_the_link_rate(tmp_path: Path) -> None:
    from scaleout.launchers.netns_launcher import private_cluster_name

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "scaleout", "launch", "--nnodes", "2", "--nproc-per-node", "2"]
    cmd += ["--netns", "--rate", "1gbit", "--node-rate", "1=100mbit", "--", "scaleout", "doctor"]
    cmd += ["--exclude", str(tmp_path / "exclude"), "--quarantine", str(tmp_path / "q.json")]
    t = time.monotonic()
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = (s.decode() for s in p.communicate(timeout=120))
    wall = time.monotonic() - t
    name = private_cluster_name(p.pid)  # this launch's own cluster: nothing else is looked at
    verdicts = [line for line in out.splitlines() if "verdict: " in line]
    assert p.returncode != 0, out[-3000:] + err[-3000:]
    assert len(verdicts) == 1, out[-3000:]
    assert re.search(
        rf"verdict: node 1 \({name}-n1\): inter-node bandwidth 1\d\.\d MB/s, 0\.\d\dx the median "
        r"\d+ MB/s: slow link or NIC",
        verdicts[0],
    ), verdicts[0]
    (summary,) = [line for line in out.splitlines() if "scaleout doctor: 1 verdict" in line]
    took = float(re.search(r"in (\d+\.\d) s", summary).group(1))
    assert took <= 30 and wall <= 90, (took, wall)  # the check; the launch with 4 torch imports
    assert (tmp_path / "exclude").read_text() == f"{name}-n1\n"
    assert list(json.loads((tmp_path / "q.json").read_text())["nodes"]) == [f"{name}-n1"]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{name}-n" not in listed  # the private cluster is gone
