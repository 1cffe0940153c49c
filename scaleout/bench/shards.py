"""scaleout bench shards: peak host memory per rank vs the number of MLPerf BERT shards, lazy vs
eager."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scaleout.argtypes import parse_csv
from scaleout.bench._harness import add_standard_arguments, emit

NAME = "shards"
HELP = (
    "peak RSS per rank training on 2 vs 8 MLPerf HDF5 shards (lazy reader), with the eager load "
    "as baseline"
)
DESCRIPTION = """\
Writes --shards sets (default 2 and 8) of MLPerf BERT HDF5 shards of the same size (--rows-per-shard
sequences each, lengths drawn from the Wikipedia-512 histogram, synthetic tokens) and, for each set:

  lazy   a real `scaleout train` run on it (--nproc ranks, --steps steps, packed with --packing):
  the
         trainer's report.json field peak_rss_mib_per_rank_max (ru_maxrss all-reduced MAX over
         ranks);
  eager  the baseline, what every rank did before: load_shards() of the whole set in one process,
  its
         ru_maxrss.

The bar (docs/training-blocks.md): lazy peak RSS with the most shards <= 1.15x with the fewest.

examples:
  scaleout bench shards
  scaleout bench shards --shards 2,8,16 --rows-per-shard 4000 --nproc 2
