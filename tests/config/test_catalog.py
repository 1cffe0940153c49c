"""The shipped configs: `scaleout config list` and the DGX H100 recipes against the NVIDIA MLPerf
files they cite (each config's header names the file and copies its variables; the values must be
the config's)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from scaleout.cli import main
from scaleout.config import load_config
from scaleout.config.catalog import shipped

ROOT = Path(__file__).resolve().parents[2]
H100 = {"bert_large_h100_1x8": 1, "bert_large_h100_8x8": 8, "bert_large_h100_64x8": 64,
        "bert_large_h100_434x8": 434}  # fmt: skip
GPUS_PER_NODE = 8  # a DGX H100


@pytest.mark.unit
def test_config_list_shows_every_shipped_config_with_the_h100_recipes(capsys) -> None:
    assert main(["config", "list"]) == 0
    rows = {
        cells[0]: cells[1:]
        for line in capsys.readouterr().out.splitlines()[2:]
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    assert set(rows) == {p.stem for p in (ROOT / "configs").glob("*.yaml")}
    for name, nodes in H100.items():
        family, shape, batch, description = rows[name]
        cfg = load_config(name, [])
        assert (family, shape, int(batch)) == ("bert", f"{nodes}x8", cfg.train.global_batch)
        assert "DGX H100" in description and "MLPerf" in description
    assert [e.name for e in shipped()][:2] == ["bert_tiny_cpu", "bert_large_h100_1x8"]  # by size


def _cited(name: str) -> dict[str, float]:
    """The NVIDIA variables a config's header copies (``#   NAME=value ...``)."""
    head = (ROOT / "configs" / f"{name}.yaml").read_text().split("\nmodel:")[0]
    return {k: float(v) for k, v in re.findall(r"\b([A-Z][A-Z0-9_]+)=(-?[\d.]+)\b", head)}


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(H100))
def test_h100_recipe_is_the_cited_nvidia_config(name: str) -> None:
    ref = _cited(name)
    cfg = load_config(name, [])
    nodes, world = int(ref["DGXNNODES"]), int(ref["DGXNNODES"]) * GPUS_PER_NODE
    assert (
        (cfg.launch.nnodes, cfg.launch.nproc_per_node) == (nodes, GPUS_PER_NODE) == (H100[name], 8)
    )
    cfg.check_world(world, GPUS_PER_NODE)
    o, t = cfg.optim, cfg.train
    warmup = ref.get("WARMUP_STEPS", ref.get("WARMUP_PROPORTION", 0) * ref["MAX_STEPS"])
    assert (o.lr, o.betas, o.weight_decay, o.start_warmup_step, o.warmup_steps) == (
        ref["LR"], (ref["OPT_LAMB_BETA_1"], ref["OPT_LAMB_BETA_2"]), ref["WEIGHT_DECAY_RATE"],
        ref["START_WARMUP_STEP"], warmup)  # fmt: skip
    assert (
        o.total_steps == t.max_steps == ref["MAX_STEPS"] and t.grad_accum == ref["GRADIENT_STEPS"]
    )
    # BATCHSIZE packed rows per GPU, about 2 sequences per row (lphp, <= 3 per pack)
    assert t.global_batch == ref["BATCHSIZE"] * world
    assert cfg.data.packing == "lphp" and cfg.data.max_per_pack == 3
    sequences = 2 * t.global_batch
    assert t.eval_start_step == math.ceil(ref["EVAL_ITER_START_SAMPLES"] / sequences)
    assert t.eval_every == round(ref["EVAL_ITER_SAMPLES"] / sequences)
    assert t.target == 0.720


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(H100))
def test_h100_sbatch_script_runs_its_recipe_at_its_size(name: str) -> None:
    nodes = H100[name]
    script = (ROOT / "slurm" / f"bert_h100_{nodes}node.sh").read_text()
    assert f"#SBATCH --nodes={nodes}\n" in script and "#SBATCH --ntasks-per-node=8\n" in script
    assert f"scaleout train configs/{name}.yaml" in script
    assert "exec scaleout slurm run --" in script and '"$@"' in script


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "configs").glob("*.yaml")))
def test_every_shipped_schedule_builds_and_warms_up_inside_the_run(name: str) -> None:
    """What every rank builds at start: the learning-rate schedule of each shipped config. The
    DGX H100 recipes count their warm-up with NVIDIA's START_WARMUP_STEP offset (8x8:
    WARMUP_STEPS=200330 from -200000, over 740 steps): a rule that compared total_steps with
    warmup_steps alone refused them on every rank."""
    import torch

    from scaleout.optim import build_schedule
    from scaleout.optim.schedule import warmup_end

    o = load_config(name, []).optim
    sched = build_schedule(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=o.lr), o)
    if o.total_steps is None:
        return
    factor = sched.lr_lambdas[0]
    end = warmup_end(o.warmup_steps, o.start_warmup_step)
    assert 0 <= end < o.total_steps, (end, o.total_steps)  # 1x8: no warm-up
    peak = max(factor(k) for k in range(o.total_steps))
    assert peak == pytest.approx(1.0, abs=0.01) and factor(o.total_steps - 1) < peak, name
