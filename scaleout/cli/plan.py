"""scaleout plan: how many nodes, at what per-GPU batch, with which all-reduce and optimizer
placement — the Pareto front of predicted time-to-train against GPU-hours (scaleout.sim.plan)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from scaleout.output import format_table, pyplot, save_figure, write_json

NAME = "plan"
ORDER = 71
HELP = "choose the scale: Pareto front of predicted time-to-train vs GPU-hours, knee, sbatch line"
DESCRIPTION = """\
The Pareto front of predicted time-to-train against GPU-hours: every point of a grid priced by the
simulator (docs/plan.md):

  nodes x GPUs per node x per-GPU batch x all-reduce algorithm (scaleout.comm's)
        x optimizer placement (replicated | sharded over the world | sharded-node: within a node)
        x SHARP (in-network reduction; on InfiniBand presets only)

  time to train = ceil(samples(B) / B) x step time + evaluations   (B = the global batch)
  GPU-hours     = time to train x GPUs / 3600

samples(B), the samples to reach the config's target at global batch B: MLCommons' reference
convergence points of the config's MLPerf benchmark (mlperf-logging's RCP tables), or --fit, a
`scaleout bench largebatch --out` JSON (samples(B) = E_min (1 + B / B_crit), fitted). Evaluations
come every MLPerf interval at the batch (BERT's rule), else every train.eval_every x
train.global_batch samples of the config, data.eval_samples each.

The front keeps the points no other point beats on both axes (time from the launch to the target,
the untimed start before MLPerf's run_start included, and GPU-hours); its knee (marked K) is the
point farthest below the chord of the front's ends, each axis log-scaled to [0, 1]: past it, halving
the time costs a larger factor of GPU-hours than before. For the chosen point (--pick, default the
knee) the plan prints the schedule at its batch (learning rate, warm-up, decay horizon = max_steps,
evaluation cadence: the RCP record nearest the batch, scaled by its rules), the config overrides
(checked by the config loader) and the command that runs it: `sbatch -J ... -N ...` of the family's
Slurm script on a cluster, `scaleout launch` for one node or the netns emulation. Batches above the
largest RCP are priced but never picked (MLPerf refuses them); a run converging faster than the RCP
mean earns nothing (MLPerf normalises to it), so the RCP mean is what the plan counts.

--preset is a cluster preset (dgx-a100, dgx-h100, h200-superpod, netns-1g, horovod-2018) or the
JSON of `scaleout simulate calibrate --out` (its fitted constants on the netns-1g preset). A
cluster without device FLOP/s (netns: CPU ranks) needs --samples-per-s, the measured samples/s of
one rank; with --cores the ranks of an emulated cluster share that many cores.

examples:
  scaleout plan bert_large_256x8 --preset dgx-h100 --max-nodes 64 --pick cheapest
  scaleout plan configs/bert_large_256x8.yaml --preset dgx-a100 --png bench-results/plan.png
  scaleout plan bert_large_256x8 --preset h200-superpod --max-nodes 1024 \\
      --per-gpu-batch 4,8,16 --algorithms flat,hierarchical --pick fastest --out plan.json
  scaleout plan configs/bert_tiny_cpu.yaml --preset calib.json --fit largebatch.json \\
      --nnodes 1,2 --nproc-per-node 2 --per-gpu-batch 8,16 --samples-per-s 8:60,16:80 --cores 2
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from scaleout.argtypes import bounded
    from scaleout.section import MAX_WORLD

    p.add_argument(
        "config", help="training config: a path or a packaged name, as for `scaleout train`"
    )
    p.add_argument(
        "overrides", nargs="*", help="section.key=value overrides of the config (model, data)"
    )
    p.add_argument(
        "--preset",
        default="dgx-a100",
        help="cluster preset (see `scaleout simulate presets`) or a `scaleout simulate calibrate "
        "--out` JSON (default dgx-a100)",
    )
    p.add_argument(
        "--fit",
        default=None,
        help="`scaleout bench largebatch --out` JSON: samples to converge fitted to its LAMB runs "
        "(default: the MLPerf RCPs of the config's family)",
    )
    p.add_argument("--nnodes", default=None, help="node counts, e.g. 1,2 (default 1, 2, 4 ...)")
    p.add_argument(
        "--max-nodes",
        type=bounded(int, 1, MAX_WORLD),
        default=512,
        help="largest node count of the default (512)",
    )
    p.add_argument(
        "--nproc-per-node",
        default=None,
        help="ranks per node, one GPU each, e.g. 2 (default the preset's GPUs per node)",
    )
    p.add_argument(
        "--per-gpu-batch",
        default=None,
        help="per-GPU batches, e.g. 8,16 (default the config's / 4 ... x 4)",
    )
    p.add_argument(
        "--algorithms", default=None, help="all-reduce algorithms, comma list (default every one)"
    )
    p.add_argument(
        "--optimizers",
        default=None,
        help="comma list of replicated, sharded, sharded-node (default all three)",
    )
    p.add_argument(
        "--sharp",
        choices=("both", "on", "off"),
        default="both",
        help="SHARP points: both (where the cluster has it), on, off (default both)",
    )
    p.add_argument(
        "--samples-per-s",
        default=None,
        help="measured samples/s per GPU: RATE, or BATCH:RATE,... per per-GPU batch (needed "
        "where the cluster has no device FLOP/s: netns)",
    )
    p.add_argument(
        "--cores",
        type=bounded(int, 1, MAX_WORLD),
        default=None,
        help="ranks share this many CPU cores (emulated cluster): per-rank rate x min(1, "
        "cores / ranks)",
    )
    p.add_argument(
        "--host-ms",
        type=bounded(float, 0, what="ms"),
        default=0.0,
        help="fixed per-step host cost (ms)",
    )
    p.add_argument(
        "--pick",
        choices=("knee", "fastest", "cheapest"),
        default="knee",
        help="the recommended point (default knee)",
    )
    p.add_argument(
        "--top",
        type=bounded(int, 0, MAX_WORLD),
        default=20,
        help="rows of the table besides the front (20)",
    )
    p.add_argument("--out", default=None, help="write the plan as JSON here")
    p.add_argument("--png", default=None, help="write the front (and every point) as a PNG here")


def _algorithms(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [t.strip() for t in text.split(",") if t.strip()]


def inputs(args: argparse.Namespace) -> dict[str, Any]:
    """Every input checked (one line on bad input) before any pricing."""
    from scaleout.errors import ConfigError
    from scaleout.sim import plan as P

    gpn = P.positive_ints(args.nproc_per_node, "--nproc-per-node")
    nodes = P.positive_ints(args.nnodes, "--nnodes")
    batches = P.positive_ints(args.per_gpu_batch, "--per-gpu-batch")
    if args.max_nodes < 1:
        raise ConfigError(f"--max-nodes {args.max_nodes}: expected a positive integer")
    if args.cores is not None and args.cores < 1:
        raise ConfigError(f"--cores {args.cores}: expected a positive integer")
    if not (args.host_ms >= 0):
        raise ConfigError(f"--host-ms {args.host_ms}: expected a number of ms >= 0")
    rates = P.compute_rates(args.samples_per_s)
    cluster = P.load_cluster(args.preset)
    from scaleout.config.load import resolve_config_path

    path = str(resolve_config_path(args.config))  # a path or a packaged name, as train takes
    work = P.workload(path, list(args.overrides))
    curve = P.curve_of_family(work.arch, args.fit)
    work = P.for_curve(work, curve)
    optimizers = _algorithms(args.optimizers)
    sharp = {"both": None, "on": [True], "off": [False]}[args.sharp]
    if sharp == [True]:
        P.with_sharp(cluster, True)  # one line when the cluster has no SHARP
    grid = P.default_grid(
        cluster,
        max(1, round(work.config_per_gpu_batch)),
        args.max_nodes,
        nodes,
        gpn,
        batches,
        _algorithms(args.algorithms),
        optimizers,
        sharp,
    )
    return dict(work=work, cluster=cluster, curve=curve, grid=grid, rates=rates, cores=args.cores)


def _row(p: Any) -> list[Any]:
    c = p.candidate
    return [
        ("K" if p.knee else "*" if p.front else "")
        + ("!" if p.overrides is None else "")
        + ("x" if p.refused else ""),
        c.nodes,
        c.gpus_per_node,
        c.per_gpu_batch,
        c.global_batch,
        c.algorithm,
        c.optimizer,
        "on" if c.sharp else "off",
        f"{p.step_s * 1e3:.4g}",
        f"{p.samples:.4g}" + ("^" if p.extrapolated else ""),
        p.steps,
        f"{p.ttt_s / 60:.4g}",
        f"{p.start_s / 60:.3g}",
        f"{p.wall_s / 60:.4g}",
        f"{p.gpu_hours:.4g}",
    ]


HEADERS = [
    "",
    "nodes",
    "GPUs/node",
    "batch/GPU",
    "global batch",
    "algorithm",
    "optimizer",
    "SHARP",
    "step ms",
    "samples",
    "steps",
    "TTT min",
    "start min",
    "launch->target min",
    "GPU-h",
]


def run(args: argparse.Namespace) -> int:
    from scaleout.sim import plan as P

    got = inputs(args)
    work, cluster, curve = got["work"], got["cluster"], got["curve"]
    res = P.plan(
        work,
        cluster,
        curve,
        got["grid"],
        args.pick,
        got["rates"],
        got["cores"],
        args.host_ms / 1e3,
    )
    chosen = res.chosen
    P.validate_overrides(args.config, [*args.overrides, *chosen.overrides])
    print(
        f"{args.config} on {cluster.name}: {len(res.points)} points, {len(res.front)} on the "
        f"front; samples to converge: {curve.describe()}"
    )
    for note in [*curve.notes, *assumptions(work, cluster, args.fit), *res.notes]:
        print(f"  note: {note}")
    rest = sorted((p for p in res.points if not p.front), key=lambda p: p.wall_s)
    rest = rest[: max(0, args.top)]
    print(format_table(HEADERS, [_row(p) for p in res.front] + [_row(p) for p in rest]))
    print(
        "K knee, * on the front, ! no config key (priced only), x batch MLPerf refuses (above the "
        "largest RCP), ^ batch beyond the convergence curve's data; TTT = MLPerf's clock "
        "(run_start -> run_stop), start = the untimed start before it; "
        f"{len(res.points) - len(res.front) - len(rest)} more points in --out"
    )
    overrides = [*args.overrides, *chosen.overrides]
    netns = cluster.backend == "gloo"
    print(
        f"\nchosen ({args.pick}): {chosen.candidate.label()}: time to train "
        f"{chosen.ttt_s / 60:.4g} min after an untimed start of {chosen.start_s / 60:.3g} min "
        f"(launch to target {chosen.wall_s / 60:.4g} min), {chosen.gpu_hours:.4g} GPU-hours, "
        f"{chosen.throughput:.4g} samples/s"
    )
    if chosen.schedule is not None:
        print("  schedule: " + chosen.schedule.describe())
    print("  overrides: " + " ".join(chosen.overrides))
    commands = P.commands(work.arch, args.config, chosen.candidate, overrides, netns)
    for line in commands.values():
        print("  " + line)
    payload = {
        "action": "plan",
        "config": args.config,
        "overrides": list(args.overrides),
        "cluster": cluster.summary(),
        "convergence": curve.describe(),
        "pick": args.pick,
        "grid": {k: v for k, v in vars(got["grid"]).items()},
        "samples_per_s": got["rates"],
        "cores": got["cores"],
        "knee": res.knee.to_dict(),
        "chosen": {**chosen.to_dict(), **commands},
        "front": [p.to_dict() for p in res.front],
        "points": [p.to_dict() for p in res.points],
    }
    out = write_json(args.out or None, payload)
    if out:
        print(f"wrote {out}")
    if args.png:
        _plot(res, args.png, f"{os.path.basename(args.config)} on {cluster.name}")
    return 0


def assumptions(work: Any, cluster: Any, fit: str | None) -> list[str]:
    """What the plan assumes where `scaleout simulate scale` (its defaults) assumes otherwise."""
    from scaleout.sim.startup import start_model

    out = []
    if not fit:
        out.append(
            "samples at each batch are the RCP mean: MLPerf scores a run that converges in fewer "
            "samples as if it took the RCP mean (rcp_checker's normalisation), so converging "
            "faster earns no credit; `simulate scale` assumes train.max_steps x "
            "train.global_batch samples at every batch unless sim.convergence=rcp"
        )
    if work.rate != 1:
        out.append(
            f"a config sample (packed row) counts {work.rate} of MLPerf's samples "
            "(global_batch_size = rows x the packing's integer rate)"
        )
    if work.ceiling is not None:
        out.append(f"batch ceiling {work.ceiling:g} (the largest RCP batch MLPerf accepts)")
    out.append(
        "every optimizer placement, algorithm and (InfiniBand) SHARP setting is priced; "
        "`simulate scale` prices the config's own"
    )
    out.append(f"untimed start: {start_model(cluster).source}")
    return out


def _plot(res: Any, path: str, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.scatter(
        [p.gpu_hours for p in res.points],
        [p.ttt_s / 60 for p in res.points],
        s=8,
        c="0.7",
        label="every point",
    )
    fr = sorted(res.front, key=lambda p: p.gpu_hours)
    ax.plot(
        [p.gpu_hours for p in fr], [p.ttt_s / 60 for p in fr], "o-", c="C0", label="Pareto front"
    )
    for p in fr:
        c = p.candidate
        ax.annotate(
            f"{c.nodes}x{c.gpus_per_node} b{c.per_gpu_batch}",
            (p.gpu_hours, p.ttt_s / 60),
            fontsize=7,
            xytext=(4, 2),
            textcoords="offset points",
        )
    k = res.knee
    ax.plot([k.gpu_hours], [k.ttt_s / 60], "*", ms=16, c="C3", label=f"knee: {k.candidate.label()}")
    ch = res.chosen
    if ch is not k:
        ax.plot([ch.gpu_hours], [ch.ttt_s / 60], "s", ms=9, mfc="none", c="C2", label="chosen")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("GPU-hours")
    ax.set_ylabel("predicted time to train (min)")
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    save_figure(fig, path)