"""


SMOKE_ARGS = [
    "--shards",
    "1,2",
    "--rows-per-shard",
    "64",
    "--nproc",
    "1",
    "--steps",
    "1",
    "--vocab",
    "128",
]
BAR = 1.15  # lazy peak RSS with the most shards / with the fewest (docs/training-blocks.md)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shards", default="2,8", help="comma list of shard counts (default 2,8)")
    p.add_argument(
        "--rows-per-shard", type=int, default=8000, help="sequences per shard (default 8000)"
    )
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--layout", default="fixed", help="fixed, varlength or packed (default fixed)")
    p.add_argument(
        "--packing", default="lphp", help="data.packing of the training runs (default lphp)"
    )
    p.add_argument("--nproc", type=int, default=2, help="ranks per training run (default 2)")
    p.add_argument("--steps", type=int, default=4, help="training steps per run (default 4)")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument(
        "--hist",
        default=None,
        help="sequence-length histogram (default: Wikipedia-512 beside the "
        "checkout; without one every sequence is --max-len long)",
    )
    p.add_argument(
        "--dir", default=None, help="where to write the shards (default: a temporary directory)"
    )
    p.add_argument("--timeout", type=float, default=1200, help="seconds per training run")
    add_standard_arguments(p, NAME)


def _write_set(root, n: int, rows: int, args: argparse.Namespace, hist) -> None:
    from scaleout.families.bert.data.bert_sources import synthetic_samples
    from scaleout.families.bert.data.make_shards import _packed_rows
    from scaleout.families.bert.data.shard_format import write_shard

    (root / "train").mkdir(parents=True, exist_ok=True)
    (root / "eval").mkdir(parents=True, exist_ok=True)
    for i in range(n):  # shard i has the same content in every set: only the count differs
        path = root / "train" / f"part_{i:05d}_of_{n:05d}.hdf5"
        s = synthetic_samples(rows, args.max_len, args.vocab, 76, seed=1000 + i, length_hist=hist)
        packed = (
            _packed_rows(s, args.max_len, args.packing, 3, i)
            if args.layout == "packed"
            else [[x] for x in s]
        )
        write_shard(path, packed, args.layout, args.max_len, 76)
    ev = synthetic_samples(256, args.max_len, args.vocab, 76, seed=7, length_hist=hist)
    write_shard(
        root / "eval" / "part_eval_256.hdf5",
        [[x] for x in ev],
        "varlength" if args.layout == "packed" else args.layout,
        args.max_len,
        76,
    )


def _lazy(root, args: argparse.Namespace) -> float:
    from scaleout.errors import UserError

    out = root / "run"
    cmd = [
        sys.executable,
        "-m",
        "scaleout",
        "launch",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(args.nproc),
        "--",
        "scaleout",
        "train",
        "bert_tiny_cpu",
        "data.source=wikipedia",
        f"data.path={root}",
        f"data.max_seq_len={args.max_len}",
        "data.max_predictions=76",
        f"data.packing={args.packing}",
        f"model.bert.max_position={args.max_len}",
        f"model.bert.vocab_size={args.vocab}",
        "model.bert.hidden=64",
        "model.bert.intermediate=128",
        f"train.global_batch={4 * args.nproc}",
        f"train.max_steps={args.steps}",
        f"train.eval_every={args.steps}",
        "data.eval_samples=64",
        "train.progress=false",
        "train.target=null",
        f"train.output_dir={out}",
        "checkpoint.dir=null",
        "checkpoint.every_steps=0",
        "optim.total_steps=null",
        "optim.warmup_steps=1",
    ]
    r = subprocess.run(
        cmd, capture_output=True, text=True, timeout=args.timeout, env={**os.environ}
    )
    if r.returncode != 0:
        raise UserError(
            f"training run on {root} failed (exit {r.returncode}): {r.stderr.strip()[-400:]}"
        )
    return float(json.loads((out / "report.json").read_text())["peak_rss_mib_per_rank_max"])


def _eager(root) -> float:
    code = (
        "import resource, sys\nfrom scaleout.families.bert.data.bert_sources import load_shards\n"
        f"s = load_shards({str(root / 'train')!r})\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, len(s))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(r.stdout.split()[0])


def run(args: argparse.Namespace) -> int:
    from scaleout.bench.packing import DEFAULT_HIST
    from scaleout.errors import UserError
    from scaleout.families.bert.packing import load_histogram

    counts = sorted(set(parse_csv(args.shards, "--shards", int, at_least=1)))
    if len(counts) < 2:
        raise UserError(
            f"--shards={args.shards!r}: expected at least two shard counts >= 1, e.g. 2,8"
        )
    if args.rows_per_shard < 64 or args.nproc < 1 or args.steps < 1:
        raise UserError("--rows-per-shard must be >= 64, --nproc and --steps >= 1")
    hist_path = Path(args.hist) if args.hist else DEFAULT_HIST
    hist = load_histogram(hist_path, args.max_len) if args.hist or DEFAULT_HIST.is_file() else None
    print(
        "sequence lengths: "
        f"{hist_path if hist is not None else f'all {args.max_len} (no histogram found)'}"
    )
    tmp = tempfile.TemporaryDirectory(prefix="scaleout-shards-") if args.dir is None else None
    try:
        rows = [_one_set(Path(args.dir or tmp.name) / f"shards-{n}", n, args, hist) for n in counts]
    finally:
        if tmp is not None:
            tmp.cleanup()
    ratio = rows[-1]["lazy_peak_rss_mib"] / rows[0]["lazy_peak_rss_mib"]
    eager_ratio = rows[-1]["eager_peak_rss_mib"] / rows[0]["eager_peak_rss_mib"]
    verdict = "PASS" if ratio <= BAR else "FAIL"
    emit(
        args,
        NAME,
        ["shards", "sequences", "data MiB", "lazy peak RSS/rank MiB", "eager (baseline) MiB"],
        [
            [
                r["shards"],
                r["sequences"],
                f"{r['data_mib']:.0f}",
                f"{r['lazy_peak_rss_mib']:.0f}",
                f"{r['eager_peak_rss_mib']:.0f}",
            ]
            for r in rows
        ],
        {
            "config": {
                k: v for k, v in vars(args).items() if not k.startswith("_") and not callable(v)
            },
            "rows": rows,
            "lazy_ratio": ratio,
            "eager_ratio": eager_ratio,
            "bar": BAR,
            "pass": ratio <= BAR,
        },
        notes=[
            f"lazy {counts[-1]} vs {counts[0]} shards: {ratio:.3f}x (bar <= {BAR}x: {verdict}); "
            f"eager baseline {eager_ratio:.2f}x"
        ],
    )
    return 0 if ratio <= BAR else 1


def _one_set(root: Path, n: int, args: argparse.Namespace, hist: Any) -> dict[str, Any]:
    """Write ``n`` shards, train on them lazily, load them eagerly: the peak memory of each."""

    t = time.perf_counter()
    _write_set(root, n, args.rows_per_shard, args, hist)
    wrote = time.perf_counter() - t
    lazy, eager = _lazy(root, args), _eager(root)
    size = sum(f.stat().st_size for f in (root / "train").glob("*.hdf5")) / 2**20
    print(f"  {n} shards: lazy {lazy:.0f} MiB per rank, eager {eager:.0f} MiB", flush=True)
    return {
        "shards": n,
        "sequences": n * args.rows_per_shard,
        "data_mib": size,
        "lazy_peak_rss_mib": lazy,
        "eager_peak_rss_mib": eager,
        "write_s": wrote,
    }
