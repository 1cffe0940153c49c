"""scaleout bench mlmhead: BERT step time with the full vs the unpadded MLM head (NVIDIA's BERT)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from scaleout.argtypes import parse_csv
from scaleout.bench._harness import (
    add_standard_arguments,
    check_counts,
    compare,
    emit,
    interleave,
    set_threads,
)

NAME = "mlmhead"
HELP = (
    "BERT forward+backward with the vocabulary projection at all tokens vs only at the masked "
    "ones (15 percent)"
)
DESCRIPTION = """\
Times a forward + backward step of BERT on CPU with model.bert.unpad_mlm_head off (project every
token
to the vocabulary, then pick the masked ones) and on (gather the masked positions first, as NVIDIA's
MLPerf BERT does), on two shapes: BERT-base (hidden 768, 12 heads, intermediate 3072, vocab 30522;
--base-layers encoder layers) and the tiny CPU config (hidden 128, 2 layers, vocab 30522). 15 % of
the tokens are masked. Full and unpadded steps alternate so noise hits both; the table shows the
median
step time and the speed-up unpadded / full (targets: >= 1.15x base, >= 1.5x tiny).

examples:
  scaleout bench mlmhead
  scaleout bench mlmhead --base-layers 12 --batch 4 --seq-len 128 --repeats 5
"""

SHAPES = {
    # BERT-base (Devlin et al. 2019): 768 hidden, 12 heads, 3072 intermediate, WordPiece vocab 30522
    "base": dict(hidden=768, heads=12, intermediate=3072, vocab_size=30522),
    "tiny": dict(hidden=128, heads=2, intermediate=512, vocab_size=30522, layers=2),
}


SMOKE_ARGS = ["--shapes", "tiny", "--repeats", "1", "--batch", "1", "--seq-len", "16"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default="base,tiny", help="comma list of base, tiny (default both)")
    p.add_argument(
        "--base-layers", type=int, default=12, help="encoder layers of the base shape (default 12)"
    )
    p.add_argument("--batch", type=int, default=4, help="rows per step (default 4)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per row (default 128)")
    p.add_argument(
        "--mask-prob", type=float, default=0.15, help="masked fraction (default 0.15, BERT)"
    )
    p.add_argument("--seed", type=int, default=0)
    add_standard_arguments(p, NAME, repeats=5, threads=1)


def _models(kw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The same weights twice: the full MLM head and the unpadded one."""
    import torch

    from scaleout.families.bert.config import BertConfig
    from scaleout.families.bert.model import BertForPreTraining

    models = {}
    for name, unpad in (("full", False), ("unpadded", True)):
        torch.manual_seed(args.seed)
        cfg = BertConfig(max_position=max(args.seq_len, 8), dropout=0.1, unpad_mlm_head=unpad, **kw)
        models[name] = BertForPreTraining(cfg).train()
    models["unpadded"].load_state_dict(models["full"].state_dict())
    return models


def _shape(name: str, args: argparse.Namespace) -> tuple[list[Any], dict[str, Any]]:
    """Full vs unpadded head on one shape, interleaved: (table row, JSON result)."""
    import numpy as np

    from scaleout.families.bert.data.bert_batch import (
        build_batch,
        padded_packs,
        synthetic_sequences,
    )

    kw = dict(SHAPES[name])
    kw.setdefault("layers", args.base_layers)
    seqs = synthetic_sequences(
        np.full(args.batch, args.seq_len),
        kw["vocab_size"],
        seed=args.seed,
        mask_prob=args.mask_prob,
    )
    batch = build_batch(seqs, padded_packs(args.batch), args.seq_len)
    models = _models(kw, args)

    def step(m: Any) -> Callable[[], None]:
        def run() -> None:
            m.zero_grad(set_to_none=True)
            m(batch).loss.backward()

        return run

    samples = interleave(
        {k: step(m) for k, m in models.items()},
        args.repeats,
        warmup=1,
        say=lambda line: print(f"  {name}{line}", flush=True),
    )
    rows = {r.name: r for r in compare(samples, baseline="full")}
    full, unpad = rows["full"], rows["unpadded"]
    masked = int((batch["mlm_labels"] != -100).sum())
    table = [
        name,
        f"{kw['hidden']}/{kw['layers']}/{kw['vocab_size']}",
        f"{args.batch}x{args.seq_len}",
        masked,
        f"{full.median_s:.3f}",
        f"{unpad.median_s:.3f}",
        f"{unpad.paired_speedup:.3f}",
        f"{full.cpu_median_s:.3f}",
        f"{unpad.cpu_median_s:.3f}",
        f"{unpad.cpu_speedup:.3f}",
    ]
    result = {
        "config": kw,
        "masked_tokens": masked,
        "tokens": args.batch * args.seq_len,
        "full_wall_s": full.times_s,
        "unpadded_wall_s": unpad.times_s,
        "full_cpu_s": [t.cpu for t in samples["full"]],
        "unpadded_cpu_s": [t.cpu for t in samples["unpadded"]],
        "speedup_cpu_median": unpad.cpu_speedup,
        "speedup_wall_median": unpad.paired_speedup,
    }
    return table, result


def run(args: argparse.Namespace) -> int:
    import torch

    shapes = parse_csv(args.shapes, "--shapes", choices=list(SHAPES))
    check_counts(args, repeats=1, batch=1, seq_len=8)
    set_threads(args)
    rows, results = [], {}
    for name in shapes:
        row, results[name] = _shape(name, args)
        rows.append(row)
    emit(
        args,
        NAME,
        [
            "shape",
            "hidden/layers/vocab",
            "batch",
            "masked",
            "full wall s",
            "unpadded wall s",
            "speed-up (wall)",
            "full cpu s",
            "unpadded cpu s",
            "speed-up (cpu)",
        ],
        rows,
        {
            "args": {
                k: v for k, v in vars(args).items() if not callable(v) and not k.startswith("_")
            },
            "results": results,
        },
        notes=[
            f"torch threads: {torch.get_num_threads()}; speed-up = median over back-to-back pairs "
            "of full / unpadded"
        ],
    )
    return 0
