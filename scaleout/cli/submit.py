"""scaleout submit: run training on a cluster through submitit (Slurm, or submitit's local
executor)."""

from __future__ import annotations

import argparse
import shlex

NAME = "submit"
ORDER = 25
HELP = (
    "submit a run with submitit (Slurm if present, else locally); prints job ids and follows "
    "rank 0's log"
)
DESCRIPTION = """\
One task per GPU (--nproc-per-node tasks on each of --nnodes nodes); every task runs `scaleout train
CONFIG [overrides]` (or --command) in-process, so the training loop receives the preemption signal
itself: rank 0 checkpoints and requeues, and the requeued job resumes from checkpoint.dir. Without
Slurm (no sbatch on PATH) submitit's local executor runs the tasks on this machine (one node).

examples:
  scaleout submit configs/bert_large_256x8.yaml --nnodes 256 --nproc-per-node 8 --partition gpu \
      --time 120 --slurm account=myproj --slurm qos=high --slurm constraint=a100
  scaleout submit configs/bert_tiny_cpu.yaml --nnodes 2 --nproc-per-node 2 --no-gpu-request
  scaleout submit configs/bert_tiny_cpu.yaml --array optim.lr=1e-3,2e-3,4e-3 --nproc-per-node 2
  scaleout submit --command "smoke --numel 1000" --nnodes 2 --nproc-per-node 2
  scaleout submit configs/bert_tiny_cpu.yaml --executor local --nproc-per-node 2 --no-follow
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "config", nargs="?", help="run config (YAML); required unless --command is given"
    )
    p.add_argument("overrides", nargs="*", help="config overrides key=value")
    p.add_argument("--nnodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        help="ranks per node, one GPU each: the GPUs asked for per node (default 1)",
    )
    p.add_argument(
        "--no-gpu-request",
        action="store_true",
        help="do not ask Slurm for GPUs (CPU-only clusters)",
    )
    p.add_argument("--partition", default=None, help="Slurm partition")
    p.add_argument("--time", type=int, default=60, help="time limit in minutes (default 60)")
    p.add_argument(
        "--array", default=None, metavar="KEY=V1,V2", help="one job per value of a config key"
    )
    p.add_argument(
        "--slurm",
        action="append",
        default=[],
        metavar="KEY=VAL",
        help="any sbatch option, repeatable: --slurm account=proj --slurm qos=high --slurm "
        "constraint=a100 "
        "--slurm exclusive (written as #SBATCH --KEY=VAL)",
    )
    p.add_argument(
        "--signal",
        default="USR2",
        help="preemption notice signal (default USR2; NCCL may catch USR1)",
    )
    p.add_argument(
        "--signal-delay",
        type=int,
        default=120,
        help="seconds of notice before the time limit (120)",
    )
    p.add_argument(
        "--executor",
        default="auto",
        choices=["auto", "slurm", "local", "debug"],
        help="submitit executor; auto: Slurm if sbatch is on PATH, else submitit's local one",
    )
    p.add_argument(
        "--folder", default="submitit/%j", help="submitit log folder (default submitit/%%j)"
    )
    p.add_argument("--name", default="scaleout", help="job name")
    p.add_argument(
        "--command",
        dest="subcommand",
        default=None,
        help="run this scaleout subcommand instead of train, e.g. 'smoke'",
    )
    p.add_argument("--no-follow", action="store_true", help="print the job ids and return")
    p.add_argument(
        "--follow-timeout", type=float, default=None, help="stop following after this many seconds"
    )


def run(args: argparse.Namespace) -> int:
    from scaleout.errors import UserError
    from scaleout.launchers.submit import (
        SubmitLauncher,
        SubmitSpec,
        container_srun_args,
        follow,
        job_argvs,
        parse_array,
        parse_slurm_options,
        resolve_cluster,
    )

    if args.subcommand:
        argv = (
            shlex.split(args.subcommand)
            + ([args.config] if args.config else [])
            + list(args.overrides)
        )
    elif args.config:
        argv = ["train", args.config, *args.overrides]
    else:
        raise UserError(
            "no CONFIG given (expected e.g. `scaleout submit configs/bert_tiny_cpu.yaml`, or "
            "--command)"
        )
    spec = SubmitSpec(
        argv=argv,
        nodes=args.nnodes,
        gpus_per_node=args.nproc_per_node,
        request_gpus=not args.no_gpu_request,
        partition=args.partition,
        time_min=args.time,
        signal=args.signal,
        signal_delay_s=args.signal_delay,
        cluster=args.executor,
        folder=args.folder,
        name=args.name,
        array=parse_array(args.array),
        extra_slurm=parse_slurm_options(args.slurm),
        srun_args=container_srun_args(argv),
    )
    # The same checks `scaleout launch` runs, for every job's command and this world, before
    # anything is queued: a bad config is one line here, not a 256-node job whose every rank fails.
    from scaleout.cli import main, preflight
    from scaleout.runlock import release_held

    try:
        for job_argv in job_argvs(spec):
            preflight(job_argv, spec.nodes * spec.gpus_per_node, spec.gpus_per_node)
    finally:
        # checked free above (or refused: then the folders its lease made go again); the queued
        # job's rank 0 takes its run directories itself
        release_held()
    jobs = SubmitLauncher(entry=main).submit(spec)
    where = resolve_cluster(spec.cluster)
    for j in jobs:
        print(
            f"submitted {where} job {j.job_id}: {spec.nodes} node(s) x {spec.gpus_per_node} "
            "task(s), "
            f"scaleout {' '.join(argv)}; logs {j.job.paths.stdout}",
            flush=True,
        )
    if args.no_follow:
        return 0
    follow([j.job for j in jobs], timeout_s=args.follow_timeout)
    failed = 0
    for j in jobs:
        if not j.job.done():
            print(f"job {j.job_id}: still {j.job.state} (stopped following)", flush=True)
            continue
        result = j.result()  # the first failed task names the rank
        failed += not result.ok
        print(result.message, flush=True)
    return 1 if failed else 0
