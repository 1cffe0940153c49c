"""The baseline of ``scaleout bench ttt``: the plain torch script a user would write instead of
scaleout.

One process per rank under any torchrun-style launcher (``scaleout launch`` sets RANK, WORLD_SIZE,
MASTER_ADDR, ...): ``torch.nn.parallel.DistributedDataParallel`` with its default 25 MB buckets and
its own all-reduce, ``torch.optim.AdamW`` (fused where torch has the kernel, else foreach), padded
batches from ``DistributedSampler`` + ``DataLoader``, linear warm-up then linear decay to 0
(``LambdaLR``, as Hugging Face's ``get_linear_schedule_with_warmup``), no-decay on bias and
LayerNorm (BERT's recipe).

What it shares with scaleout is what the comparison must hold equal, and nothing else: the tokenized
sequences of the offline corpus (scaleout's data pipeline, one sequence per padded row), the model
class (``BertForPreTraining`` with the config's ``model.bert``), the evaluation
(``scaleout.families.bert.task. evaluate_mlm``: the same eval set, masked-LM accuracy) and MLPerf's
clock (``run_start`` -> ``run_stop`` in ``mlperf.log`` via ``MLPerfLogger``). Rank 0 also writes
``report.json`` with the status and steps.

    scaleout launch --nnodes 2 --nproc-per-node 2 -- python -m scaleout.bench._ttt_baseline \\
        --lr 2e-3 --global-batch 64 --max-steps 500 --warmup-steps 50 --eval-every 16 --target 0.13
        --out runs/b
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scaleout.telemetry.mlperf import MLPerfLogger


def add_run_arguments(
    p: argparse.ArgumentParser, *, config: str, unit: str, target: str, seed_help: str
) -> None:
    """The run's flags every baseline script takes (BERT here, ResNet, Llama): config,
    learning rate, batch, step budget, warm-up, evaluation cadence, target and seed."""
    p.add_argument("--config", default=config, help="config for the model and data settings")
    p.add_argument("--lr", type=float, required=True, help="peak learning rate")
    p.add_argument(
        "--global-batch", type=int, required=True, help=f"{unit} per step, all ranks together"
    )
    p.add_argument(
        "--max-steps",
        type=int,
        required=True,
        help="step budget; the schedule decays to 0 at its end",
    )
    p.add_argument("--warmup-steps", type=int, required=True, help="linear warm-up steps")
    p.add_argument(
        "--eval-every",
        type=int,
        required=True,
        help="evaluate every this many steps (and at the end)",
    )
    p.add_argument("--target", type=float, required=True, help=f"{target} that ends the run")
    p.add_argument("--seed", type=int, default=1234, help=seed_help)


def add_ddp_arguments(p: argparse.ArgumentParser) -> None:
    """DDP's bucket size, the sweep's time budget, the output directory and the config
    overrides: the last flags of every baseline script."""
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=None,
        help="DDP bucket_cap_mb (default: torch's, 25 MiB with a 1 MiB first bucket; a number "
        "makes every bucket that size, the first one too)",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="stop (target not reached) once run_start is this many seconds ago: a sweep candidate "
        "already slower than the best one so far cannot become the best",
    )
    p.add_argument("--out", required=True, help="output directory (mlperf.log, report.json)")
    p.add_argument(
        "overrides", nargs="*", help="config overrides for model/data, e.g. model.bert.layers=1"
    )


def checked(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parsed, with the run's numbers positive and the warm-up inside the budget (argparse's
    one-line error otherwise)."""
    a = p.parse_args(argv)
    for k in ("lr", "global_batch", "max_steps", "warmup_steps", "eval_every"):
        if getattr(a, k) <= 0:
            p.error(f"--{k.replace('_', '-')}={getattr(a, k)}: expected a positive number")
    if a.warmup_steps >= a.max_steps:
        p.error(f"--warmup-steps {a.warmup_steps} must be below --max-steps {a.max_steps}")
    return a


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m scaleout.bench._ttt_baseline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_arguments(
        p,
        config="bert_tiny_cpu",
        unit="sequences",
        target="masked-LM accuracy",
        seed_help="model initialisation; the data order follows data.seed, as in scaleout train",
    )
    p.add_argument(
        "--weight-decay", type=float, default=0.01, help="AdamW decoupled weight decay (BERT: 0.01)"
    )
    add_ddp_arguments(p)
    return checked(p, argv)


def adamw(
    model: Any, lr: float, weight_decay: float, betas: tuple[float, float], eps: float
) -> Any:
    """torch's AdamW with BERT's groups: no decay for biases and LayerNorm weights (1-D tensors)."""
    import torch

    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    # the fused kernel exists on CPU since torch 2.4 and on CUDA; 2.5x faster than foreach here
    try:
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=True)


