"""MLPerf ResNet's RCP-backed hyper-parameter sets: a config for any global batch of the
reference convergence points (RCPs) of ``mlperf_logging.rcp_checker``
(``training_<ruleset>/rcps_resnet.json``: 1,632 ... 67,840 images; e.g. 3,264 -> lr 10.5, 2
warm-up epochs, wd 5e-5; 65,536 -> lr 24.699, 31 warm-up epochs, momentum 0.951807, wd 1e-4). A
closed-division ResNet result at a batch is checked against the convergence of these
hyper-parameters, so they are the ones to train with.

The table gives LARS's base lr, warm-up epochs, momentum, weight decay, decay steps and the BN
span; the rules fix end lr 1e-4, poly power 2 and epsilon 0. The generated config keeps the
flagship's everything else (configs/resnet50_128x8.yaml: label smoothing 0.1, bf16, input
workers, eval every 4 epochs) and sets:

* steps per epoch = ceil(1,281,167 / batch) (NVIDIA's ``get_epoch_size``);
* optim.warmup_steps = warm-up epochs x steps per epoch;
* optim.total_steps = warm-up + decay steps - 1, so the log's ``lars_opt_learning_rate_decay_steps``
  (train - warm-up + 1, the reference's definition) is the table's number;
* model.resnet.bn_group: the group (a valid one for the node shape) whose span (per-GPU batch x
  group) is closest to the table's ``model_bn_span``.

Torch-free (the CLI and the tests read it).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

from scaleout.errors import UserError
from scaleout.families.resnet.imagenet import IMAGENET_TRAIN_IMAGES

RCP_RULESET = "4.0.0"  # the newest ruleset with ResNet RCPs (scaleout.telemetry.mlperf.RULESET)
EVAL_PERIOD_EPOCHS = 4  # the reference and NVIDIA: evaluate every 4 epochs


def rcp_file(ruleset: str = RCP_RULESET) -> Path:
    import mlperf_logging.rcp_checker as rc  # deferred: an optional dependency's data file

    path = Path(rc.__file__).parent / f"training_{ruleset}" / "rcps_resnet.json"
    if not path.is_file():
        raise UserError(f"mlperf_logging has no ResNet RCPs for ruleset {ruleset!r} ({path})")
    return path


def rcp_table(ruleset: str = RCP_RULESET) -> dict[int, dict[str, Any]]:
    """{global batch: the RCP's Hyperparams} of the ResNet RCP file."""
    raw = json.loads(rcp_file(ruleset).read_text())
    return {int(r["BS"]): dict(r["Hyperparams"]) for r in raw.values()}


def _valid_groups(world: int, per_node: int) -> list[int]:
    """bn_group values scaleout.families.resnet.group_bn.bn_group_ranks accepts for this shape."""
    nodes = world // per_node
    within = [k for k in range(1, per_node + 1) if per_node % k == 0]
    across = [per_node * m for m in range(2, nodes + 1) if nodes % m == 0]
    return within + across


def bn_group_for_span(span: int, per_gpu: int, world: int, per_node: int) -> int:
    """The valid group whose span (per_gpu x group) is closest to ``span`` (ties: the smaller)."""
    return min(_valid_groups(world, per_node), key=lambda k: (abs(k * per_gpu - span), k))


def rcp_config(
    global_batch: int,
    nodes: int,
    gpus_per_node: int,
    base: dict[str, Any],
    ruleset: str = RCP_RULESET,
) -> dict[str, Any]:
    """The config tree for ``global_batch`` on nodes x gpus_per_node GPUs: ``base`` (the flagship's
    tree) with the RCP's hyper-parameters. Refuses a batch that is not in the table."""
    table = rcp_table(ruleset)
    if global_batch not in table:
        valid = ", ".join(f"{b:,}" for b in sorted(table))
        raise UserError(
            f"--global-batch {global_batch}: no MLPerf ResNet RCP at that batch (ruleset "
            f"{ruleset}); RCP batches: {valid}"
        )
    if nodes < 1 or gpus_per_node < 1:
        raise UserError(f"--nnodes {nodes} --nproc-per-node {gpus_per_node}: expected both >= 1")
    world = nodes * gpus_per_node
    if global_batch % world:
        raise UserError(
            f"--global-batch {global_batch} is not divisible by {world} GPUs "
            f"({nodes} nodes x {gpus_per_node}): every GPU needs the same batch"
        )
    hp = table[global_batch]
    per_gpu = global_batch // world
    spe = math.ceil(IMAGENET_TRAIN_IMAGES / global_batch)
    warmup = round(hp["opt_learning_rate_warmup_epochs"] * spe)
    total = warmup + int(hp["opt_learning_rate_decay_steps"]) - 1
    cfg = copy.deepcopy(base)
    resnet = cfg.setdefault("model", {}).setdefault("resnet", {})
    resnet["bn_group"] = bn_group_for_span(int(hp["model_bn_span"]), per_gpu, world, gpus_per_node)
    cfg.setdefault("optim", {}).update(
        name="lars",
        lr=float(hp["opt_base_learning_rate"]),
        momentum=float(hp["opt_momentum"]),
        weight_decay=float(hp["opt_weight_decay"]),
        eps=0.0,
        warmup_steps=warmup,
        total_steps=total,
        power=2.0,
        end_lr=1.0e-4,
    )
    cfg.setdefault("train", {}).update(
        global_batch=global_batch, max_steps=total, eval_every=EVAL_PERIOD_EPOCHS * spe
    )
    cfg["train"].pop("eval_start_step", None)
    cfg.setdefault("launch", {}).update(nnodes=nodes, nproc_per_node=gpus_per_node)
    return cfg


def rcp_header(global_batch: int, nodes: int, gpus_per_node: int, cfg: dict[str, Any]) -> str:
    """The generated file's comment: where every number comes from."""
    hp = rcp_table()[global_batch]
    spe = math.ceil(IMAGENET_TRAIN_IMAGES / global_batch)
    o, k = cfg["optim"], cfg["model"]["resnet"]["bn_group"]
    per_gpu = global_batch // (nodes * gpus_per_node)
    return (
        f"# ResNet-50 v1.5, LARS, global batch {global_batch:,} on {nodes} x {gpus_per_node} GPUs "
        f"({per_gpu} per GPU).\n"
        f"# Generated by `scaleout config resnet-rcp --global-batch {global_batch} "
        f"--nnodes {nodes} --nproc-per-node {gpus_per_node}`\n"
        f"# from mlperf_logging rcp_checker/training_{RCP_RULESET}/rcps_resnet.json, BS "
        f"{global_batch}: {json.dumps(hp)}\n"
        f"# {spe} steps per epoch (ceil(1,281,167 / batch)); warm-up "
        f"{hp['opt_learning_rate_warmup_epochs']} epochs = {o['warmup_steps']} steps; "
        f"total = warm-up + decay steps - 1 = {o['total_steps']} steps "
        f"({o['total_steps'] / spe:.1f} epochs).\n"
        f"# bn_group {k}: BN span {per_gpu * k} images (RCP: {hp['model_bn_span']}).\n"
    )
