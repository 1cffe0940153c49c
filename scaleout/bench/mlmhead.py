"""scaleout bench mlmhead: BERT step time with the full vs the unpadded MLM head (NVIDIA's BERT)."""

from __future__ import annotations

import argparse

NAME = "mlmhead"
HELP = "BERT forward+backward with the vocabulary projection at all tokens vs only at the masked ones (15 percent)"
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
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: then the step's CPU time is this thread's time, which other "
                        "jobs on a shared machine barely disturb; 0 = torch's default)")
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
    if args.threads:
        torch.set_num_threads(args.threads)
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

        def step(m, batch=batch) -> tuple[float, float]:
            t, c = time.perf_counter(), time.thread_time()
            m.zero_grad(set_to_none=True)
            m(batch).loss.backward()
            return time.perf_counter() - t, time.thread_time() - c

        step(models[False]), step(models[True])  # warm-up
        wall: dict[bool, list[float]] = {False: [], True: []}
        cpu: dict[bool, list[float]] = {False: [], True: []}
        for r in range(args.repeats):
            for unpad in ((False, True) if r % 2 == 0 else (True, False)):
                w, c = step(models[unpad])
                wall[unpad].append(w)
                cpu[unpad].append(c)
            print(f"  {name} {r + 1}/{args.repeats}: full {wall[False][-1]:.3f} s, unpadded {wall[True][-1]:.3f} s "
                  f"(cpu {cpu[False][-1]:.3f} / {cpu[True][-1]:.3f} s)", flush=True)
        med = {k: statistics.median(v) for k, v in (("full_wall", wall[False]), ("unpad_wall", wall[True]),
                                                    ("full_cpu", cpu[False]), ("unpad_cpu", cpu[True]))}
        cpu_ratio = statistics.median(f / u for f, u in zip(cpu[False], cpu[True], strict=True))
        wall_ratio = statistics.median(f / u for f, u in zip(wall[False], wall[True], strict=True))
        results[name] = {"config": kw, "masked_tokens": masked, "tokens": args.batch * args.seq_len,
                         "full_wall_s": wall[False], "unpadded_wall_s": wall[True], "full_cpu_s": cpu[False],
                         "unpadded_cpu_s": cpu[True], "speedup_cpu_median": cpu_ratio,
                         "speedup_wall_median": wall_ratio}
        rows.append([name, f"{kw['hidden']}/{kw['layers']}/{kw['vocab_size']}", f"{args.batch}x{args.seq_len}",
                     masked, f"{med['full_wall']:.3f}", f"{med['unpad_wall']:.3f}", f"{wall_ratio:.3f}",
                     f"{med['full_cpu']:.3f}", f"{med['unpad_cpu']:.3f}", f"{cpu_ratio:.3f}"])
    print(f"torch threads: {torch.get_num_threads()}; speed-up = median over back-to-back pairs of full / unpadded")
    print(format_table(["shape", "hidden/layers/vocab", "batch", "masked", "full wall s", "unpadded wall s",
                        "speed-up (wall)", "full cpu s", "unpadded cpu s", "speed-up (cpu)"], rows))
    if p := write_json(args.out, {"args": {k: v for k, v in vars(args).items() if not callable(v) and
                                          not k.startswith("_")}, "results": results}):
        print(f"JSON: {p}")
    return 0
