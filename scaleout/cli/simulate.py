"""scaleout simulate: the alpha-beta-gamma cost model (scaleout.sim) from 8 to thousands of GPUs."""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from scaleout.config.schema import CheckpointConfig
from scaleout.output import format_table, pyplot, write_json

NAME = "simulate"
ALL_ALGORITHMS = "every algorithm of scaleout.comm, then the simulator-only tree; also: leader"
ORDER = 70
HELP = (
    "cost-model simulator: all-reduce algorithms and training steps at 8-4096+ GPUs, "
    "calibration, validation"
)
DESCRIPTION = """\
An alpha-beta-gamma model of the all-reduce algorithms of scaleout.comm (each prices itself; plus
the simulator-only NCCL tree and Horovod leader ring) and of a data-parallel training step with
bucketed overlap (docs/simulate.md). Instant; no GPU needed.

actions:
  scale      step time, exposed communication, scaling efficiency and time to train per algorithm
             (samples to converge from MLCommons' RCPs at each global batch, or a fit to your
             `scaleout bench largebatch` runs: --convergence; a fixed per-step host cost:
             --overhead, --cuda-graphs)
  convergence  samples to converge vs global batch: the RCP table (or the fit to a bench
             largebatch JSON) and the curve at chosen batches
  allreduce  predicted time / busbw of one all-reduce per algorithm and message size
  calibrate  fit the constants to `scaleout bench allreduce` JSON; report held-out prediction error
  validate   predictions vs published numbers (nccl-tests, MLPerf BERT v2.0-v3.1 and the
             1024 -> 4096 A100 speed-up, Horovod #542)
  presets    list the cluster and model presets
  mlperf-log steps, time per step and score of MLPerf result_*.txt files (how validate's numbers
  were read)

Optimizer placement (--optimizer): replicated (all-reduce, LAMB on every parameter), sharded (ZeRO-1
over all ranks: reduce-scatter, LAMB on 1/p, all-gather; optim.sharded=true), sharded-node (apex
DistributedFusedLAMB: sharded within each node). --sharp: in-network reduction between nodes (SHARP
via NCCL CollNet) for tree/hierarchical/torus2d, on InfiniBand presets.

examples:
  scaleout simulate scale --config configs/bert_large_256x8.yaml --sharp
  scaleout simulate scale --config configs/bert_large_256x8.yaml --min-gpus 2048 optim.sharded=true
  scaleout simulate scale --cluster dgx-a100 --model bert-large --local-batch 4 --png
  bench-results/sim.png
  scaleout simulate scale --cluster dgx-h100 --model resnet50 --local-batch 256 --max-gpus 8192
  scaleout simulate scale --cluster dgx-a100 --inter-gbit 100 --nics 1 --algorithms
  flat,hierarchical
  scaleout simulate allreduce --cluster dgx-a100 --nodes 1 --sizes-mb 1,64,1024
  scaleout simulate calibrate bench-results/allreduce.json --holdout torus2d --min-bytes 1MiB
  scaleout simulate scale --model bert-large --convergence bench-results/largebatch.json
  scaleout simulate convergence rcp --model resnet50 --batches 1024,4096,32768
  scaleout simulate validate --out bench-results/sim-validate.json
  scaleout simulate mlperf-log
  training_results_v2.0/NVIDIA/results/dgxa100_n512_ngc22.04_pytorch/bert
"""


