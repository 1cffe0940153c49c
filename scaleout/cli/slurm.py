"""scaleout slurm up|down|status: the local Slurm cluster (four emulated nodes on this host);
scaleout slurm run: the batch scripts' training step, restarted on spare nodes when it dies."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from scaleout.errors import UserError

NAME = "slurm"
ORDER = 60
HELP = (
    "start, stop or inspect a real local Slurm cluster (n1..n4 on this host); run: a batch "
    "script's training step with spare nodes, quarantine and a crash-loop guard"
)
DESCRIPTION = """\
A real Slurm 22.05 cluster on one machine: munge, MariaDB + slurmdbd (sacct), slurmctld and four
slurmd as emulated nodes n1..n4 (each 4 CPUs). Needs root; installs the Debian packages with apt
when missing. State lives in $SCALEOUT_SLURM_STATE (default /tmp/scaleout-slurm). Clients need
SLURM_CONF, printed by `status`. The state folder must be root's and writable by nobody else (a
folder another user created is refused); `down` signals only PIDs that are that folder's daemons,
`--wipe` deletes only in a folder that carries scaleout's marker, and the n1..n4 line `up` adds to
/etc/hosts is marked and removed by `down`.

`scaleout slurm run -- scaleout train CONFIG [overrides]` (inside an sbatch script;
slurm/bert_256node.sh uses it): runs the step with srun on the allocation's healthy nodes but
launch.spares (or launch.nnodes of them), the others are spares; launch.container.* puts the ranks
in a container (pyxis --container-image/-mounts/-workdir/-env, or an OCI --container=<bundle>).
When the step dies, the node whose ranks stopped, hung or were killed is named and written to
<train.output_dir>/quarantine.json, and a new step starts on healthy nodes at once, resuming from
the latest checkpoint; with too few healthy nodes the job is requeued excluding the quarantined
ones. launch.crash_loop (default 3) attempts that die without a checkpoint past the same step stop
the job with one line. Attempts: run.json.

examples:
  scaleout slurm up                 # ~3 s (11 s the first time: database init)
  export SLURM_CONF=/tmp/scaleout-slurm/etc/slurm.conf
  sbatch -N 3 --ntasks-per-node 2 slurm/bert_256node.sh launch.spares=1 model.bert.layers=2 \
    train.global_batch=8 optim.lr=1e-3 optim.warmup_steps=2 optim.total_steps=20 train.max_steps=20
  srun -N 2 --ntasks-per-node 2 scaleout smoke
  scaleout slurm status
  scaleout slurm down [--wipe]
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "action",
        choices=["up", "down", "status", "run"],
        help="up: start (idempotent); down: stop by PID; run: supervise a training step (sbatch)",
    )
    p.add_argument(  # "*", not REMAINDER: that would swallow `up --no-install` as well
        "step_command",
        nargs="*",
        help="run: -- scaleout train CONFIG [overrides] (the step's command, after --)",
    )
    p.add_argument(
        "--no-dbd",
        action="store_true",
        help="up: no slurmdbd/MariaDB (faster; sacct will not work)",
    )
    p.add_argument(
        "--no-install", action="store_true", help="up: never apt-get install missing packages"
    )
    p.add_argument("--wipe", action="store_true", help="down: also delete spool, database and logs")
    p.add_argument(
        "--state",
        default=None,
        help="state folder (default $SCALEOUT_SLURM_STATE or /tmp/scaleout-slurm)",
    )


def _supervise(args: argparse.Namespace) -> int:
    from scaleout.launchers import slurm_supervisor as sup

    cmd = sup.TrainCommand.parse(args.step_command)
    alloc = sup.Allocation.from_env(os.environ)
    cmd = cmd.fitted(alloc)  # the node count from the allocation; refuses before any srun
    return sup.Supervisor(alloc, cmd, Path(cmd.output_dir), crash_loop_k=cmd.crash_loop).run()


def run(args: argparse.Namespace) -> int:
    from scaleout.launchers.slurm import LocalSlurm

    if args.action == "run":
        return _supervise(args)
    if args.step_command:
        raise UserError(
            f"scaleout slurm {args.action}: unexpected arguments {' '.join(args.step_command)!r}"
        )

    cluster = LocalSlurm(args.state)
    if args.action == "up":
        started = cluster.start(accounting=not args.no_dbd, install=not args.no_install)
        print("started" if started else "already running")
        print(cluster.status().describe())
    elif args.action == "down":
        cluster.stop(wipe=args.wipe)
        print(cluster.status().describe())
    else:
        st = cluster.status()
        print(st.describe())
        return 0 if st.running else 3
    return 0