def linear_schedule(opt: Any, warmup: int, total: int) -> Any:
    """Linear warm-up from 0 to the peak, then linear decay to 0 at ``total`` steps."""
    import torch

    def factor(step: int) -> float:
        if step < warmup:
            return step / warmup
        return max(0.0, (total - step) / (total - warmup))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def _past(t0: float, budget: float) -> bool:
    """Rank 0's clock decides for everyone (one tiny broadcast), so no rank leaves the loop
    alone."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([float(time.perf_counter() - t0 > budget)])
    dist.broadcast(flag, 0)
    return bool(flag.item())


def _data(cfg: Any, local_rank: int) -> tuple[list[Any], list[Any]]:
    """Tokenized train / eval sequences from scaleout's pipeline; local rank 0 builds the
    per-node cache."""
    import torch.distributed as dist

    from scaleout.families.bert.data.bert_sources import load_bert_data, to_bert_sequences

    if local_rank == 0:
        data = load_bert_data(cfg)
    dist.barrier()
    if local_rank != 0:
        data = load_bert_data(cfg)
    return to_bert_sequences(data.train), to_bert_sequences(data.eval[: cfg.data.eval_samples])


def _build(a: argparse.Namespace, cfg: Any, rank: int, world: int) -> SimpleNamespace:
    """Model, DDP, AdamW, schedule and the padded-batch loader: what a user's script sets up."""
    import torch
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from scaleout.families.bert.data.bert_batch import build_batch
    from scaleout.families.bert.model import BertForPreTraining

    train, evals = _data(cfg, int(os.environ.get("LOCAL_RANK", 0)))
    d, o = cfg.data, cfg.optim
    torch.manual_seed(a.seed)
    model = BertForPreTraining(cfg.model.bert)
    # broadcasts rank 0's weights. bucket_cap_mb=None is torch's default: 25 MiB buckets after a
    # 1 MiB first one (_DEFAULT_FIRST_BUCKET_BYTES), as DistributedDataParallel(model) has them;
    # an explicit 25 makes the first bucket 25 MiB too (torch 2.13): one bucket for a 4 MB model.
    ddp = DistributedDataParallel(model, bucket_cap_mb=a.bucket_mb)
    opt = adamw(model, a.lr, a.weight_decay, tuple(o.betas), o.eps)
    sampler = DistributedSampler(
        range(len(train)), num_replicas=world, rank=rank, shuffle=True, seed=d.seed, drop_last=True
    )
    loader = DataLoader(
        range(len(train)),
        batch_size=a.global_batch // world,
        sampler=sampler,
        drop_last=True,
        collate_fn=lambda idx: build_batch(
            train, [[i] for i in idx], d.max_seq_len, d.max_predictions, 1
        ),
    )
    return SimpleNamespace(
        model=model,
        ddp=ddp,
        opt=opt,
        sched=linear_schedule(opt, a.warmup_steps, a.max_steps),
        sampler=sampler,
        loader=loader,
        evals=evals,
        cfg=cfg,
        me=SimpleNamespace(rank=rank, world_size=world, device=torch.device("cpu")),
    )


def _evaluate(
    a: argparse.Namespace, run: SimpleNamespace, mlperf_log: MLPerfLogger, samples: int
) -> float:
    from scaleout.families.bert.task import evaluate_mlm

    d = run.cfg.data
    mlperf_log.block_stop(samples, samples)
    mlperf_log.eval_start(samples, samples)
    metric = evaluate_mlm(run.model, run.evals, d.max_seq_len, d.max_predictions, run.me)
    mlperf_log.eval_accuracy(metric, samples, samples)
    mlperf_log.eval_stop(samples, samples)
    if run.me.rank == 0:
        print(f"samples {samples}: mlm_accuracy {metric:.4f} (target {a.target})", flush=True)
    return metric


def ddp_step(run: SimpleNamespace, batch: Any) -> Any:
    """One step of the plain loop (``scaleout bench framework`` times this very function);
    returns this rank's loss (a tensor: nothing is read here)."""
    loss = run.ddp(batch).loss
    loss.backward()
    run.opt.step()
    run.sched.step()
    run.opt.zero_grad(set_to_none=True)
    return loss.detach()


def bucket_sizes(ddp: Any) -> list[int] | None:
    """DDP's gradient buckets in bytes as it runs them (after its rebuild at the second step:
    its logging data keeps the initial ones), launch order; None where this torch does not say."""
    try:
        buckets = ddp.reducer._get_zeros_like_grad_buckets()
    except (AttributeError, RuntimeError):
        return None
    return [b.buffer().numel() * b.buffer().element_size() for b in buckets]


