"""scaleout sweep: scaling efficiency of a config over world sizes (weak or strong), on any
launcher."""

from __future__ import annotations

import argparse
import os

from scaleout.launchers import LAUNCHERS, LaunchOptions, make_launcher

NAME = "sweep"
ORDER = 32
HELP = "scaling-efficiency sweep: run a config at several world sizes, tabulate and plot efficiency"
DESCRIPTION = """\
scaleout sweep CONFIG --world 1,2,4,8 [overrides ...]

Runs `scaleout train CONFIG` at every world size for --steps steps (the first --warmup steps are not
timed), one point after another, and collects each point's report.json: step time, samples/s and its
breakdown (compute, exposed communication, optimizer, data, other), then the scaling efficiency
against the smallest world b of the sweep (normally 1):

  weak   (per-rank batch fixed, global = per-rank x N):  (X_N / N) / (X_b / b), X = samples/s
  strong (global batch fixed, must divide by every N):   b * T_b / (N * T_N),   T = s per step

Writes sweep.csv, sweep.json, sweep.md (the table printed here) and sweep.png (throughput and
efficiency vs GPUs with the ideal line, step-time breakdown) to --out-dir; each point's logs and
report.json are in <out-dir>/points/w<N>-<nodes>x<ranks>/.

Node shape of each point (one of):
  --nproc-per-node G   G ranks per node (default: the config's launch.nproc_per_node). N <= G runs
  on one
                       node with N ranks; larger N must be a multiple of G and runs on N / G nodes.
  --nnodes 1,1,2,4     node count per world size (same length as --world); N / nodes ranks per node.

Launchers: local (launchers/local.py on this machine, each node's ranks as an emulated node; --netns
puts every node in its own network namespace with a --rate link), slurm (one sbatch
-N/--ntasks-per-node job per point, waited for; works with the local cluster of `scaleout slurm up`
or a real one), submit (submitit: Slurm if sbatch is on PATH, else its local executor, one node).

On a machine with fewer cores than ranks the numbers measure CPU oversubscription more than the
framework; the output says so.

examples:
  scaleout sweep bert_tiny_cpu --world 1,2,4 --nproc-per-node 2 --steps 5 --repeats 3 \\
      --simulate netns-1g
  scaleout sweep bert_tiny_cpu --world 1,2,4 --mode strong --global-batch 32
  scaleout sweep resnet_cpu --world 2,4 --nnodes 1,2 model.resnet.bn_group=2 --netns --rate 1gbit
  scaleout sweep bert_tiny_cpu --world 1,2,4,8 --nproc-per-node 2 --launcher slurm --no-gpu-request
  scaleout sweep bert_tiny_cpu --world 1,2,4,8 --nproc-per-node 2 --launcher slurm \\
      --slurm account=proj --resume
  scaleout sweep configs/bert_large_256x8.yaml --world 8,64,512,2048 --nproc-per-node 8 \\
      --launcher slurm --partition gpu --time 20 --simulate dgx-a100
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from scaleout.cli._keys import overrides_anywhere

    overrides_anywhere(p)
    p.add_argument("config", help="config file, or a name in configs/ (e.g. bert_tiny_cpu)")
    p.add_argument(
        "overrides", nargs="*", help="section.key=value overrides applied at every point"
    )
    p.add_argument(
        "--world",
        required=True,
        metavar="N1,N2,...",
        help="world sizes (ranks = GPUs), e.g. 1,2,4,8",
    )
    shape = p.add_mutually_exclusive_group()
    shape.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="G",
        help="ranks per node for every point (default: the config's launch.nproc_per_node)",
    )
    shape.add_argument(
        "--nnodes", default=None, metavar="M1,M2,...", help="node count per world size"
    )
    p.add_argument(
        "--mode", default="weak", help="weak (per-rank batch fixed) or strong (global batch fixed)"
    )
    p.add_argument(
        "--per-rank-batch",
        type=int,
        default=None,
        help="weak: samples per rank per step (default: the config's global_batch / its launch "
        "world)",
    )
    p.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="strong: the global batch at every point (default: the config's train.global_batch)",
    )
    p.add_argument("--steps", type=int, default=5, help="steps per point (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="first steps not timed (default 1)")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the whole sweep this many rounds (1,2,4,1,2,4,...) and keep each point's median "
        "run",
    )
    p.add_argument(
        "--launcher",
        default="local",
        help=f"{', '.join(LAUNCHERS)} (default local; netns = local --netns)",
    )
    p.add_argument(
        "--netns", action="store_true", help="local: every node in its own network namespace (root)"
    )
    p.add_argument(
        "--rate", default="1gbit", help="with --netns: per-node link rate (default 1gbit; 'none')"
    )
    p.add_argument("--partition", default=None, help="slurm/submit: partition")
    p.add_argument(
        "--time", type=int, default=30, help="slurm/submit: time limit per point in minutes (30)"
    )
    p.add_argument(
        "--no-gpu-request", action="store_true", help="slurm/submit: do not ask for a GPU per task"
    )
    p.add_argument(
        "--executor",
        default="auto",
        help="submit: submitit executor, auto, slurm, local or debug (as scaleout submit)",
    )
    p.add_argument(
        "--slurm",
        action="append",
        default=[],
        metavar="KEY=VAL",
        help="slurm/submit: any sbatch option, repeatable (--slurm account=proj --slurm qos=high)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="skip runs whose folder already holds a good report of the same command (an "
        "interrupted sweep)",
    )
    p.add_argument(
        "--threads-per-rank",
        type=int,
        default=None,
        help="OMP_NUM_THREADS of every rank at every point (default: $OMP_NUM_THREADS, else cores "
        "/ "
        "largest world for local runs, so a rank has the same CPU share at every point)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds before a point is stopped (default none)",
    )
    p.add_argument(
        "--simulate",
        default=None,
        metavar="PRESET",
        help="add the cost model's efficiency for each point (scaleout simulate presets, e.g. "
        "netns-1g)",
    )
    p.add_argument(
        "--out-dir",
        default="bench-results/sweep",
        help="output folder (default bench-results/sweep)",
    )
    p.add_argument("--no-png", action="store_true", help="skip the PNG")


def _batch(args: argparse.Namespace, cfg: object) -> int:
    from scaleout.errors import UserError
    from scaleout.sweep import default_batch

    if args.mode == "weak" and args.global_batch is not None:
        raise UserError(
            f"--global-batch={args.global_batch} with --mode weak: weak scaling fixes the per-rank "
            "batch "
            f"(use --per-rank-batch)"
        )
    if args.mode == "strong" and args.per_rank_batch is not None:
        raise UserError(
            f"--per-rank-batch={args.per_rank_batch} with --mode strong: strong scaling fixes the "
            "global "
            f"batch (use --global-batch)"
        )
    given = args.per_rank_batch if args.mode == "weak" else args.global_batch
    return given if given is not None else default_batch(cfg, args.mode)


def _threads(args: argparse.Namespace, points: list) -> int | None:
    """Threads per rank, the same at every point: a rank is one GPU, and a GPU does not get
    faster when fewer ranks run (launchers.local would otherwise give each rank cores / world
    threads)."""
    from scaleout.errors import UserError

    if args.threads_per_rank is not None:
        if args.threads_per_rank < 1:
            raise UserError(f"--threads-per-rank={args.threads_per_rank}: expected an integer >= 1")
        return args.threads_per_rank
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    if _on_this_host(args):
        return max(1, (os.cpu_count() or 1) // max(p.world for p in points))
    return None


def _on_this_host(args: argparse.Namespace) -> bool:
    """Do the ranks run on this machine (local launcher, submitit's local executor, the local
    Slurm)?"""
    if args.launcher == "local":
        return True
    if args.launcher == "submit":
        from scaleout.launchers.submit import resolve_cluster

        return resolve_cluster(args.executor) in ("local", "debug")
    from scaleout.launchers.slurm import LocalSlurm

    return os.environ.get("SLURM_CONF") == LocalSlurm().slurm_conf


def _notes(
    args: argparse.Namespace, points: list, base_world: int | None, threads: str | None
) -> list[str]:
    cores = os.cpu_count() or 1
    most = max(p.world for p in points)
    notes = []
    if _on_this_host(args):
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        share = f"at {most} ranks {most / cores:.1f}x oversubscribed" if most > cores else "shared"
        share += f" with whatever else runs (load average {load:.1f} at the end)"
        notes.append(
            f"every rank runs on this machine's {cores} CPU cores, {share}: these numbers measure "
            "CPU "
            "sharing more than communication (the tool measures honestly; the machine is the "
            "limit)"
        )
    if base_world not in (None, 1):
        notes.append(
            f"efficiency is relative to the smallest world in the sweep ({base_world} ranks), not 1"
        )
    if threads:
        notes.append(f"OMP_NUM_THREADS={threads} per rank at every point")
    rounds = f"; each point is the median of {args.repeats} rounds" if args.repeats > 1 else ""
    notes.append(
        f"times are rank 0's mean over {args.steps - args.warmup} timed steps after {args.warmup} "
        "warm-up"
        f"{rounds}; 'other' = step time minus the named phases (per-step vote, waiting for slower "
        "ranks)"
    )
    return notes


def run(args: argparse.Namespace) -> int:
    from scaleout.argtypes import parse_csv
    from scaleout.cli import main
    from scaleout.config import load_config
    from scaleout.config.load import resolve_config_path
    from scaleout.errors import UserError
    from scaleout.launchers.submit import parse_slurm_options
    from scaleout.launchers.sweep import check_launcher, run_sweep
    from scaleout.output import format_table
    from scaleout.sweep import MODES, add_efficiency, check_points, plan_points, write_outputs
    from scaleout.sweep.plot import plot
    from scaleout.sweep.results import table_rows

    # Everything is validated before the first rank starts.
    if args.launcher == "netns":  # the same as --launcher local --netns
        args.launcher, args.netns = "local", True
    if args.mode not in MODES:
        raise UserError(f"--mode={args.mode!r}: expected weak or strong")
    worlds = parse_csv(args.world, "--world", int, at_least=1)
    nodes = parse_csv(args.nnodes, "--nnodes", int, at_least=1) if args.nnodes else None
    config = str(resolve_config_path(args.config).resolve())
    cfg = load_config(config, args.overrides)
    gpn = args.nproc_per_node if nodes is None else None
    if nodes is None and gpn is None:
        gpn = cfg.launch.nproc_per_node
    points = plan_points(worlds, args.mode, _batch(args, cfg), cfg.train.grad_accum, nodes, gpn)
    extra = [] if args.launcher == "local" else ["launch.env=auto"]  # the config may say local
    check_points(config, [*args.overrides, *extra], points, args.steps, args.warmup)
    if args.repeats < 1:
        raise UserError(f"--repeats={args.repeats}: expected an integer >= 1")
    threads = _threads(args, points)
    env = {"OMP_NUM_THREADS": str(threads)} if threads is not None else {}
    # --netns: the local launcher with every node in a network namespace (the netns launcher)
    name = "netns" if args.launcher == "local" and args.netns else args.launcher
    launcher = make_launcher(
        name,
        LaunchOptions(
            extra_env=env,
            rate=args.rate if args.netns else None,
            partition=args.partition,
            time_min=args.time,
            gpus=not args.no_gpu_request,
            slurm=parse_slurm_options(args.slurm),
            cluster=args.executor,
            entry=main,
        ),
    )
    check_launcher(launcher, points)
    sim = None
    if args.simulate:
        from scaleout.sweep.simulate import Simulator

        sim = Simulator(args.simulate, cfg)

    print(
        f"scaleout sweep: {args.config}, {args.mode} scaling, worlds {[p.world for p in points]}, "
        f"launcher {args.launcher}{' (netns ' + args.rate + ')' if args.netns else ''} -> "
        f"{args.out_dir}",
        flush=True,
    )
    results = run_sweep(
        launcher,
        points,
        config,
        args.overrides,
        args.steps,
        args.warmup,
        args.out_dir,
        extra_overrides=extra,
        progress=lambda s: print(s, flush=True),
        repeats=args.repeats,
        resume=args.resume,
        timeout_s=args.timeout,
    )
    base = add_efficiency(results, args.mode)
    if sim is not None and base is not None:
        sim.fill(results, base, args.mode)
    meta = {
        "config": args.config,
        "config_path": config,
        "overrides": list(args.overrides),
        "mode": args.mode,
        "launcher": args.launcher,
        "netns_rate": args.rate if args.netns else None,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "base_world": base.point.world if base else None,
        "simulate": args.simulate,
    }
    notes = _notes(
        args,
        points,
        meta["base_world"],
        env.get("OMP_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS"),
    )
    paths = write_outputs(args.out_dir, results, meta, notes)
    headers, rows = table_rows(results, simulated=sim is not None)
    print()
    print(format_table(headers, rows))
    for n in notes:
        print(f"note: {n}")
    png = (
        None
        if args.no_png
        else plot(
            results,
            os.path.join(args.out_dir, "sweep.png"),
            f"{args.config}: {args.mode} scaling ({args.launcher})",
        )
    )
    written = [str(p) for p in paths.values()] + ([str(png)] if png else [])
    print(f"wrote {', '.join(written)}", flush=True)
    failed = [r for r in results if not r.ok]
    return 1 if failed else 0
