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

`scaleout slurm run [--run-dir D] [--crash-loop K] -- scaleout train CONFIG ...` (inside an
sbatch script; slurm/bert_256node.sh uses it): runs the step with srun on launch.nnodes healthy
nodes of the allocation, the others are spares. When the step dies, the node whose ranks stopped,
hung or were killed is named and written to D/quarantine.json, and a new step starts on healthy
nodes at once, resuming from the latest checkpoint; with too few healthy nodes the job is
requeued excluding the quarantined ones. K attempts (default 3, or $SCALEOUT_CRASH_LOOP) that die
without a checkpoint past the same step stop the job with one line. Attempts: run.json.

examples:
  scaleout slurm up                 # ~3 s (11 s the first time: database init)
  export SLURM_CONF=/tmp/scaleout-slurm/etc/slurm.conf
  sbatch -N 2 --ntasks-per-node 2 slurm/bert_256node.sh model.bert.layers=2
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
    p.add_argument(
        "--run-dir",
        default=None,
        help="run: the run directory holding quarantine.json (default $RUN_DIR, else "
        "train.output_dir)",
    )
    p.add_argument(
        "--crash-loop",
        type=int,
        default=None,
        metavar="K",
        help="run: stop after K attempts die at the same step (default $SCALEOUT_CRASH_LOOP or 3)",
    )
    p.add_argument(
        "step_command",
        nargs=argparse.REMAINDER,
        help="run: -- scaleout train CONFIG [overrides] (the step's command)",
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

    rest = list(args.step_command)
    cut = rest.index("--") if "--" in rest else 0
    opts = argparse.ArgumentParser(prog="scaleout slurm run", add_help=False)
    opts.add_argument("--run-dir", default=args.run_dir)
    opts.add_argument("--crash-loop", type=int, default=args.crash_loop)
    try:
        known, extra = opts.parse_known_args(rest[:cut])
    except SystemExit:  # a value argparse refused (it printed why)
        extra = ["?"]
    if extra:
        raise UserError(
            f"run: options {' '.join(rest[:cut])!r}: expected --run-dir D, --crash-loop K"
        )
    args.run_dir, args.crash_loop, args.step_command = known.run_dir, known.crash_loop, rest[cut:]
    raw = args.crash_loop if args.crash_loop is not None else os.environ.get("SCALEOUT_CRASH_LOOP")
    try:
        k = int(raw) if raw is not None else sup.DEFAULT_CRASH_LOOP
    except ValueError:
        k = 0
    if k < 1:
        raise UserError(f"crash-loop K={raw!r}: expected a whole number >= 1")
    cmd = sup.TrainCommand.parse(args.step_command)
    alloc = sup.Allocation.from_env(os.environ)
    run_dir = Path(args.run_dir or os.environ.get("RUN_DIR") or cmd.output_dir)
    return sup.Supervisor(alloc, cmd, run_dir, crash_loop_k=k).run()


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