def _cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cluster", default="dgx-a100", help="cluster preset (default dgx-a100; see 'presets')"
    )
    p.add_argument("--gpus-per-node", type=int, default=None, help="override GPUs per node")
    p.add_argument("--nics", type=int, default=None, help="override NICs per node")
    p.add_argument(
        "--intra-gbs",
        type=float,
        default=None,
        help="achievable intra-node GB/s per GPU per direction",
    )
    p.add_argument(
        "--inter-gbit", type=float, default=None, help="achievable Gbit/s per NIC per direction"
    )
    p.add_argument(
        "--intra-lat-us", type=float, default=None, help="latency of one intra-node step (us)"
    )
    p.add_argument(
        "--inter-lat-us", type=float, default=None, help="latency of one network step (us)"
    )
    p.add_argument(
        "--sharp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="in-network reduction between nodes (SHARP / NCCL CollNet; default off)",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="<action>")
    sc = sub.add_parser(
        "scale",
        help="training-step scaling sweep and time to train",
        description="Step time, exposed communication, efficiency and time to train per GPU count "
        "and algorithm. Values come from the flags, else from --config, else the defaults.",
    )
    _cluster_args(sc)
    sc.add_argument(
        "--config",
        default=None,
        help="training config (YAML as for `scaleout train`): model size, per-GPU batch, "
        "optim.sharded, "
        "comm.*, samples and the config's node count (added to the sweep)",
    )
    sc.add_argument(
        "overrides",
        nargs="*",
        help="section.key=value overrides of --config, e.g. optim.sharded=true",
    )
    sc.add_argument(
        "--model", default=None, help="model preset (default bert-large, or the config's model)"
    )
    sc.add_argument(
        "--optimizer",
        default=None,
        help="replicated | sharded | sharded-node (default replicated, or the config's "
        "optim.sharded)",
    )
    sc.add_argument(
        "--param-bytes",
        type=int,
        default=None,
        help="bytes per parameter a sharded optimizer all-gathers",
    )
    sc.add_argument("--params", type=float, default=None, help="override parameter count")
    sc.add_argument(
        "--flops-per-sample", type=float, default=None, help="override training FLOPs per sample"
    )
    sc.add_argument(
        "--grad-bytes", type=int, default=None, help="bytes per gradient element on the wire"
    )
    sc.add_argument(
        "--local-batch", type=float, default=None, help="samples per GPU per step (default 4)"
    )
    sc.add_argument(
        "--mfu", type=float, default=0.4, help="achieved fraction of peak FLOP/s (default 0.4)"
    )
    sc.add_argument(
        "--samples-per-s", type=float, default=None, help="per-device throughput (overrides --mfu)"
    )
    sc.add_argument(
        "--bucket-mb", type=float, default=None, help="gradient bucket size in MB (default 25, DDP)"
    )
    sc.add_argument("--no-overlap", action="store_true", help="all-reduce only after backward")
    sc.add_argument("--algorithms", default=None, help=f"comma list (default: {ALL_ALGORITHMS})")
    sc.add_argument(
        "--torus-x", default=None, help="torus row length: an integer, 'node' or 'square' (default)"
    )
    sc.add_argument("--min-gpus", type=int, default=None, help="first GPU count (default one node)")
    sc.add_argument("--max-gpus", type=int, default=4096, help="last GPU count (default 4096)")
    sc.add_argument(
        "--samples",
        type=float,
        default=None,
        help="samples to converge at every batch (default: --convergence)",
    )
    _convergence_args(sc)
    sc.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the step is one CUDA graph (default): the per-step host cost only; "
        "--no-cuda-graphs: eager, the step takes at least the host's launch time",
    )
    sc.add_argument(
        "--overhead",
        default="scaleout-h200",
        help="calibration of the fixed per-step cost: scaleout-h200 (default; scaleout's "
        "measured H200 rows), nvidia-bert (NVIDIA's MLPerf BERT, calibrated on a published run) "
        "or none",
    )
    sc.add_argument(
        "--host-ms", type=float, default=None, help="per-step host time in ms (overrides)"
    )
    sc.add_argument(
        "--mtbf-h",
        type=float,
        default=CheckpointConfig.model_fields["mtbf_h"].default,
        help="one node's mean time between failures, hours (goodput row; default "
        "checkpoint.mtbf_h's, %(default)g)",
    )
    sc.add_argument(
        "--save-stall-s",
        type=float,
        default=1.0,
        help="seconds a checkpoint stalls training (goodput row; default 1: an asynchronous "
        "save's host copy)",
    )
    sc.add_argument(
        "--restart-s",
        type=float,
        default=300.0,
        help="seconds from a failure to training again: requeue, start-up, resume (default 300)",
    )
    sc.add_argument(
        "--interval-s",
        type=float,
        default=None,
        help="training seconds between checkpoints (goodput row; default: Young/Daly's)",
    )
    sc.add_argument(
        "--out", default="bench-results/simulate-scale.json", help="JSON output ('' to skip)"
    )
    sc.add_argument(
        "--png", default=None, help="PNG of efficiency and exposed communication vs GPUs"
    )

    ar = sub.add_parser("allreduce", help="one all-reduce: time and busbw per algorithm and size")
    _cluster_args(ar)
    ar.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    ar.add_argument(
        "--sizes-mb", default="1,16,256,4096", help="message sizes in MiB per rank (comma list)"
    )
    ar.add_argument("--algorithms", default=None, help=f"comma list (default: {ALL_ALGORITHMS})")
    ar.add_argument(
        "--torus-x", default="square", help="torus row length: integer, 'node' or 'square'"
    )

    ca = sub.add_parser("calibrate", help="fit constants to bench JSON; held-out error")
    ca.add_argument(
        "bench_json",
        help="output of 'scaleout bench allreduce --out' (schema: scaleout.sim.calibrate)",
    )
    ca.add_argument(
        "--holdout",
        default="",
        help="algorithms to leave out of the fit (comma list), e.g. torus2d",
    )
    ca.add_argument(
        "--every", type=int, default=2, help="fit on every N-th size, test on the rest (default 2)"
    )
    ca.add_argument(
        "--stat",
        default="min",
        choices=("min", "median"),
        help="per-row statistic when rows carry every run's time (default min: least disturbed)",
    )
    ca.add_argument(
        "--min-bytes", default="0", help="ignore rows below this size, e.g. 1MiB (default 0)"
    )
    ca.add_argument(
        "--tolerance",
        type=float,
        default=0.20,
        help="exit 1 if a held-out error exceeds this (default 0.20)",
    )
    ca.add_argument(
        "--out", default="bench-results/simulate-calibrate.json", help="JSON output ('' to skip)"
    )

    va = sub.add_parser(
        "validate",
        help="predictions vs published numbers",
        description="The cost model against nccl-tests, five published MLPerf BERT runs "
        "(A100 and H100, 64 to 4096 GPUs; sources in each check; (e) calibrates the per-step host "
        "time), the 1024 -> 4096 A100 speed-up predicted from the global batches (samples to "
        "converge from MLCommons' RCPs) and Horovod #542. Exit 1 if a row is outside its "
        "tolerance.",
    )
    va.add_argument(
        "--out", default="bench-results/simulate-validate.json", help="JSON output ('' to skip)"
    )
    cv = sub.add_parser(
        "convergence",
        help="samples to converge vs global batch (RCPs or a fit to bench largebatch)",
        description="The curve the time to train uses: MLCommons' RCP table for the model's "
        "MLPerf benchmark, read from the installed mlperf-logging (olympic means, pruned as "
        "rcp_checker prunes, linear in the batch between them), or the fit samples = E_min "
        "(1 + B / B_crit) to a `scaleout bench largebatch --out` JSON, with the data beside it.",
    )
    cv.add_argument(
        "source", nargs="?", default="rcp", help="rcp (default) or a bench largebatch JSON"
    )
    cv.add_argument(
        "--model", default="bert-large", help="model preset (rcp: bert-large, resnet50)"
    )
    cv.add_argument(
        "--rcp-ruleset", default=None, help="MLPerf Training ruleset of the RCPs (default 2.0.0)"
    )
    cv.add_argument(
        "--batches", default=None, help="global batches to evaluate the curve at (comma list)"
    )
    cv.add_argument("--png", default=None, help="PNG of the curve with its points")
    sub.add_parser("presets", help="list cluster and model presets")
    ml = sub.add_parser(
        "mlperf-log",
        help="summarise MLPerf result logs (steps, time per step, score)",
        description="Median steps (train_samples / global_batch_size), time per step "
        "((run_stop - run_start) / steps) and the score (mean without fastest and slowest run) "
        "of MLPerf Training result_*.txt files, as scaleout.sim.mlperf records its references.",
    )
    ml.add_argument("paths", nargs="+", help="result_*.txt files or directories holding them")
    p.set_defaults(_sim_parser=p)


