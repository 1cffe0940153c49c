"""scaleout bench packing: real-token throughput of the same small BERT, packed vs padded, on
CPU."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from scaleout.bench._harness import (
    add_config_arguments,
    add_standard_arguments,
    bench_config,
    check_counts,
    compare,
    emit,
    interleave,
    set_threads,
    sum_rounds,
)
from scaleout.errors import UserError
from scaleout.resources import package_path

NAME = "packing"
HELP = (
    "BERT real (non-pad) tokens/s, packed (<=3 per row, LPHP) vs padded to max_len, same model, "
    "one run"
)
# Graphcore's Wikipedia-512 histogram (provenance in the file's header), shipped as package data
DEFAULT_HIST = package_path("scaleout", "data", "wikipedia_seqlen_hist_512.txt")
DESCRIPTION = f"""\
Draws --sequences lengths from a sequence-length histogram (default: the Wikipedia-512 one,
{DEFAULT_HIST}), builds synthetic BERT examples of those lengths (15 % MLM masking, NSP labels) and
packs them (data.packing, default lphp, <= data.max_per_pack per row). It then takes --rows x
--batches packs (a systematic sample, so they have the whole packing's mix) and times forward +
backward of the same small BERT over them twice: packed, and the same sequences one per row padded
to data.max_seq_len (512); the two kinds of batches are interleaved so machine noise hits both
alike. Reports real (non-pad) tokens per second (wall and, with --threads 1, per CPU second of the
one compute thread) and the ratio packed / padded; the ceiling is the histogram's speed-up ceiling
(2.0013 for Wikipedia-512).

examples:
  scaleout bench packing
  scaleout bench packing --batches 4 --repeats 5 \\
      model.bert.hidden=256 model.bert.layers=4 model.bert.heads=4
"""


SMOKE_ARGS = [
    "--sequences",
    "200",
    "--rows",
    "2",
    "--batches",
    "2",
    "--repeats",
    "1",
    "model.bert.hidden=32",
    "model.bert.layers=1",
    "model.bert.heads=2",
    "model.bert.intermediate=64",
    "model.bert.vocab_size=128",
]
# On top of --config (the tiny BERT: hidden 128, 2 layers, 2 heads, intermediate 512); the overrides
# win.
DEFAULTS = [
    "data.max_seq_len=512",  # rows of 512 tokens: the Wikipedia-512 histogram
    "data.packing=lphp",
    "data.max_per_pack=3",
    # the MLM head costs the same per real token packed or padded, so a 30522-word head on a
    # 128-wide model would hide what packing saves (docs/packing.md)
    "model.bert.vocab_size=1024",
    "model.bert.dropout=0.1",
    "model.bert.unpad_mlm_head=true",
    "train.seed=0",  # the lengths, the packs drawn and the weights
]
BENCH_KEYS = ("model.bert.max_position",)  # data.max_seq_len


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hist", default=str(DEFAULT_HIST), help="sequence-length histogram file")
    p.add_argument(
        "--sequences", type=int, default=20000, help="sequences drawn and packed (default 20000)"
    )
    p.add_argument(
        "--rows", type=int, default=4, help="rows of max_len tokens per batch (default 4)"
    )
    p.add_argument(
        "--batches",
        type=int,
        default=6,
        help="packed batches per repeat (default 6); the padded run covers the same sequences",
    )
    add_standard_arguments(p, NAME, repeats=5, png=True, threads=1)
    add_config_arguments(
        p, "bert_tiny_cpu", "the model (model.bert) and packing (data), under DEFAULTS"
    )


def resolve(args: argparse.Namespace) -> Any:
    """--config + DEFAULTS + the overrides (a bad key: one line, before any work)."""
    cfg = bench_config(args, DEFAULTS, BENCH_KEYS)
    if cfg.data.packing in ("none", "auto"):
        raise UserError(
            f"data.packing={cfg.data.packing}: name the algorithm to measure (e.g. lphp)"
        )
    return cfg


def _packs(args: argparse.Namespace, cfg: Any) -> tuple[Any, Any, Any, list[list[int]]]:
    """(histogram, lengths, strategy, the --rows x --batches packs): a systematic sample of the
    packing, so that a few dozen rows have the mix of the whole packing (a plain random draw of
    24 packs swung the ratio between 1.9 and 2.3)."""
    import numpy as np

    from scaleout.families.bert.data.bert_batch import sample_lengths
    from scaleout.families.bert.packing import (
        assign_sequences,
        histogram_from_lengths,
        load_histogram,
        pack_histogram,
    )

    d, seed = cfg.data, cfg.train.seed
    h = load_histogram(args.hist, d.max_seq_len)
    lengths = sample_lengths(h, args.sequences, seed=seed)
    strategy = pack_histogram(
        histogram_from_lengths(lengths, d.max_seq_len), d.max_seq_len, d.max_per_pack, d.packing
    )
    packs = assign_sequences(strategy, lengths, seed=seed).packs()
    need = args.rows * args.batches
    if len(packs) < need:
        raise UserError(f"{len(packs)} packs < --rows x --batches = {need}: raise --sequences")
    order = sorted(
        range(len(packs)), key=lambda i: (len(packs[i]), sum(int(lengths[j]) for j in packs[i]))
    )
    stride = len(packs) // need
    start = int(np.random.default_rng(seed + 1).integers(stride))
    chosen = [packs[i] for i in order[start::stride][:need]]
    np.random.default_rng(seed + 2).shuffle(chosen)
    return h, lengths, strategy, chosen


def _steps(
    args: argparse.Namespace, cfg: Any, lengths: Any, chosen: list[list[int]]
) -> tuple[dict[tuple[str, int], Any], int]:
    """The same sequences both ways, as (mode, batch) -> one training step, in the interleaved
    order: each packed batch between the padded batches holding (about) its sequences. Also: the
    real tokens."""
    import torch

    from scaleout.families.bert.data.bert_batch import build_batch, synthetic_sequences
    from scaleout.families.bert.model import BertForPreTraining

    d, seed = cfg.data, cfg.train.seed
    bert = cfg.model.bert.model_copy(update={"max_position": d.max_seq_len})
    seqs = synthetic_sequences(lengths, bert.vocab_size, seed=seed)
    torch.manual_seed(seed)
    model = BertForPreTraining(bert).train()
    rows_of = {"packed": chosen, "padded": [[i] for p in chosen for i in p]}
    batches = {
        m: [
            build_batch(seqs, r[b : b + args.rows], d.max_seq_len, max_per_pack=d.max_per_pack)
            for b in range(0, len(r), args.rows)
        ]
        for m, r in rows_of.items()
    }

    def step(batch: Any) -> Any:
        def run() -> None:
            model.zero_grad(set_to_none=True)
            model(batch).loss.backward()

        return run

    per = len(batches["padded"]) / len(batches["packed"])
    order = sorted(
        [(i, "packed", i) for i in range(len(batches["packed"]))]
        + [(j / per, "padded", j) for j in range(len(batches["padded"]))]
    )
    step(batches["padded"][0])()  # warm-up (allocator, kernels)
    step(batches["packed"][0])()
    real = int(sum((b["seq_ids"] > 0).sum() for b in batches["packed"]))
    return {(mode, j): step(batches[mode][j]) for _, mode, j in order}, real


def run(args: argparse.Namespace) -> int:
    import torch

    from scaleout.families.bert.packing import speedup_ceiling

    check_counts(args, sequences=1, rows=1, batches=1, repeats=1)
    cfg = resolve(args)
    d, bert = cfg.data, cfg.model.bert
    set_threads(args)
    h, lengths, strategy, chosen = _packs(args, cfg)
    steps, real = _steps(args, cfg, lengths, chosen)
    per_batch = interleave(
        steps, args.repeats
    )  # reversed order on odd rounds, as the drift cancels
    totals = sum_rounds(per_batch, group=lambda key: key[0])
    rows = {r.name: r for r in compare(totals, baseline="padded")}
    n_rows = {"packed": len(chosen), "padded": sum(len(p) for p in chosen)}
    med = {m: real / rows[m].median_s for m in rows}
    cpu_med = {m: real / rows[m].cpu_median_s for m in rows}
    ratios = [
        t_pad.wall / t_pack.wall
        for t_pad, t_pack in zip(totals["padded"], totals["packed"], strict=True)
    ]
    cpu_ratios = [
        t_pad.cpu / t_pack.cpu
        for t_pad, t_pack in zip(totals["padded"], totals["packed"], strict=True)
    ]
    table = [
        [
            m,
            n_rows[m],
            n_rows["padded"],
            f"{real / (n_rows[m] * d.max_seq_len):.4f}",
            f"{rows[m].median_s:.2f}",
            f"{med[m]:.0f}",
            f"{med[m] / med['padded']:.3f}",
            f"{cpu_med[m]:.0f}",
            f"{cpu_med[m] / cpu_med['padded']:.3f}",
        ]
        for m in ("padded", "packed")
    ]
    notes = [
        f"BERT hidden {bert.hidden}, {bert.layers} layers, vocab {bert.vocab_size}, rows of "
        f"{d.max_seq_len}; "
        f"{args.sequences} sequences packed by {strategy.algorithm} (<= {d.max_per_pack}/row): "
        "efficiency "
        f"{strategy.efficiency:.4f}, speed-up {strategy.speedup:.4f} (ceiling "
        f"{speedup_ceiling(h):.4f})",
        f"torch threads: {torch.get_num_threads()}",
        f"packed / padded real-token throughput over {len(ratios)} repeats: median "
        f"{statistics.median(cpu_ratios):.3f}x by CPU time (min {min(cpu_ratios):.3f}, max "
        f"{max(cpu_ratios):.3f}), "
        f"{statistics.median(ratios):.3f}x by wall time (min {min(ratios):.3f}, max "
        f"{max(ratios):.3f})",
    ]
    emit(
        args,
        NAME,
        [
            "mode",
            "rows",
            "sequences",
            "real-token fraction",
            "wall s (all rows)",
            "real tokens/s (wall)",
            "vs padded",
            "real tokens/cpu-s",
            "vs padded (cpu)",
        ],
        table,
        {
            "config": {
                **{
                    k: v for k, v in vars(args).items() if not k.startswith("_") and not callable(v)
                },
                "model.bert": bert.model_dump(mode="json"),
                "data": {
                    "max_seq_len": d.max_seq_len,
                    "packing": d.packing,
                    "max_per_pack": d.max_per_pack,
                },
                "train.seed": cfg.train.seed,
            },
            "strategy": strategy.stats(),
            "real_tokens": real,
            "rows": n_rows,
            "wall_s": {m: [t.wall for t in ts] for m, ts in totals.items()},
            "cpu_s": {m: [t.cpu for t in ts] for m, ts in totals.items()},
            "median_tokens_per_s": med,
            "ratio_median": statistics.median(ratios),
            "ratios": ratios,
            "median_cpu_tokens_per_s": cpu_med,
            "cpu_ratio_median": statistics.median(cpu_ratios),
            "cpu_ratios": cpu_ratios,
            "ceiling": speedup_ceiling(h),
        },
        notes=notes,
        plot=lambda plt: _plot(plt, cpu_med, statistics.median(cpu_ratios)),
    )
    return 0


def _plot(plt: Any, cpu_med: dict[str, float], ratio: float) -> Any:
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(list(cpu_med), list(cpu_med.values()), color=["#999", "#2a7"])
    ax.set_ylabel("real tokens / CPU-second")
    ax.set_title(f"BERT packed vs padded: {ratio:.2f}x (CPU time)")
    fig.tight_layout()
    return fig
