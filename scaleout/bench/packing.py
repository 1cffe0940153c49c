"""scaleout bench packing: real-token throughput of the same small BERT, packed vs padded, on CPU."""

from __future__ import annotations

import argparse
from pathlib import Path

from scaleout.bench.common import pyplot
from scaleout.resources import package_path

NAME = "packing"
HELP = "BERT real (non-pad) tokens/s, packed (<=3 per row, LPHP) vs padded to max_len, same model, one run"
# Graphcore's Wikipedia-512 histogram (provenance in the file's header), shipped as package data
DEFAULT_HIST = package_path("scaleout", "data", "wikipedia_seqlen_hist_512.txt")
DESCRIPTION = f"""\
Draws --sequences lengths from a sequence-length histogram (default: the Wikipedia-512 one,
{DEFAULT_HIST}), builds synthetic BERT examples of those lengths (15 % MLM masking, NSP labels) and
packs them (--algorithm, default lphp, <= --max-per-pack per row). It then takes --rows x --batches
packs (a systematic sample, so they have the whole packing's mix) and times forward + backward of the same small BERT over them twice: packed, and the
same sequences one per row padded to --max-len; the two kinds of batches are interleaved so machine
noise hits both alike. Reports real (non-pad) tokens per second (wall and, with --threads 1, per CPU
second of the one compute thread) and the ratio packed / padded; the ceiling is the histogram's
speed-up ceiling (2.0013 for Wikipedia-512).

examples:
  scaleout bench packing
  scaleout bench packing --hidden 256 --layers 4 --heads 4 --batches 4 --repeats 5
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hist", default=str(DEFAULT_HIST), help="sequence-length histogram file")
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--max-per-pack", type=int, default=3)
    p.add_argument("--algorithm", default="lphp", help="packing algorithm (default lphp)")
    p.add_argument("--sequences", type=int, default=20000, help="sequences drawn and packed (default 20000)")
    p.add_argument("--rows", type=int, default=4, help="rows of max_len tokens per batch (default 4)")
    p.add_argument("--batches", type=int, default=6,
                   help="packed batches per repeat (default 6); the padded run covers the same sequences")
    p.add_argument("--repeats", type=int, default=5, help="repeats; the median throughput is reported (default 5)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--vocab", type=int, default=1024,
                   help="vocabulary (default 1024: the MLM head costs the same per real token packed or padded, so a "
                        "30522-word head on a 128-wide model would hide what packing saves; see docs/packing.md)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: the step's CPU time is then this thread's time, which other "
                        "jobs on a shared machine barely disturb; 0 = torch's default)")
    p.add_argument("--out", default="bench-results/packing.json")
    p.add_argument("--png", default="bench-results/packing.png", help="bar chart ('' = none; needs matplotlib)")


def run(args: argparse.Namespace) -> int:
    import statistics
    import time

    import numpy as np
    import torch

    from scaleout.bench.common import format_table, write_json
    from scaleout.config.schema import BertConfig
    from scaleout.data.bert_batch import build_batch, sample_lengths, synthetic_sequences
    from scaleout.data.packing import (
        assign_sequences,
        histogram_from_lengths,
        load_histogram,
        pack_histogram,
        speedup_ceiling,
    )
    from scaleout.errors import UserError
    from scaleout.models.bert import BertForPreTraining

    for k in ("sequences", "rows", "batches", "repeats"):
        if getattr(args, k) < 1:
            raise UserError(f"--{k}={getattr(args, k)} must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    h = load_histogram(args.hist, args.max_len)
    lengths = sample_lengths(h, args.sequences, seed=args.seed)
    seqs = synthetic_sequences(lengths, args.vocab, seed=args.seed)
    strategy = pack_histogram(histogram_from_lengths(lengths, args.max_len), args.max_len, args.max_per_pack,
                              args.algorithm)
    packs = assign_sequences(strategy, lengths, seed=args.seed).packs()
    need = args.rows * args.batches
    if len(packs) < need:
        raise UserError(f"{len(packs)} packs < --rows x --batches = {need}: raise --sequences")
    cfg = BertConfig(vocab_size=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                     intermediate=args.intermediate, max_position=args.max_len, dropout=0.1, unpad_mlm_head=True)
    torch.manual_seed(args.seed)
    model = BertForPreTraining(cfg).train()
    # The same sequences both ways: --rows x --batches packs, and their sequences one per row. The packs
    # are a systematic sample (every k-th in depth/length order) so that a few dozen rows have the mix of
    # the whole packing; a plain random draw of 24 packs swung the ratio between 1.9 and 2.3.
    order = sorted(range(len(packs)), key=lambda i: (len(packs[i]), sum(int(lengths[j]) for j in packs[i])))
    stride = len(packs) // need
    start = int(np.random.default_rng(args.seed + 1).integers(stride))
    chosen = [packs[i] for i in order[start::stride][:need]]
    np.random.default_rng(args.seed + 2).shuffle(chosen)
    rows_of = {"packed": chosen, "padded": [[i] for p in chosen for i in p]}
    batches = {m: [build_batch(seqs, r[b:b + args.rows], args.max_len, max_per_pack=args.max_per_pack)
                   for b in range(0, len(r), args.rows)] for m, r in rows_of.items()}
    # interleave: each packed batch runs between the padded batches holding (about) its sequences
    per = len(batches["padded"]) / len(batches["packed"])
    schedule = sorted([(i, "packed", i) for i in range(len(batches["packed"]))]
                      + [(j / per, "padded", j) for j in range(len(batches["padded"]))])

    def step(batch) -> None:
        model.zero_grad(set_to_none=True)
        model(batch).loss.backward()

    step(batches["padded"][0])  # warm-up (allocator, kernels)
    step(batches["packed"][0])
    real = int(sum((b["seq_ids"] > 0).sum() for b in batches["packed"]))
    wall: dict[str, list[float]] = {"padded": [], "packed": []}
    cpu: dict[str, list[float]] = {"padded": [], "packed": []}
    for r in range(args.repeats):
        w_tot, c_tot = {"padded": 0.0, "packed": 0.0}, {"padded": 0.0, "packed": 0.0}
        for _, mode, j in (schedule if r % 2 == 0 else schedule[::-1]):
            t, c = time.perf_counter(), time.thread_time()
            step(batches[mode][j])
            w_tot[mode] += time.perf_counter() - t
            c_tot[mode] += time.thread_time() - c
        for m in wall:
            wall[m].append(w_tot[m])
            cpu[m].append(c_tot[m])
        print(f"  repeat {r + 1}/{args.repeats}: padded {real / w_tot['padded']:.0f} tok/s, packed "
              f"{real / w_tot['packed']:.0f} tok/s (cpu: {real / c_tot['padded']:.0f} / {real / c_tot['packed']:.0f})",
              flush=True)
    ratios = [p / q for p, q in zip(wall["padded"], wall["packed"], strict=True)]
    cpu_ratios = [p / q for p, q in zip(cpu["padded"], cpu["packed"], strict=True)]
    med = {m: real / statistics.median(v) for m, v in wall.items()}
    cpu_med = {m: real / statistics.median(v) for m, v in cpu.items()}
    rows = []
    for m in ("padded", "packed"):
        n_rows = len(rows_of[m])
        rows.append([m, n_rows, len(rows_of["padded"]), f"{real / (n_rows * args.max_len):.4f}",
                     f"{statistics.median(wall[m]):.2f}", f"{med[m]:.0f}", f"{med[m] / med['padded']:.3f}",
                     f"{cpu_med[m]:.0f}", f"{cpu_med[m] / cpu_med['padded']:.3f}"])
    print(f"BERT hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, rows of {args.max_len}; "
          f"{args.sequences} sequences packed by {strategy.algorithm} (<= {args.max_per_pack}/row): "
          f"efficiency {strategy.efficiency:.4f}, speed-up {strategy.speedup:.4f} "
          f"(ceiling {speedup_ceiling(h):.4f})")
    print(f"torch threads: {torch.get_num_threads()}")
    print(format_table(["mode", "rows", "sequences", "real-token fraction", "wall s (all rows)", "real tokens/s (wall)",
                        "vs padded", "real tokens/cpu-s", "vs padded (cpu)"], rows))
    print(f"packed / padded real-token throughput over {len(ratios)} repeats: median "
          f"{statistics.median(cpu_ratios):.3f}x by CPU time (min {min(cpu_ratios):.3f}, max {max(cpu_ratios):.3f}), "
          f"{statistics.median(ratios):.3f}x by wall time (min {min(ratios):.3f}, max {max(ratios):.3f})")
    payload = {
        "config": {k: v for k, v in vars(args).items() if not k.startswith("_") and not callable(v)},
        "strategy": strategy.stats(),
        "real_tokens": real, "rows": {m: len(r) for m, r in rows_of.items()}, "wall_s": wall, "cpu_s": cpu,
        "median_tokens_per_s": med, "ratio_median": statistics.median(ratios), "ratios": ratios,
        "median_cpu_tokens_per_s": cpu_med,
        "cpu_ratio_median": statistics.median(cpu_ratios), "cpu_ratios": cpu_ratios,
        "ceiling": speedup_ceiling(h),
    }
    if p := write_json(args.out, payload):
        print(f"JSON: {p}")
    if args.png:
        plt = pyplot()
        if plt is not None:
            fig, ax = plt.subplots(figsize=(5, 3.5))
            ax.bar(list(cpu_med), list(cpu_med.values()), color=["#999", "#2a7"])
            ax.set_ylabel("real tokens / CPU-second")
            ax.set_title(f"BERT packed vs padded: {statistics.median(cpu_ratios):.2f}x (CPU time)")
            Path(args.png).parent.mkdir(parents=True, exist_ok=True)
            fig.tight_layout()
            fig.savefig(args.png, dpi=120)
            print(f"PNG: {args.png}")
    return 0
