"""scaleout bench mlmhead: BERT step time with the full vs the unpadded MLM head (NVIDIA's BERT)."""

from __future__ import annotations

import argparse

NAME = "mlmhead"
HELP = "BERT forward+backward with the vocabulary projection at all tokens vs only at masked ones (15 %)"
DESCRIPTION = """\
Times a forward + backward step of BERT on CPU with model.bert.unpad_mlm_head off (project every token
to the vocabulary, then pick the masked ones) and on (gather the masked positions first, as NVIDIA's
MLPerf BERT does), on two shapes: BERT-base (hidden 768, 12 heads, intermediate 3072, vocab 30522;
--base-layers encoder layers) and the tiny CPU config (hidden 128, 2 layers, vocab 30522). 15 % of
the tokens are masked. Full and unpadded steps alternate so noise hits both; the table shows the median
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default="base,tiny", help="comma list of base, tiny (default both)")
    p.add_argument("--base-layers", type=int, default=12, help="encoder layers of the base shape (default 12)")
    p.add_argument("--batch", type=int, default=4, help="rows per step (default 4)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per row (default 128)")
    p.add_argument("--mask-prob", type=float, default=0.15, help="masked fraction (default 0.15, BERT)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per variant; median reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/mlmhead.json")


def run(args: argparse.Namespace) -> int:
    import statistics
    import time

    import numpy as np
    import torch

    from scaleout.bench.common import format_table, write_json
    from scaleout.config.schema import BertConfig
    from scaleout.data.bert_batch import build_batch, padded_packs, synthetic_sequences
    from scaleout.errors import UserError
    from scaleout.models.bert import BertForPreTraining

    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for s in shapes:
        if s not in SHAPES:
            raise UserError(f"--shapes: {s!r} is not one of {', '.join(SHAPES)}")
    if args.repeats < 1 or args.batch < 1 or args.seq_len < 8:
        raise UserError("--repeats and --batch must be >= 1 and --seq-len >= 8")
    rows, results = [], {}
    for name in shapes:
        kw = dict(SHAPES[name])
        kw.setdefault("layers", args.base_layers)
        seqs = synthetic_sequences(np.full(args.batch, args.seq_len), kw["vocab_size"], seed=args.seed,
                                   mask_prob=args.mask_prob)
        batch = build_batch(seqs, padded_packs(args.batch), args.seq_len)
        masked = int((batch["mlm_labels"] != -100).sum())
        models = {}
        for unpad in (False, True):
            torch.manual_seed(args.seed)
            cfg = BertConfig(max_position=max(args.seq_len, 8), dropout=0.1, unpad_mlm_head=unpad, **kw)
            models[unpad] = BertForPreTraining(cfg).train()
        models[True].load_state_dict(models[False].state_dict())

        def step(m, batch=batch) -> float:
            t = time.perf_counter()
            m.zero_grad(set_to_none=True)
            m(batch).loss.backward()
            return time.perf_counter() - t

        step(models[False]), step(models[True])  # warm-up
        times: dict[bool, list[float]] = {False: [], True: []}
        ratios = []
        for r in range(args.repeats):
            order = (False, True) if r % 2 == 0 else (True, False)
            for unpad in order:
                times[unpad].append(step(models[unpad]))
            ratios.append(times[False][-1] / times[True][-1])
            print(f"  {name} {r + 1}/{args.repeats}: full {times[False][-1]:.3f} s, unpadded {times[True][-1]:.3f} s",
                  flush=True)
        full, unp = statistics.median(times[False]), statistics.median(times[True])
        results[name] = {"config": kw, "masked_tokens": masked, "tokens": args.batch * args.seq_len,
                         "full_s": times[False], "unpadded_s": times[True], "speedup_median": statistics.median(ratios)}
        rows.append([name, f"{kw['hidden']}/{kw['layers']}/{kw['vocab_size']}", f"{args.batch}x{args.seq_len}",
                     masked, f"{full:.3f}", f"{unp:.3f}", f"{statistics.median(ratios):.3f}"])
    print(format_table(["shape", "hidden/layers/vocab", "batch", "masked", "full s/step", "unpadded s/step",
                        "speed-up"], rows))
    if p := write_json(args.out, {"args": {k: v for k, v in vars(args).items() if not callable(v) and
                                          not k.startswith("_")}, "results": results}):
        print(f"JSON: {p}")
    return 0
