"""scaleout simulate: the alpha-beta-gamma cost model (scaleout.sim) from 8 to thousands of GPUs."""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

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
             `scaleout bench largebatch` runs: sim.convergence; a fixed per-step host cost:
             sim.overhead, sim.cuda_graphs)
  convergence  samples to converge vs global batch: the RCP table (or the fit to a bench
             largebatch JSON) and the curve at chosen batches
  allreduce  predicted time / busbw of one all-reduce per algorithm and message size
  calibrate  fit the constants to `scaleout bench allreduce` JSON; report held-out prediction error
  validate   predictions vs published numbers (nccl-tests, MLPerf BERT v2.0-v3.1 and the
             1024 -> 4096 A100 speed-up, Horovod #542)
  presets    list the cluster and model presets
  mlperf-log steps, time per step and score of MLPerf result_*.txt files (how validate's numbers
             were read)

The cluster is a preset (--preset) whose parameters cluster.<key>=value replace (cluster.nics=1,
cluster.inter_gbit=100, cluster.sharp=true); the model and step are a preset (--model) or a training
config (--config) whose numbers sim.<key>=value replace (sim.local_batch=4, sim.bucket_mb=4); any
other section.key=value overrides the config as in `scaleout train`. `scaleout simulate scale
--help` lists every key. Optimizer placement (sim.optimizer): replicated (all-reduce, LAMB on every
parameter), sharded (ZeRO-1 over all ranks: reduce-scatter, LAMB on 1/p, all-gather;
optim.sharded=true), sharded-node (apex DistributedFusedLAMB: sharded within each node).
cluster.sharp=true: in-network reduction between nodes (SHARP via NCCL CollNet) for
tree/hierarchical/torus2d, on InfiniBand presets.

examples:
  scaleout simulate scale --config configs/bert_large_256x8.yaml cluster.sharp=true
  scaleout simulate scale --config configs/bert_large_256x8.yaml --min-gpus 2048 optim.sharded=true
  scaleout simulate scale --preset dgx-a100 --model bert-large sim.local_batch=4 --png sim.png
  scaleout simulate scale --preset dgx-h100 --model resnet50 sim.local_batch=256 --max-gpus 8192
  scaleout simulate scale --preset dgx-a100 cluster.inter_gbit=100 cluster.nics=1 \\
      --algorithms flat,hierarchical
  scaleout simulate allreduce --preset dgx-a100 --nnodes 1 --sizes-mb 1,64,1024
  scaleout simulate calibrate bench-results/allreduce.json --holdout torus2d --min-bytes 1MiB
  scaleout simulate scale --model bert-large sim.convergence=bench-results/largebatch.json
  scaleout simulate convergence rcp --model resnet50 --batches 1024,4096,32768
  scaleout simulate validate --out bench-results/sim-validate.json
  scaleout simulate mlperf-log \\
      training_results_v2.0/NVIDIA/results/dgxa100_n512_ngc22.04_pytorch/bert
"""


def _keys_help(sections: dict[str, dict[str, Any]]) -> str:
    from scaleout.cli._keys import describe

    return "settings, as key=value after the action (parsed as `scaleout train`'s overrides):\n" + (
        describe(sections)
    )


def _preset_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset",
        default="dgx-a100",
        help="cluster preset (see `scaleout simulate presets`) or a `scaleout simulate calibrate "
        "--out` JSON (default dgx-a100); cluster.<key>=value replaces one of its parameters",
    )


def _formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.RawDescriptionHelpFormatter(prog)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from scaleout.argtypes import bounded
    from scaleout.cli._keys import ALLREDUCE_KEYS, CLUSTER_KEYS, SCALE_KEYS, overrides_anywhere
    from scaleout.section import MAX_WORLD

    sub = p.add_subparsers(dest="action", metavar="<action>")
    sc = sub.add_parser(
        "scale",
        help="training-step scaling sweep and time to train",
        formatter_class=_formatter,
        description="Step time, exposed communication, efficiency and time to train per GPU count\n"
        "and algorithm. Values come from the key=value settings, else from --config, else the\n"
        "presets' and the defaults.\n\n" + _keys_help({"cluster": CLUSTER_KEYS, "sim": SCALE_KEYS}),
    )
    overrides_anywhere(sc)
    _preset_arg(sc)
    sc.add_argument(
        "--config",
        default=None,
        help="training config (YAML or name, as for `scaleout train`): model size, per-GPU batch, "
        "optim.sharded, comm.*, samples and the config's node count (added to the sweep)",
    )
    sc.add_argument(
        "overrides",
        nargs="*",
        help="cluster.<key>=value and sim.<key>=value settings (listed above); any other "
        "section.key=value overrides --config, e.g. optim.sharded=true",
    )
    sc.add_argument(
        "--model", default=None, help="model preset (default bert-large, or the config's model)"
    )
    sc.add_argument(
        "--algorithms",
        default=None,
        help=f"all-reduce algorithms, comma list (default: {ALL_ALGORITHMS})",
    )
    sc.add_argument(
        "--min-gpus",
        type=bounded(int, 1, MAX_WORLD),
        default=None,
        help="first GPU count (default one node)",
    )
    sc.add_argument(
        "--max-gpus",
        type=bounded(int, 1, MAX_WORLD),
        default=4096,
        help="last GPU count (default 4096)",
    )
    sc.add_argument("--out", default=None, help="write the results as JSON here (default: none)")
    sc.add_argument(
        "--png", default=None, help="PNG of efficiency and exposed communication vs GPUs"
    )

    ar = sub.add_parser(
        "allreduce",
        help="one all-reduce: time and busbw per algorithm and size",
        formatter_class=_formatter,
        description="Predicted time and busbw of one all-reduce per algorithm and message size.\n\n"
        + _keys_help({"cluster": CLUSTER_KEYS, "sim": ALLREDUCE_KEYS}),
    )
    overrides_anywhere(ar)
    _preset_arg(ar)
    ar.add_argument(
        "overrides", nargs="*", help="cluster.<key>=value and sim.torus_x=value settings"
    )
    ar.add_argument(
        "--nnodes", type=bounded(int, 1, MAX_WORLD), default=1, help="number of nodes (default 1)"
    )
    ar.add_argument(
        "--sizes-mb", default="1,16,256,4096", help="message sizes in MiB per rank (comma list)"
    )
    ar.add_argument(
        "--algorithms",
        default=None,
        help=f"all-reduce algorithms, comma list (default: {ALL_ALGORITHMS})",
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
        "--every",
        type=bounded(int, 1, MAX_WORLD),
        default=2,
        help="fit on every N-th size, test on the rest (default 2)",
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
        type=bounded(float, 0),
        default=0.20,
        help="exit 1 if a held-out error exceeds this (default 0.20)",
    )
    ca.add_argument("--out", default=None, help="write the results as JSON here (default: none)")

    va = sub.add_parser(
        "validate",
        help="predictions vs published numbers",
        description="The cost model against nccl-tests, five published MLPerf BERT runs "
        "(A100 and H100, 64 to 4096 GPUs; sources in each check; (e) calibrates the per-step host "
        "time), the 1024 -> 4096 A100 speed-up predicted from the global batches (samples to "
        "converge from MLCommons' RCPs) and Horovod #542. Exit 1 if a row is outside its "
        "tolerance.",
    )
    va.add_argument("--out", default=None, help="write the results as JSON here (default: none)")
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


def _settings(args: argparse.Namespace, sim: dict[str, Any]) -> tuple[dict, dict, list[str]]:
    """(cluster.* settings, sim.* settings, the training config's overrides) of the command line."""
    from scaleout.cli._keys import CLUSTER_KEYS, settings

    got, rest = settings(list(args.overrides), {"cluster": CLUSTER_KEYS, "sim": sim})
    return got["cluster"], got["sim"], rest


def _cluster(preset: str, keys: dict[str, Any], gpus_per_node: int | None = None) -> Any:
    from scaleout.sim.cluster import custom_cluster, with_sharp
    from scaleout.sim.plan import load_cluster

    c = custom_cluster(
        load_cluster(preset),
        keys["gpus_per_node"] or gpus_per_node,
        keys["nics"],
        keys["intra_gbs"],
        keys["inter_gbit"],
        keys["intra_lat_us"],
        keys["inter_lat_us"],
    )
    return with_sharp(c, keys["sharp"])


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


def _scale_specs(
    args: argparse.Namespace,
) -> tuple[Any, Any, Any, list[int], list[str], dict[str, Any]]:
    """(cluster, model, train, GPU counts, algorithms, the sim.* settings): the key=value settings
    over --config over the presets and defaults."""

    from scaleout.cli._keys import SCALE_KEYS
    from scaleout.errors import ConfigError
    from scaleout.sim.step import TrainSpec, get_model, gpu_counts

    ckeys, k, overrides = _settings(args, SCALE_KEYS)
    run = None
    if overrides and not args.config:
        raise ConfigError(
            f"overrides {' '.join(overrides)!r} need --config (they change a training config; "
            "the simulator's own settings are cluster.* and sim.*)"
        )
    if args.config:
        from scaleout.config.load import load_config
        from scaleout.sim.convergence import DEFAULT_RULESET, config_curve
        from scaleout.sim.fromconfig import from_config

        # sim.optimizer=sharded/replicated on a config means the product's optimizer, with its
        # wire bytes
        placement = {
            "sharded": ["optim.sharded=true"],
            "replicated": ["optim.sharded=false", "optim.overlap_comm=false", "optim.shard=world"],
        }
        overrides += placement.get(k["optimizer"] or "", [])
        cfg = load_config(args.config, overrides)
        run = from_config(cfg, args.config)
        k = {**k, "config_curve": config_curve(cfg, k["rcp_ruleset"] or DEFAULT_RULESET)}
    if run and ckeys["sharp"] is None and run.sharp:  # the config's comm.sharp, unless set here
        ckeys = {**ckeys, "sharp": True}
    cluster = _cluster(args.preset, ckeys, run.gpus_per_node if run else None)
    model = get_model(args.model or "bert-large") if args.model or not run else run.model
    model = replace(
        model,
        **{
            n: k[n]
            for n in ("params", "flops_per_sample", "grad_bytes", "param_bytes")
            if k[n] is not None
        },
    )
    train = run.train if run else TrainSpec(local_batch=4, torus_x="square")
    given = {
        n: k[n]
        for n in ("local_batch", "mfu", "bucket_mb", "samples_per_s", "optimizer", "overlap")
        if k[n] is not None
    }
    if k["torus_x"] is not None:
        given["torus_x"] = _torus_x(k["torus_x"])
    train = replace(train, **given)
    algs = (
        _algorithms(args.algorithms)
        if args.algorithms
        else ([train.algorithm] if run else _algorithms(None))
    )
    gpus = gpu_counts(cluster, args.max_gpus, args.min_gpus)
    if run and run.nodes * cluster.gpus_per_node not in gpus:
        gpus = sorted(gpus + [run.nodes * cluster.gpus_per_node])
    return cluster, model, train, gpus, algs, k


def _curve(k: dict[str, Any], model_name: str, default: str | None) -> Any:
    from scaleout.sim.convergence import DEFAULT_RULESET, curve_for

    source = k["convergence"] if k["convergence"] is not None else default
    return curve_for(model_name, source, k["rcp_ruleset"] or DEFAULT_RULESET)


def _overhead(k: dict[str, Any], train: Any) -> Any:
    from scaleout.sim.overhead import get_overhead  # deferred: as step above
    from scaleout.sim.step import with_overhead

    graphs = train.cuda_graphs if k["cuda_graphs"] is None else k["cuda_graphs"]
    train = with_overhead(replace(train, cuda_graphs=graphs), get_overhead(k["overhead"]))
    if k["host_ms"] is not None:
        train = replace(train, host_s=k["host_ms"] / 1e3)
    return train


# Where `scaleout plan` on the same config assumes otherwise (docs/plan.md).
PLAN_DIFFERS = (
    "`scaleout plan` differs: samples at each batch from the MLPerf RCPs (here too, with --config "
    "and a train.target; without one, train.max_steps x train.global_batch), the "
    "schedule rescaled to each batch, every optimizer placement and SHARP priced (here the "
    "config's), and the untimed start before run_start counted"
)


def run_scale(args: argparse.Namespace) -> int:
    from scaleout.sim.step import step_time, time_to_train

    cluster, model, train, gpus, algs, k = _scale_specs(args)
    train = _overhead(k, train)
    curve = None if k["samples"] else _curve(k, model.name, "fixed" if args.config else "rcp")
    if args.config and not k["samples"] and k["convergence"] is None:
        # the config's run goes to its target: the samples there, as `scaleout plan` counts them
        curve = k["config_curve"] or curve
    samples = k["samples"] or (None if curve else model.samples_to_converge)
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
            + f" ({k['overhead']})"
        )
    )
    if args.config:
        print("  note: " + PLAN_DIFFERS)
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
    if k["mtbf_h"] is None:  # one default: the schema's
        from scaleout.config.schema import CheckpointConfig

        k["mtbf_h"] = CheckpointConfig.model_fields["mtbf_h"].default
    good = predict(top, k["mtbf_h"], k["save_stall_s"], k["restart_s"], k["interval_s"])
    print(
        f"goodput at {max(gpus)} GPUs ({top} nodes): {good.goodput:.1%} (job MTBF "
        f"{good.job_mtbf_s / 3600:.2f} h from {k['mtbf_h']:g} h per node, a save every "
        f"{good.interval_s:.0f} s{'' if k['interval_s'] else ' (Young/Daly)'} stalling "
        f"{k['save_stall_s']:g} s, {k['restart_s']:g} s per restart)"
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
    from scaleout.cli._keys import ALLREDUCE_KEYS
    from scaleout.errors import ConfigError
    from scaleout.sim.collectives import allreduce_cost

    ckeys, k, rest = _settings(args, ALLREDUCE_KEYS)
    if rest:
        raise ConfigError(
            f"{' '.join(rest)!r}: expected cluster.<key>=value or sim.torus_x=value settings"
        )
    cluster = _cluster(args.preset, ckeys)
    sizes = [mb * 2**20 for mb in parse_csv(args.sizes_mb, "--sizes-mb", float, at_least=0)]
    table = []
    for n in sizes:
        base = None
        for alg in _algorithms(args.algorithms):
            c = allreduce_cost(alg, cluster, args.nnodes, n, torus_x=_torus_x(k["torus_x"]))
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
    print(f"{cluster.name}: {args.nnodes} nodes x {cluster.gpus_per_node} ranks")
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
                "SHARP (cluster.sharp)",
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
