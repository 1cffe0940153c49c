"""scaleout train: time-to-train run of a config under any launcher."""

from __future__ import annotations

import argparse

NAME = "train"
ORDER = 5
HELP = (
    "train a config to its target (BERT/LAMB, ResNet/LARS) under any launcher; MLPerf log + report"
)
DESCRIPTION = """\
scaleout train CONFIG [section.key=value ...]

Runs inside every rank (start it with scaleout launch, srun, mpiexec, torchrun or horovodrun).
Builds the World from the launcher's environment, then model, data, overlapped reducer, optimizer
and schedule from the config; trains with periodic evaluation until train.target or train.max_steps;
writes an MLPerf log, checkpoints and a time-to-train report under train.output_dir. Resumes from
the latest valid checkpoint in checkpoint.dir. SIGUSR2/SIGTERM: checkpoint and exit cleanly (and
requeue under Slurm).

examples:
  scaleout launch --nnodes 2 --nproc-per-node 2 -- scaleout train configs/bert_tiny_cpu.yaml
  scaleout launch --nproc-per-node 4 -- scaleout train bert_tiny_cpu optim.lr=2e-3
  comm.algorithm=torus2d
  srun scaleout train configs/bert_large_256x8.yaml
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="config file, or a name in configs/ (e.g. bert_tiny_cpu)")
    p.add_argument(
        "overrides", nargs="*", help="section.key=value overrides, e.g. train.max_steps=200"
    )


def preflight(args: argparse.Namespace, world_size: int, ranks_per_node: int) -> None:
    """Validate the config for this world before any rank starts (called by launchers)."""
    from scaleout.config import load_config
    from scaleout.telemetry.metrics import check_sinks
    from scaleout.train.inputs import check_input_files
    from scaleout.train.rerun import decide_start
    from scaleout.train.rundirs import prepare_run_dirs

    cfg = load_config(args.config, args.overrides)
    cfg.check_world(world_size, ranks_per_node)
    check_sinks(cfg.train.metrics)  # a missing tensorboard/wandb fails here, not in every rank
    decide_start(
        cfg
    )  # the rerun policy: a start that would overwrite another run fails here, before any spawn
    check_input_files(cfg)  # a corrupt or foreign file under a path-valued key: one line
    prepare_run_dirs(cfg)  # one owner per run directory (held until exit), then its debris


def run(args: argparse.Namespace) -> int:
    from scaleout.config import load_config

    cfg = load_config(args.config, args.overrides)  # fail before touching the network
    from scaleout.train import run_training

    result = run_training(cfg, config_file=str(args.config))
    return result.exit_code