def _convergence_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--convergence",
        default=None,
        help="samples to converge as a function of the global batch: rcp (MLCommons' reference "
        "convergence points for the model's MLPerf benchmark, from the installed mlperf-logging), "
        "a `scaleout bench largebatch --out` JSON (fitted), or fixed (the preset's samples at "
        "every batch). Default: rcp for the bert-large/resnet50 presets, fixed with --config",
    )
    p.add_argument(
        "--rcp-ruleset",
        default=None,
        help="MLPerf Training ruleset whose RCPs to read (default 2.0.0)",
    )


def _cluster(args: argparse.Namespace, gpus_per_node: int | None = None) -> Any:
    from scaleout.sim.cluster import custom_cluster, get_cluster, with_sharp

    c = custom_cluster(
        get_cluster(args.cluster),
        args.gpus_per_node or gpus_per_node,
        args.nics,
        args.intra_gbs,
        args.inter_gbit,
        args.intra_lat_us,
        args.inter_lat_us,
    )
    return with_sharp(c, args.sharp)


def _algorithms(text: str | None, flag: str = "--algorithms") -> list[str]:
    """The names in ``text`` (checked against the simulator's list), or every one when None."""
    from scaleout.argtypes import parse_csv
    from scaleout.sim.collectives import algorithm_names, canonical

    if text is None:
        return list(algorithm_names())
    return parse_csv(text, flag, canonical, allow_empty=True)


