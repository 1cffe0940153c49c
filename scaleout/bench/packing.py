"""scaleout bench packing: real-token throughput of the same small BERT, packed vs padded, on CPU."""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "packing"
HELP = "BERT real (non-pad) tokens/s, packed (<=3 per row, LPHP) vs padded to max_len, same model, one run"
DEFAULT_HIST = Path(__file__).resolve().parents[3] / "shared" / "data" / "wikipedia_seqlen_hist_512.txt"
DESCRIPTION = f"""\
Draws --sequences lengths from a sequence-length histogram (default: the Wikipedia-512 one,
{DEFAULT_HIST}), builds synthetic BERT examples of those lengths (15 % MLM masking, NSP labels), packs
them (--algorithm, default lphp, <= --max-per-pack per row) and times forward + backward of the same
small BERT on --rows-row batches, packed and padded (one sequence per row, padded to --max-len),
each packed batch timed right
after (or before) a padded one so machine noise hits both alike. Reports real (non-pad) tokens per second and the ratio
packed / padded; the ceiling is the histogram's speed-up ceiling (2.0013 for Wikipedia-512).

examples:
  scaleout bench packing
  scaleout bench packing --hidden 256 --layers 4 --heads 4 --batches 4 --repeats 5
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hist", default=str(DEFAULT_HIST), help="sequence-length histogram file")
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--max-per-pack", type=int, default=3)
    p.add_argument("--algorithm", default="lphp", help="packing algorithm (default lphp)")
    p.add_argument("--sequences", type=int, default=4000, help="sequences drawn and packed (default 4000)")
    p.add_argument("--rows", type=int, default=4, help="rows of max_len tokens per batch (default 4)")
    p.add_argument("--batches", type=int, default=3, help="batches timed per mode and repeat (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="repeats; the median throughput is reported")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--out", default="bench-results/packing.json")
    p.add_argument("--png", default="bench-results/packing.png", help="bar chart ('' = none; needs matplotlib)")


def run(args: argparse.Namespace) -> int:
    import statistics
    import time

    import numpy as np
    import torch

    from scaleout.bench.common import format_table, write_json
    from scaleout.config.schema import BertConfig
    from scaleout.data.bert_batch import build_batch, padded_packs, sample_lengths, synthetic_sequences
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
    padded = padded_packs(len(seqs))
    need = args.rows * args.batches
    if len(packs) < need:
        raise UserError(f"{len(packs)} packs < --rows x --batches = {need}: raise --sequences")
    cfg = BertConfig(vocab_size=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                     intermediate=args.intermediate, max_position=args.max_len, dropout=0.1, unpad_mlm_head=True)
    torch.manual_seed(args.seed)
    model = BertForPreTraining(cfg).train()
    rng = np.random.default_rng(args.seed + 1)
    modes = {"padded": padded, "packed": packs}
    batches = {}
    for mode, rows in modes.items():
        pick = rng.choice(len(rows), size=need, replace=False)
        chosen = [rows[i] for i in pick]
        batches[mode] = [build_batch(seqs, chosen[b * args.rows:(b + 1) * args.rows], args.max_len,
                                     max_per_pack=args.max_per_pack)
                         for b in range(args.batches)]

    def step(batch) -> None:
        model.zero_grad(set_to_none=True)
        model(batch).loss.backward()

    step(batches["padded"][0])  # warm-up (allocator, kernels)
    step(batches["packed"][0])
    tput: dict[str, list[float]] = {m: [] for m in modes}
    secs: dict[str, list[float]] = {m: [] for m in modes}
    ratios: list[float] = []  # per pair of batches timed back to back: noise hits both alike
    real = {m: [int((b["seq_ids"] > 0).sum()) for b in batches[m]] for m in modes}
    seqs_in = {m: int(sum((b["nsp_labels"] != -100).sum() for b in batches[m])) for m in modes}
    for r in range(args.repeats):
        for i in range(args.batches):
            t_pair = {}
            for mode in (("padded", "packed") if (r + i) % 2 == 0 else ("packed", "padded")):
                t = time.perf_counter()
                step(batches[mode][i])
                t_pair[mode] = time.perf_counter() - t
                secs[mode].append(t_pair[mode])
                tput[mode].append(real[mode][i] / t_pair[mode])
            ratios.append(tput["packed"][-1] / tput["padded"][-1])
        print(f"  repeat {r + 1}/{args.repeats}: padded {statistics.median(tput['padded']):.0f} tok/s, "
              f"packed {statistics.median(tput['packed']):.0f} tok/s", flush=True)
    real = {m: sum(v) for m, v in real.items()}
    med = {m: statistics.median(v) for m, v in tput.items()}
    ratios = [p / q for p, q in zip(tput["packed"], tput["padded"], strict=True)]
    rows = []
    for m in modes:
        toks = args.rows * args.batches * args.max_len
        rows.append([m, args.rows * args.batches, seqs_in[m], f"{real[m] / toks:.4f}",
                     f"{statistics.median(secs[m]):.3f}", f"{med[m]:.0f}", f"{med[m] / med['padded']:.3f}"])
    print(f"BERT hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, rows of {args.max_len}; "
          f"{args.sequences} sequences packed by {strategy.algorithm} (<= {args.max_per_pack}/row): "
          f"efficiency {strategy.efficiency:.4f}, speed-up {strategy.speedup:.4f} "
          f"(ceiling {speedup_ceiling(h):.4f})")
    print(format_table(["mode", "rows", "sequences", "real-token fraction", "s / batch", "real tokens/s",
                        "vs padded"], rows))
    print(f"packed / padded real-token throughput: median {statistics.median(ratios):.3f}x over {len(ratios)} "
          f"back-to-back batch pairs (min {min(ratios):.3f}, max {max(ratios):.3f})")
    payload = {
        "config": {k: v for k, v in vars(args).items() if not k.startswith("_") and not callable(v)},
        "strategy": strategy.stats(),
        "real_tokens": real, "sequences": seqs_in, "tokens_per_s": tput, "seconds_per_batch": secs,
        "median_tokens_per_s": med, "ratio_median": statistics.median(ratios), "ratios": ratios,
        "ceiling": speedup_ceiling(h),
    }
    if p := write_json(args.out, payload):
        print(f"JSON: {p}")
    if args.png:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("(matplotlib not installed: no PNG)")
        else:
            fig, ax = plt.subplots(figsize=(5, 3.5))
            ax.bar(list(med), list(med.values()), color=["#999", "#2a7"])
            ax.set_ylabel("real tokens / s")
            ax.set_title(f"BERT packed vs padded: {statistics.median(ratios):.2f}x")
            Path(args.png).parent.mkdir(parents=True, exist_ok=True)
            fig.tight_layout()
            fig.savefig(args.png, dpi=120)
            print(f"PNG: {args.png}")
    return 0