def train_loop(
    a: argparse.Namespace,
    run: SimpleNamespace,
    mlperf_log: MLPerfLogger,
    t0: float,
    step_fn: Callable[[SimpleNamespace, Any], Any],
    evaluate: Callable[[argparse.Namespace, SimpleNamespace, MLPerfLogger, int], float],
    reached: Callable[[float, float], bool] = lambda metric, target: metric >= target,
) -> tuple[str, int, int, float | None]:
    """Train until the target, the step budget or the time budget: (status, steps, sequences,
    last metric). ``reached(metric, target)`` says the metric's direction (the family's
    ``Family.reached``: higher is better for accuracy, lower for log-perplexity)."""
    step, samples, metric, status, epoch = 0, 0, None, "max_steps", 0
    mlperf_log.block_start(0, 1, 0)
    while status == "max_steps" and step < a.max_steps:
        run.sampler.set_epoch(epoch)
        for batch in run.loader:
            step_fn(run, batch)
            step, samples = step + 1, samples + a.global_batch
            if step % a.eval_every == 0 or step == a.max_steps:
                metric = evaluate(a, run, mlperf_log, samples)
                if reached(metric, a.target):
                    status = "success"
                    break
                if a.time_budget is not None and _past(
                    t0, a.time_budget
                ):  # checked at evaluations only
                    status = "time_budget"
                    break
                mlperf_log.block_start(samples, 1, samples)
            if step == a.max_steps:
                break
        epoch += 1
    return status, step, samples, metric


def _loop(
    a: argparse.Namespace, run: SimpleNamespace, mlperf_log: MLPerfLogger, t0: float
) -> tuple[str, int, int, float | None]:
    return train_loop(a, run, mlperf_log, t0, ddp_step, _evaluate)


def timed_main(
    a: argparse.Namespace,
    build: Callable[[argparse.Namespace, Any, int, int], SimpleNamespace],
    loop: Callable[..., tuple[str, int, int, float | None]],
    eval_count: Callable[[SimpleNamespace], int],
    describe: Callable[[SimpleNamespace], dict[str, Any]],
    unit: str,
) -> int:
    """What the baselines (BERT here, ResNet and Llama in their modules) do around their own
    build and loop: the gloo group, the config, MLPerf's init/run_start/run_stop clock in
    ``mlperf.log`` (the same clock scaleout's runs are timed by) and rank 0's ``report.json``."""
    import torch
    import torch.distributed as dist

    from scaleout.config import load_config
    from scaleout.telemetry.mlperf import MLPerfLogger

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.global_batch % world:
        raise SystemExit(
            f"--global-batch {a.global_batch} is not divisible by the world size {world}"
        )
    cfg = load_config(a.config, a.overrides)
    out = Path(a.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    mlperf_log = MLPerfLogger(out / "mlperf.log", rank=rank)
    mlperf_log.cache_clear()
    mlperf_log.init_start()
    run = build(a, cfg, rank, world)
    # torch's optimizers import torch._dynamo in their first step (~2.5 s of CPU a rank): paid
    # here, untimed, as scaleout's trainer pays it while building a torch optimizer
    # (scaleout/optim/lazy_dynamo.py), not inside this side's clock only
    import torch._dynamo  # noqa: F401

    mlperf_log.init_stop()
    dist.barrier()
    mlperf_log.run_start()
    t0 = time.perf_counter()
    status, step, samples, metric = loop(a, run, mlperf_log, t0)
    dist.barrier()
    ttt = time.perf_counter() - t0
    mlperf_log.train_samples(samples)
    mlperf_log.eval_samples(eval_count(run))
    mlperf_log.run_stop("success" if status == "success" else "aborted", samples)
    if rank == 0:
        report = {
            "status": status,
            "steps": step,
            "samples": samples,
            "achieved": metric,
            "target": a.target,
            "time_to_train_s": ttt,
            **describe(run),
            "ddp_bucket_mb": a.bucket_mb,  # None: torch's default
            "ddp_bucket_sizes": bucket_sizes(run.ddp),
            "global_batch": a.global_batch,
            "lr": a.lr,
            "world_size": world,
        }
        (out / "report.json").write_text(json.dumps(report, indent=2))
        print(f"baseline: {status} after {step} steps, {samples} {unit}, {ttt:.1f} s", flush=True)
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    return timed_main(
        parse_args(argv),
        _build,
        _loop,
        lambda run: len(run.evals),
        lambda run: {
            "optimizer": type(run.opt).__name__,
            "fused": bool(run.opt.defaults.get("fused")),
        },
        "sequences",
    )


if __name__ == "__main__":
    raise SystemExit(main())