def _torus_x(text: str) -> int | str:
    return int(text) if text.strip().isdigit() else text.strip()


def _write(path: str | None, payload: dict[str, Any]) -> None:
    out = write_json(path or None, payload)
    if out:
        print(f"wrote {out}")


def _scale_specs(args: argparse.Namespace) -> tuple[Any, Any, Any, list[int], list[str]]:
    """(cluster, model, train, GPU counts, algorithms): flags over --config over the defaults."""

    from scaleout.errors import ConfigError
    from scaleout.sim.step import TrainSpec, get_model, gpu_counts

    run = None
    if args.overrides and not args.config:
        raise ConfigError(
            f"overrides {' '.join(args.overrides)!r} need --config (they change a training config)"
        )
    if args.config:
        from scaleout.config.load import load_config
        from scaleout.sim.fromconfig import from_config

        # --optimizer sharded/replicated on a config means the product's optimizer, with its wire
        # bytes
        placement = {
            "sharded": ["optim.sharded=true"],
            "replicated": ["optim.sharded=false", "optim.overlap_comm=false"],
        }
        overrides = list(args.overrides) + placement.get(args.optimizer or "", [])
        run = from_config(load_config(args.config, overrides), args.config)
    cluster = _cluster(args, run.gpus_per_node if run else None)
    model = get_model(args.model or "bert-large") if args.model or not run else run.model
    changes = {
        k: v
        for k, v in (
            ("params", args.params),
            ("flops_per_sample", args.flops_per_sample),
            ("grad_bytes", args.grad_bytes),
            ("param_bytes", args.param_bytes),
        )
        if v is not None
    }
    for k, v in changes.items():
        if v <= 0:
            raise ConfigError(f"--{k.replace('_', '-')} must be > 0, got {v}")
    model = replace(model, **changes)
    train = run.train if run else TrainSpec(local_batch=4, torus_x="square")
    given = {
        k: v
        for k, v in (
            ("local_batch", args.local_batch),
            ("mfu", args.mfu),
            ("bucket_mb", args.bucket_mb),
            ("samples_per_s", args.samples_per_s),
            ("optimizer", args.optimizer),
            ("torus_x", _torus_x(args.torus_x) if args.torus_x else None),
        )
        if v is not None
    }
    train = replace(train, **given, **({"overlap": False} if args.no_overlap else {}))
    algs = (
        _algorithms(args.algorithms)
        if args.algorithms
        else ([train.algorithm] if run else _algorithms(None))
    )
    gpus = gpu_counts(cluster, args.max_gpus, args.min_gpus)
    if run and run.nodes * cluster.gpus_per_node not in gpus:
        gpus = sorted(gpus + [run.nodes * cluster.gpus_per_node])
    return cluster, model, train, gpus, algs


