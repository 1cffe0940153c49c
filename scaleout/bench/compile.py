"""scaleout bench compile: tiny-BERT training step time, torch.compile vs eager, in one run."""

from __future__ import annotations

import argparse

NAME = "compile"
HELP = "tiny BERT forward+backward+optimizer step on CPU: torch.compile (Inductor) vs eager, compile time apart"
DESCRIPTION = """\
Builds two copies of the same BERT (the tiny CPU shape of configs/bert_tiny_cpu.yaml by default:
hidden 128, 2 layers, 2 heads, intermediate 512, vocab 4096), compiles one in place with
scaleout.train.capture.compile_model (what model.compile=true does in the trainer), and times a full
training step (forward, backward, AdamW) on the same packed-shape batch (--batch rows of --seq-len
tokens). The first compiled step (tracing + code generation) is reported separately as compile time;
then eager and compiled steps alternate (--repeats each) so machine noise hits both, and the table
gives median wall and thread-CPU time per step and the speed-up compiled / eager, whichever wins.
Also reports the largest loss difference between the two over the timed steps (dropout 0: the same
math) as a correctness check.

examples:
  scaleout bench compile
  scaleout bench compile --batch 32 --repeats 10 --backend inductor --mode max-autotune-no-cudagraphs
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=16, help="rows per step (default 16)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per row (default 128)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=10, help="timed steps per variant (default 10); medians reported")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument("--mode", default=None, help="torch.compile mode (default: torch's default)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: thread-CPU time is then robust to other jobs; 0 = torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/compile.json")


def run(args: argparse.Namespace) -> int:
    import copy
    import statistics
    import sys
    import time

    import numpy as np
    import torch

    from scaleout.bench.common import format_table, write_json
    from scaleout.config.schema import BertConfig
    from scaleout.data.bert_batch import build_batch, padded_packs, synthetic_sequences
    from scaleout.errors import UserError
    from scaleout.models.bert import BertForPreTraining
    from scaleout.train.capture import compile_model

    if args.repeats < 1 or args.batch < 1 or args.seq_len < 8:
        raise UserError(f"--repeats={args.repeats} and --batch={args.batch} must be >= 1, --seq-len={args.seq_len} >= 8")
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = BertConfig(vocab_size=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                     intermediate=args.intermediate, max_position=args.seq_len, dropout=0.0)
    seqs = synthetic_sequences(np.full(args.batch, args.seq_len), args.vocab, seed=args.seed)
    batch = build_batch(seqs, padded_packs(args.batch), args.seq_len)
    torch.manual_seed(args.seed)
    models = {"eager": BertForPreTraining(cfg).train()}
    models["compiled"] = compile_model(copy.deepcopy(models["eager"]), backend=args.backend, mode=args.mode)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True) for k, m in models.items()}

    def step(name: str) -> tuple[float, float, float]:
        m, opt = models[name], opts[name]
        t, c = time.perf_counter(), time.thread_time()
        opt.zero_grad(set_to_none=True)
        loss = m(batch).loss
        loss.backward()
        opt.step()
        return time.perf_counter() - t, time.thread_time() - c, float(loss.detach())

    print(f"compiling ({args.backend}) ...", file=sys.stderr, flush=True)
    compile_s, _, first_c = step("compiled")
    eager_first, _, first_e = step("eager")
    times: dict[str, list[tuple[float, float]]] = {"eager": [], "compiled": []}
    diffs = [abs(first_c - first_e)]
    for i in range(args.repeats):
        losses = {}
        for name in ("eager", "compiled") if i % 2 == 0 else ("compiled", "eager"):
            wall, cpu, losses[name] = step(name)
            times[name].append((wall, cpu))
        diffs.append(abs(losses["compiled"] - losses["eager"]))
        print(f"  step {i + 1}/{args.repeats}", file=sys.stderr, flush=True)
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}
    e_wall, e_cpu = med["eager"]
    rows = [[k, f"{w * 1e3:.1f}", f"{c * 1e3:.1f}", f"{e_wall / w:.2f}x", f"{e_cpu / c:.2f}x" if c else "-",
             f"{compile_s:.1f}" if k == "compiled" else f"{eager_first:.2f}"] for k, (w, c) in med.items()]
    print(format_table(["variant", "step ms (median wall)", "step ms (thread CPU)", "speed-up (wall)",
                        "speed-up (CPU)", "first step s (compile)"], rows))
    winner = "compiled" if med["compiled"][0] < e_wall else "eager"
    print(f"\n{winner} wins: compiled/eager step time {med['compiled'][0] / e_wall:.2f}; compile took {compile_s:.1f} s, "
          f"paid back after {compile_s / max(e_wall - med['compiled'][0], 1e-9):.0f} steps" if winner == "compiled"
          else f"\neager wins: compiled/eager step time {med['compiled'][0] / e_wall:.2f} (compile took {compile_s:.1f} s)")
    print(f"max |loss compiled - loss eager| over the steps: {max(diffs):.2e}")
    payload = {"args": vars(args), "compile_s": compile_s, "eager_first_step_s": eager_first,
               "median_wall_s": {k: v[0] for k, v in med.items()}, "median_thread_cpu_s": {k: v[1] for k, v in med.items()},
               "speedup_wall": e_wall / med["compiled"][0], "max_loss_diff": max(diffs),
               "steps": {k: v for k, v in times.items()}, "winner": winner}
    path = write_json(args.out, payload)
    if path:
        print(f"wrote {path}")
    return 0
