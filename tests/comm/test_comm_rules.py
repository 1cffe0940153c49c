"""Rules that used to be written twice or three times, now once (issue 25): the torus grid X x Y
(runtime World, config check, simulator), tc's link-rate units (emulated cluster, calibration), the
algorithm registry (config, simulator, CLI read it; it loads without torch)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scaleout.comm import ALGORITHMS, Algorithm
from scaleout.config import load_config
from scaleout.env import WorldSpec
from scaleout.errors import ConfigError, TopologyError
from scaleout.launchers import netns
from scaleout.registry import RegistryError
from scaleout.sim import calibrate
from scaleout.sim.cluster import get_cluster
from scaleout.sim.collectives import config_row_length, plan_for
from scaleout.topology import resolve_grid
from scaleout.units import parse_rate
from scaleout.world import World

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def _fake_world(node_of: tuple[int, ...]) -> World:
    spec = WorldSpec(
        0, 0, 0, len(set(node_of)), node_of.count(0), len(node_of), "127.0.0.1", 1, "test"
    )
    return World(spec, torch.device("cpu"), "gloo", node_of)


@pytest.mark.parametrize(
    ("x", "y", "grid"), [(None, 2, (4, 2)), (None, None, (2, 4)), (8, None, (8, 1)), (1, 8, (1, 8))]
)
def test_one_torus_rule(x, y, grid) -> None:
    """8 ranks, 2 per node. Before: with only torus_y given the simulator (which read torus_x alone)
    priced a 2x4 grid while the runtime and the config check used 4x2."""
    world = _fake_world((0, 0, 1, 1, 2, 2, 3, 3))
    cfg = load_config(
        overrides=["comm.algorithm=torus2d"]
        + [f"comm.torus_{k}={v}" for k, v in (("x", x), ("y", y)) if v is not None]
    )
    cfg.check_world(8, 2)
    assert world.torus_shape(x, y) == grid == resolve_grid(8, 2, x, y)
    row = config_row_length(cfg.comm, nodes=4, ranks_per_node=2)
    assert row == grid[0]
    cluster = get_cluster("netns-1g")  # 2 ranks per node
    assert cluster.gpus_per_node == 2
    assert plan_for("torus2d", cluster, 4, 1e6, torus_x=row).cost(cluster.constants.vector()) > 0


@pytest.mark.parametrize(("x", "y"), [(None, 3), (3, None), (4, 4)])
def test_one_torus_rule_rejects_alike(x, y) -> None:
    world = _fake_world((0, 0, 1, 1, 2, 2, 3, 3))
    keys = [f"comm.torus_{k}={v}" for k, v in (("x", x), ("y", y)) if v is not None]
    cfg = load_config(overrides=["comm.algorithm=torus2d", *keys])
    with pytest.raises(ConfigError, match=f"{keys[0]}.*world size 8|world size 8"):
        cfg.check_world(8, 2)
    with pytest.raises(TopologyError, match="world size 8"):
        world.torus_shape(x, y)
    with pytest.raises(TopologyError, match="world size 8"):
        config_row_length(cfg.comm, nodes=4, ranks_per_node=2)


def test_torus_options_only_with_the_torus() -> None:
    with pytest.raises(ConfigError, match="comm.torus_y=2 is an option of torus2d"):
        load_config(overrides=["comm.algorithm=hierarchical", "comm.torus_y=2"])
    with pytest.raises(ConfigError, match="comm.chunk_mb=1.0 is an option of hierarchical"):
        load_config(overrides=["comm.algorithm=flat", "comm.chunk_mb=1"])


# tc(8), "UNITS": bit or a bare number = bits/s, kbit/mbit/gbit = 1000^n bits/s, bps = bytes/s,
# kbps/mbps/gbps = 1000^n bytes/s; ki/mi/gi = 1024^n.
TC = {"1gbps": 8e9, "1gbit": 1e9, "100mbit": 1e8, "10Mbps": 8e7, "125kbps": 1e6, "1mibit": 2**20}


@pytest.mark.parametrize(("text", "bits"), TC.items())
def test_one_parse_rate_in_tc_units(text: str, bits: float) -> None:
    """Before: launchers/netns.py read "1gbps" as 8e9 bit/s (tc) and sim/calibrate.py as 1e9."""
    assert parse_rate(text) == bits
    assert netns.Cluster(2, rate=text).rate_bps == bits  # the emulated cluster's tc limit
    row = {"algorithm": "flat", "nbytes": 8, "nnodes": 2, "nproc_per_node": 1, "time_s": 1.0}
    (sample,) = calibrate.samples_from_rows([{**row, "rate": text}])
    assert sample.link_rate_bps == bits  # the calibration's reading of a bench row


def test_parse_rate_is_defined_once() -> None:
    out = subprocess.run(
        ["grep", "-rn", "def parse_rate", "scaleout", "launchers"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    assert [line.split(":")[0] for line in out.splitlines()] == ["scaleout/units.py"], out
    assert parse_rate(None) is None and parse_rate("none") is None and parse_rate(2.5e9) == 2.5e9
    with pytest.raises(ConfigError, match="--rate='fast'"):
        parse_rate("fast")


def test_registry_refuses_a_taken_name_and_loads_without_torch() -> None:
    with pytest.raises(RegistryError, match="'flat' is already registered"):
        ALGORITHMS.register("flat", Algorithm())
    code = (
        "import sys, json, scaleout.config, scaleout.comm;"
        "print(json.dumps(['torch' in sys.modules, list(scaleout.comm.ALGORITHMS)]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == [False, ["flat", "hierarchical", "torus2d"]]