def _curve(args: argparse.Namespace, model_name: str, default: str | None) -> Any:
    from scaleout.sim.convergence import DEFAULT_RULESET, curve_for

    source = args.convergence if args.convergence is not None else default
    return curve_for(model_name, source, args.rcp_ruleset or DEFAULT_RULESET)


def _overhead(args: argparse.Namespace, train: Any) -> Any:
    from scaleout.errors import ConfigError
    from scaleout.sim.overhead import get_overhead
    from scaleout.sim.step import with_overhead

    train = with_overhead(replace(train, cuda_graphs=args.cuda_graphs), get_overhead(args.overhead))
    if args.host_ms is not None:
        if args.host_ms < 0:
            raise ConfigError(f"--host-ms must be >= 0, got {args.host_ms}")
        train = replace(train, host_s=args.host_ms / 1e3)
    return train


def run_scale(args: argparse.Namespace) -> int:
    from scaleout.sim.step import step_time, time_to_train

    cluster, model, train, gpus, algs = _scale_specs(args)
    train = _overhead(args, train)
    fixed = args.samples or args.config
    curve = None if args.samples else _curve(args, model.name, "fixed" if fixed else "rcp")
    samples = args.samples or (None if curve else model.samples_to_converge)
    rows, table = [], []
    for n in gpus:
        nodes = n // cluster.gpus_per_node
        for alg in algs:
            t = replace(train, algorithm=alg)
            r = step_time(model, t, cluster, nodes)
            ttt = (
                time_to_train(model, t, cluster, nodes, samples, curve)
                if samples or curve
                else None
            )
            rows.append(
                {
                    **asdict(r),
                    "efficiency": r.efficiency,
                    "throughput": r.throughput(train.local_batch),
                    "global_batch": n * train.local_batch,
                    "samples_to_converge": ttt.samples if ttt else None,
                    "extrapolated": bool(curve and curve.extrapolated(n * train.local_batch)),
                    "time_to_train_s": ttt.total if ttt else None,
                    "steps": ttt.steps if ttt else None,
                    "evals": ttt.evals if ttt else None,
                }
            )
            table.append(
                [
                    n,
                    nodes,
                    alg if r.chosen is None else f"{alg}: {r.chosen}",
                    r.step * 1e3,
                    r.compute * 1e3,
                    r.optimizer * 1e3,
                    r.exposed * 1e3,
                    r.host * 1e3,
                    f"{r.efficiency:.1%}",
                    r.throughput(train.local_batch),
                    r.state_bytes / 2**20,
                    (f"{ttt.samples / 1e6:.3g}" + ("*" if rows[-1]["extrapolated"] else ""))
                    if ttt
                    else "-",
                    f"{ttt.total / 60:.3f}" if ttt else "-",
                ]
            )
    print(
        f"{model.name} on {cluster.name}{' + SHARP' if cluster.sharp else ''}: "
        f"{train.local_batch:g} samples/GPU, "
        f"{model.params / 1e6:.0f}M params, {model.grad_bytes} B grads in {train.bucket_mb:g} MB "
        "buckets, "
        f"optimizer {train.optimizer}, "
        + (
            f"{train.samples_per_s:g} samples/s/device"
            if train.samples_per_s
            else f"MFU {train.mfu:.0%}"
        )
        + (f", {samples:.3g} samples to converge at every batch" if samples else "")
        + (f", samples to converge: {curve.describe()}" if curve else "")
        + (
            f"; per step: {'CUDA graph' if train.cuda_graphs else 'eager'}, host "
            f"{train.host_s * 1e3:.2f} ms"
            + ("" if train.cuda_graphs else f", launch {train.launch_s * 1e3:.1f} ms")
            + f" ({args.overhead})"
        )
    )
    print(
        format_table(
            [
                "GPUs",
                "nodes",
                "algorithm",
                "step ms",
                "compute ms",
                "optimizer ms",
                "exposed comm ms",
                "host ms",
                "efficiency",
                "samples/s",
                "opt state MiB/GPU",
                "samples M",
                "TTT min",
            ],
            table,
        )
    )
    if any(r["extrapolated"] for r in rows):
        print("* above the largest batch of the curve: its last segment extrapolated")
    from scaleout.sim.goodput import predict  # deferred: as step above

    top = max(gpus) // cluster.gpus_per_node
    good = predict(top, args.mtbf_h, args.save_stall_s, args.restart_s, args.interval_s)
    print(
        f"goodput at {max(gpus)} GPUs ({top} nodes): {good.goodput:.1%} (job MTBF "
        f"{good.job_mtbf_s / 3600:.2f} h from {args.mtbf_h:g} h per node, a save every "
        f"{good.interval_s:.0f} s{'' if args.interval_s else ' (Young/Daly)'} stalling "
        f"{args.save_stall_s:g} s, {args.restart_s:g} s per restart)"
    )
    _write(
        args.out,
        {
            "action": "scale",
            "goodput": good.to_dict(),
            "cluster": cluster.summary(),
            "model": asdict(model),
            "train": asdict(train),
            "config": args.config,
            "convergence": curve.describe() if curve else None,
            "rows": rows,
        },
    )
    if args.png:
        _plot_scale(
            rows,
            algs,
            args.png,
            f"{model.name} on {cluster.name}, {train.local_batch:g}/GPU, {train.optimizer}",
        )
    return 0


