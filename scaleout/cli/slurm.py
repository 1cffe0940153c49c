"""scaleout slurm up|down|status: the local Slurm cluster (four emulated nodes on this host)."""

from __future__ import annotations

import argparse

NAME = "slurm"
ORDER = 60
HELP = "start, stop or inspect a real local Slurm cluster (n1..n4 on this host) for tests and demos"
DESCRIPTION = """\
A real Slurm 22.05 cluster on one machine: munge, MariaDB + slurmdbd (sacct), slurmctld and four
slurmd as emulated nodes n1..n4 (each 4 CPUs). Needs root; installs the Debian packages with apt
when missing. State lives in $SCALEOUT_SLURM_STATE (default /tmp/scaleout-slurm). Clients need
SLURM_CONF, printed by `status`. The state folder must be root's and writable by nobody else (a
folder another user created is refused); `down` signals only PIDs that are that folder's daemons,
`--wipe` deletes only in a folder that carries scaleout's marker, and the n1..n4 line `up` adds to
/etc/hosts is marked and removed by `down`.

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
        "action", choices=["up", "down", "status"], help="up: start (idempotent); down: stop by PID"
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


def run(args: argparse.Namespace) -> int:
    from scaleout.launchers.slurm import LocalSlurm

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
