"""The Llama baseline of ``scaleout bench ttt --task llama``: the plain torch script a user would
write in 2026 instead of scaleout.

One process per rank under any torchrun-style launcher (``scaleout launch`` sets RANK, WORLD_SIZE,
...): ``DistributedDataParallel`` (its default buckets, its own all-reduce), ``torch.optim.AdamW``
(fused where torch has the kernel) with no decay on the 1-D RMSNorm weights, the forward under
``torch.autocast(bfloat16)`` (fp32 weights, optimizer state and loss), the gradients clipped to
the config's global norm after DDP's averaging, linear warm-up then half a cosine down to the
config's floor (``end_lr / lr``), ``DistributedSampler`` + ``DataLoader`` over rows cut from the
documents laid end to end: the usual GPT loop, whose rows are **naively concatenated documents**
(one causal sequence per row, no document mask, the loss predicting across a boundary).

What it shares with scaleout is what the comparison holds equal: the Megatron indexed token files
(``scaleout.families.llama.task.corpus_of``: the same documents, cut into the same rows of
``model.llama.seq_len`` tokens), the model class and its initialisation (``LlamaForCausalLM`` after
``torch.manual_seed(--seed)``, as ``scaleout train``), AdamW's betas, epsilon, weight decay and
clipping from the config, the evaluation (``evaluate_rows``: the same held-out rows, the family's
log-perplexity with documents kept apart; lower is better) and MLPerf's clock (``run_start`` ->
``run_stop`` in ``mlperf.log``). Rank 0 also writes ``report.json``.

    scaleout launch --nnodes 2 --nproc-per-node 2 -- \\
        python -m scaleout.bench._ttt_baseline_llama --lr 2e-3 --global-batch 32 \\
        --max-steps 400 --warmup-steps 40 --eval-every 25 --target 5.5 --out runs/b
"""

from __future__ import annotations

import argparse
import contextlib
import os
from types import SimpleNamespace
from typing import Any

import numpy as np

from scaleout.bench._ttt_baseline import (
    adamw,
    add_ddp_arguments,
    add_run_arguments,
    checked,
    timed_main,
    train_loop,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m scaleout.bench._ttt_baseline_llama",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_arguments(
        p,
        config="llama_tiny_cpu",
        unit="rows",
        target="log-perplexity (lower is better)",
        seed_help="model initialisation; the data order follows data.seed, as in scaleout train",
    )
    p.add_argument(
        "--precision",
        choices=("bf16", "fp32"),
        default="bf16",
        help="the forward under torch.autocast(bfloat16) (default) or plain fp32",
    )
    add_ddp_arguments(p)
    return checked(p, argv)


def _autocast(precision: str) -> Any:
    import torch

    if precision == "fp32":
        return contextlib.nullcontext
    return lambda: torch.autocast("cpu", dtype=torch.bfloat16)


def _build(a: argparse.Namespace, cfg: Any, rank: int, world: int) -> SimpleNamespace:
    """Model, DDP, AdamW, the cosine schedule and the row loader: what a user's script sets up."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from scaleout.families.llama.data.rows import Rows
    from scaleout.families.llama.model import LlamaForCausalLM
    from scaleout.families.llama.task import corpus_of
    from scaleout.optim.schedule import warmup_cosine

    c, d, o = cfg.model.llama, cfg.data, cfg.optim
    first = int(os.environ.get("LOCAL_RANK", 0)) == 0  # builds the per-host cache first
    if first:
        train_docs, eval_docs = corpus_of(cfg)
    dist.barrier()
    if not first:
        train_docs, eval_docs = corpus_of(cfg)
    train, evals = Rows(train_docs, c.seq_len), Rows(eval_docs, c.seq_len)
    torch.manual_seed(a.seed)
    model = LlamaForCausalLM(c)
    ddp = DistributedDataParallel(model, bucket_cap_mb=a.bucket_mb)  # broadcasts rank 0's weights
    opt = adamw(model, a.lr, o.weight_decay, tuple(o.betas), o.eps)  # RMSNorm weights: no decay
    floor = o.end_lr / o.lr if o.lr > 0 else 0.0  # the config's end_lr / lr (a tenth)
    sampler = DistributedSampler(
        range(len(train)), num_replicas=world, rank=rank, shuffle=True, seed=d.seed, drop_last=True
    )
    loader = DataLoader(
        range(len(train)),
        batch_size=a.global_batch // world,
        sampler=sampler,
        drop_last=True,
        # the tokens only: a row is one causal sequence (naive concatenation of the documents)
        collate_fn=lambda idx: torch.from_numpy(np.stack([train[int(i)][0] for i in idx])),
    )
    me = SimpleNamespace(rank=rank, world_size=world, device=torch.device("cpu"))
    return SimpleNamespace(
        model=model,
        ddp=ddp,
        opt=opt,
        sched=warmup_cosine(opt, a.warmup_steps, a.max_steps, a.lr * floor),
        clip=o.clip_grad_norm,
        autocast=_autocast(a.precision),
        sampler=sampler,
        loader=loader,
        evals=evals,
        eval_idx=np.arange(min(d.eval_samples, len(evals))),
        me=me,
    )


def llama_step(run: SimpleNamespace, tokens: Any) -> Any:
    """One step of the plain GPT loop; returns this rank's loss (a tensor: nothing is read)."""
    import torch

    with run.autocast():
        logits = run.ddp(tokens)
    loss = run.model.loss_of(logits, tokens, None)  # fp32 cross-entropy, across documents
    loss.backward()
    if run.clip:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.clip)
    run.opt.step()
    run.sched.step()
    run.opt.zero_grad(set_to_none=True)
    return loss.detach()


def _evaluate(a: argparse.Namespace, run: SimpleNamespace, log: Any, samples: int) -> float:
    from scaleout.families.llama.task import evaluate_rows

    log.block_stop(samples, samples)
    log.eval_start(samples, samples)
    metric = evaluate_rows(run.model, run.evals, run.eval_idx, run.me, run.autocast)
    log.eval_accuracy(metric, samples, samples)
    log.eval_stop(samples, samples)
    if run.me.rank == 0:
        print(f"rows {samples}: log-perplexity {metric:.4f} (target {a.target})", flush=True)
    return metric


def _loop(
    a: argparse.Namespace, run: SimpleNamespace, log: Any, t0: float
) -> tuple[str, int, int, float | None]:
    from scaleout.families.llama import LLAMA

    return train_loop(a, run, log, t0, llama_step, _evaluate, LLAMA.reached)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    return timed_main(
        a,
        _build,
        _loop,
        lambda run: len(run.eval_idx),
        lambda run: {
            "optimizer": type(run.opt).__name__,
            "fused": bool(run.opt.defaults.get("fused")),
            "precision": a.precision,
            "document_mask": False,
            "clip_grad_norm": run.clip,
        },
        "rows",
    )


if __name__ == "__main__":
    raise SystemExit(main())