def _plot_scale(rows: list[dict[str, Any]], algs: list[str], path: str, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for alg in algs:
        pts = [r for r in rows if r["algorithm"] == alg]
        a1.plot(
            [r["gpus"] for r in pts], [100 * r["efficiency"] for r in pts], marker="o", label=alg
        )
        a2.plot([r["gpus"] for r in pts], [1e3 * r["exposed"] for r in pts], marker="o", label=alg)
    for ax, ylab in ((a1, "scaling efficiency %"), (a2, "exposed communication ms / step")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel(ylab)
        ax.grid(True, alpha=0.3)
    a2.set_yscale("symlog", linthresh=1)
    a2.set_ylim(bottom=0)
    a1.set_ylim(0, 105)
    a1.legend()
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def run_allreduce(args: argparse.Namespace) -> int:
    from scaleout.argtypes import parse_csv
    from scaleout.sim.collectives import allreduce_cost

    cluster = _cluster(args)
    sizes = [mb * 2**20 for mb in parse_csv(args.sizes_mb, "--sizes-mb", float, at_least=0)]
    table = []
    for n in sizes:
        base = None
        for alg in _algorithms(args.algorithms):
            c = allreduce_cost(alg, cluster, args.nodes, n, torus_x=_torus_x(args.torus_x))
            base = base or c.time
            table.append(
                [
                    f"{n / 2**20:g} MiB",
                    alg,
                    c.time * 1e3,
                    c.busbw / 1e9,
                    c.latency * 1e3,
                    c.bandwidth * 1e3,
                    f"{base / c.time:.2f}x",
                ]
            )
    print(f"{cluster.name}: {args.nodes} nodes x {cluster.gpus_per_node} ranks")
    print(
        format_table(
            [
                "size",
                "algorithm",
                "time ms",
                "busbw GB/s",
                "latency ms",
                "bandwidth ms",
                "speedup vs first",
            ],
            table,
        )
    )
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    from scaleout.argtypes import parse_size
    from scaleout.sim.calibrate import cross_validate, load_samples, split_default

    samples = load_samples(args.bench_json, args.stat, parse_size(args.min_bytes, "--min-bytes"))
    holdout = _algorithms(args.holdout, "--holdout") if args.holdout else []
    fit, checks = cross_validate(samples, split_default(samples, holdout, args.every))
    print(
        f"fitted on {sum(c.trained_on for c in checks)} of {len(checks)} rows "
        "(held out: every size not in each "
        f"{args.every}-th{', algorithms ' + ', '.join(holdout) if holdout else ''})"
    )
    print(format_table(["constant", "value"], list(fit.constants.describe().items())))
    table = [
        [
            c.sample.algorithm,
            c.sample.nbytes,
            f"{c.sample.nnodes}x{c.sample.nproc_per_node}",
            c.sample.time_s * 1e3,
            c.predicted * 1e3,
            f"{c.error:+.1%}",
            "fit" if c.trained_on else "held out",
        ]
        for c in checks
    ]
    print(
        format_table(
            ["algorithm", "bytes", "shape", "measured ms", "predicted ms", "error", "role"], table
        )
    )
    held = [abs(c.error) for c in checks if not c.trained_on]
    worst = max(held) if held else 0.0
    print(f"held-out rows: {len(held)}, max |error| {worst:.1%} (tolerance {args.tolerance:.0%})")
    _write(
        args.out,
        {
            "action": "calibrate",
            "source": args.bench_json,
            "constants": fit.constants.vector(),
            "constants_readable": fit.constants.describe(),
            "max_heldout_error": worst,
            "rows": [
                {
                    **c.sample.__dict__,
                    "predicted_s": c.predicted,
                    "error": c.error,
                    "trained_on": c.trained_on,
                }
                for c in checks
            ],
        },
    )
    return 0 if worst <= args.tolerance else 1


def run_validate(args: argparse.Namespace) -> int:
    from scaleout.sim.validate import all_validations, bert_ablation, horovod_542, mlperf_bert

    vals = all_validations()
    table = [
        [
            v.key,
            v.what,
            f"{v.predicted:.4g} {v.unit}",
            f"{v.reference:g} {v.unit}",
            f"{v.error:+.1%}",
            "-" if v.tolerance is None else f"±{v.tolerance:.0%}",
            v.status,
        ]
        for v in vals
    ]
    print(
        format_table(["", "check", "predicted", "published", "error", "tolerance", "result"], table)
    )
    for v in vals:
        if v.details:
            print(f"({v.key}) " + ", ".join(f"{k} {x:.4g}" for k, x in v.details.items()))
    sens = {m: mlperf_bert(mfu=m).predicted for m in (0.3, 0.5)}
    print(
        "(c) sensitivity to the assumed MFU: "
        + ", ".join(f"{m:.0%} -> {t:.3f} min" for m, t in sens.items())
    )
    ablation = bert_ablation()
    print(
        "(c) error by modelled feature: " + ", ".join(f"{k}: {e:+.1%}" for k, e in ablation.items())
    )
    _, _, hvd = horovod_542()
    print("(d) what carries the gap: " + ", ".join(f"{k}: {x:.1f} %" for k, x in hvd.items()))
    seen = set()
    for v in vals:
        if v.key in seen:
            continue
        seen.add(v.key)
        print(
            f"\nassumptions ({v.key}):\n" + "\n".join(f"  - {a}" for a in v.assumptions + v.sources)
        )
    _write(
        args.out,
        {
            "action": "validate",
            "checks": [
                {**asdict(v), "error": v.error, "ok": v.ok, "status": v.status} for v in vals
            ],
            "bert_mfu_sensitivity_min": sens,
            "bert_feature_ablation": ablation,
            "horovod_ablation_pct": hvd,
        },
    )
    return 0 if all(v.status != "FAIL" for v in vals) else 1


def run_convergence(args: argparse.Namespace) -> int:
    from scaleout.argtypes import parse_csv
    from scaleout.sim.convergence import (
        DEFAULT_RULESET,
        MODEL_BENCHMARK,
        curve_for,
        fit_table,
        load_rcps,
    )

    ruleset = args.rcp_ruleset or DEFAULT_RULESET
    curve = curve_for(args.model, args.source, ruleset)
    print(curve.describe())
    if curve.e_min is None:
        kept = {b for b, _ in curve.points}
        rows = [
            [
                r.name,
                r.batch,
                len(r.runs),
                f"{r.mean / 1e6:.4g}",
                "kept" if r.batch in kept else "pruned",
            ]
            for r in load_rcps(MODEL_BENCHMARK[args.model], ruleset)
        ]
        print(format_table(["RCP", "batch", "runs", "olympic mean M samples", "curve"], rows))
    else:
        for note in curve.notes:
            print(note)
        print(format_table(["batch", "measured samples", "fitted", "error"], fit_table(curve)))
    lo, hi = curve.points[0][0], curve.points[-1][0]
    batches = (
        parse_csv(args.batches, "--batches", float, at_least=1)
        if args.batches
        else sorted({lo, hi, *(2.0**k for k in range(20) if lo < 2.0**k < hi)})
    )
    print(
        format_table(
            ["global batch", "samples to converge", "steps", ""],
            [
                [
                    f"{b:g}",
                    f"{curve.samples(b):.4g}",
                    f"{curve.samples(b) / b:.1f}",
                    "extrapolated" if curve.extrapolated(b) else "",
                ]
                for b in batches
            ],
        )
    )
    if args.png:
        _plot_curve(curve, batches, args.png)
    return 0


def _plot_curve(curve: Any, batches: list[float], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    lo = min(min(batches), curve.points[0][0])
    hi = max(max(batches), curve.points[-1][0])
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [curve.samples(x) for x in xs], label=curve.describe()[:80])
    ax.plot([b for b, _ in curve.points], [s for _, s in curve.points], "o", label="points")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global batch")
    ax.set_ylabel("samples to converge")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def run_presets(args: argparse.Namespace) -> int:
    from scaleout.sim.cluster import PRESETS
    from scaleout.sim.step import MODELS

    rows = []
    for c in PRESETS.values():
        d = c.constants.describe()
        rows.append(
            [
                c.name,
                c.gpus_per_node,
                c.nics_per_node,
                d["beta_intra"],
                d["beta_inter"],
                d["alpha_intra"],
                d["alpha_inter"],
                d["alpha_sharp"],
                c.backend,
                c.description,
            ]
        )
    print(
        format_table(
            [
                "cluster",
                "GPUs/node",
                "NICs",
                "intra",
                "inter",
                "intra step",
                "net step",
                "SHARP (--sharp)",
                "backend",
                "description",
            ],
            rows,
        )
    )
    print()
    print(
        format_table(
            ["model", "params", "GFLOP/sample", "grad bytes", "samples to converge", "notes"],
            [
                [
                    m.name,
                    f"{m.params / 1e6:.1f}M",
                    m.flops_per_sample / 1e9,
                    m.grad_bytes,
                    f"{m.samples_to_converge:.3g}" if m.samples_to_converge else "-",
                    m.notes,
                ]
                for m in MODELS.values()
            ],
        )
    )
    return 0


def run_mlperf_log(args: argparse.Namespace) -> int:
    from scaleout.sim.mlperf import summarize_results

    s = summarize_results(args.paths)
    print(
        f"{s.runs} successful runs, global batch {s.global_batch}: median {s.steps:.1f} steps, "
        f"{s.evals:g} evaluations, {s.per_step_ms:.2f} ms per step; score {s.ttt_min:.4f} min"
    )
    return 0


def run(args: argparse.Namespace) -> int:
    actions = {
        "scale": run_scale,
        "allreduce": run_allreduce,
        "calibrate": run_calibrate,
        "validate": run_validate,
        "convergence": run_convergence,
        "presets": run_presets,
        "mlperf-log": run_mlperf_log,
    }
    if not getattr(args, "action", None):
        args._sim_parser.print_help()
        return 2
    return actions[args.action](args)
