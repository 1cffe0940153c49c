"""scaleout bench optim: optimizer step time on BERT-base and ResNet-50 parameter shapes."""

from __future__ import annotations

import argparse
import gc
import math
import multiprocessing as mp
import os
import statistics
import sys
import traceback
from typing import TYPE_CHECKING, Any

import scaleout
from scaleout.argtypes import parse_csv
from scaleout.bench._harness import add_standard_arguments, check_counts, emit, interleave

if TYPE_CHECKING:
    from scaleout.world import World

NAME = "optim"
HELP = (
    "optimizer step time: LAMB/LARS vs AdamW, SGD and torch-optimizer's Lamb; sharded LAMB per rank"
)
DESCRIPTION = """\
Step time of scaleout's LAMB and LARS against torch.optim.AdamW(foreach=True), SGD(momentum,
foreach=True) and torch-optimizer's Lamb on the parameter shapes of BERT-base (199 tensors, 109.5 M
parameters) and ResNet-50 (161 tensors, 25.6 M), with random gradients. The contenders share the
parameters and run in turn with both baselines, round after round, so machine noise hits them alike;
the table gives median times and the median of the per-round ratios against AdamW and SGD. At most
three optimizers hold state at once (BERT-base: ~3.1 GB in all). Also timed: torch's fused AdamW and
SGD, and the one-pass LAMB / LARS (scaleout/optim/fused.py: the GPU default, here its portable
kernels) beside the CPU default; the B/param column is what each step moves by the byte counter
(scaleout/optim/bytecount.py: every op's operands, i.e. what a GPU streams; on the CPU the
cache-blocked chains touch DRAM less than they count). --compiled adds the one-pass ops through
torch.compile on the CPU (the code a GPU runs; compiling takes minutes) after checking they agree
with the eager kernels.

Then (--sharded-ranks, default 4) real gloo processes compare, per rank and under the same load, the
non-sharded LAMB step with the sharded LAMB's update (communication timed apart) and its state
bytes.

examples:
  scaleout bench optim                                # both models + sharded LAMB on 4 ranks
  (ResNet-50 shapes)
  scaleout bench optim --models '' --sharded-model bert  # only the sharded part, BERT-base shapes
  (~7 GB)
  scaleout bench optim --models bert --repeats 9 --sharded-ranks 0
  scaleout bench optim --chunks 65536,262144,1048576  # LAMB/LARS cache-block size sweep
  scaleout bench optim --models resnet --sharded-ranks 0 --compiled  # + torch.compile'd one-pass
"""

SHAPES = ("bert", "resnet", "tiny")
SMOKE_ARGS = [
    "--models",
    "tiny",
    "--sharded-model",
    "tiny",
    "--repeats",
    "1",
    "--sharded-ranks",
    "2",
    "--sharded-steps",
    "1",
    "--threads",
    "1",
]


def bert_base_shapes() -> list[tuple[int, ...]]:
    """BERT-base (Devlin et al.): 30522-token vocabulary, hidden 768, 12 layers, FFN 3072,
    pooler."""
    h, f, vocab = 768, 3072, 30522
    shapes: list[tuple[int, ...]] = [(vocab, h), (512, h), (2, h), (h,), (h,)]
    for _ in range(12):
        shapes += [(h, h), (h,)] * 4 + [(h,), (h,), (f, h), (f,), (h, f), (h,), (h,), (h,)]
    return shapes + [(h, h), (h,)]


def resnet50_shapes() -> list[tuple[int, ...]]:
    """ResNet-50 v1.5 (He et al.): conv weights, batch-norm scale/shift, fc."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    cin = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            out = width * 4
            shapes += [
                (width, cin, 1, 1),
                (width,),
                (width,),
                (width, width, 3, 3),
                (width,),
                (width,),
            ]
            shapes += [(out, width, 1, 1), (out,), (out,)]
            if b == 0:
                shapes += [(out, cin, 1, 1), (out,), (out,)]
            cin = out
    return shapes + [(1000, 2048), (1000,)]


def tiny_shapes() -> list[tuple[int, ...]]:
    """A few small tensors of every kind above (a conv, a matrix, vectors): every code path in
    a second, for the smoke test (``SMOKE_ARGS``); its times measure nothing."""
    return [(32, 3, 3, 3), (32,), (32,), (64, 32), (64,), (10, 64), (10,)]


def shapes_of(model: str) -> list[tuple[int, ...]]:
    return {"bert": bert_base_shapes, "resnet": resnet50_shapes, "tiny": tiny_shapes}[model]()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--models",
        default="bert,resnet",
        help="comma list of bert, resnet, tiny (default bert,resnet; tiny: a smoke test's shapes)",
    )
    p.add_argument(
        "--chunks", default="", help="also time LAMB/LARS with these cache-block sizes (comma list)"
    )
    p.add_argument(
        "--compiled",
        action="store_true",
        help="also time the one-pass LAMB/LARS compiled with torch.compile on the CPU (slow start)",
    )
    p.add_argument(
        "--sharded-ranks",
        type=int,
        default=4,
        help="processes for the sharded-LAMB part (0 = skip)",
    )
    # ResNet-50 shapes by default: 4 ranks x BERT-base need ~7 GB (LAMB's full state on every rank
    # first)
    p.add_argument(
        "--sharded-model",
        choices=SHAPES,
        default="resnet",
        help="shapes for the sharded part (default resnet)",
    )
    p.add_argument(
        "--sharded-steps", type=int, default=3, help="timed steps in the sharded part (default 3)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads for the single-process part (0 = torch's default). On a machine whose "
        "cores are also "
        "busy with other work, 1 avoids OpenMP barrier stalls that hit every contender unevenly",
    )
    add_standard_arguments(p, NAME, repeats=7, png=True)


def _make(shapes: list[tuple[int, ...]], seed: int = 0) -> tuple[list[Any], list[dict[str, Any]]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    # 2-D+ tensors are the decayed/adapted ones; 1-D are bias and norm parameters (the references'
    # rule)
    groups = [
        {"params": [p for p in params if p.dim() > 1]},
        {"params": [p for p in params if p.dim() == 1], "weight_decay": 0.0},
    ]
    return params, groups


BASELINES = ("AdamW foreach", "SGD momentum foreach")


def _compiled_step(opt: Any) -> Any:
    """``opt.step`` with the one-pass ops compiled on the CPU (scaleout.optim.fused)."""
    from scaleout.optim import fused

    def step() -> None:
        fused.COMPILE_DEVICES.add("cpu")
        try:
            opt.step()
        finally:
            fused.COMPILE_DEVICES.discard("cpu")

    return step


def _factories(
    params: list[Any], groups: list[dict[str, Any]], chunks: list[int], compiled: bool = False
) -> dict[str, Any]:
    """name -> () -> step function. Built one at a time so that at most three optimizers' state
    is alive (BERT-base: 0.9 GB of parameters and gradients + at most 2.2 GB of state)."""
    import torch

    from scaleout.optim import LAMB, LARS

    def g(wd: float) -> list[dict[str, Any]]:
        return [{**groups[0], "weight_decay": wd}, dict(groups[1])]

    def lamb_clip() -> Any:
        opt = LAMB(g(0.01), lr=1e-3, clip_grad_norm=1.0)  # NVIDIA BERT clips the global norm at 1.0
        return opt.step

    out: dict[str, Any] = {
        "AdamW foreach": lambda: torch.optim.AdamW(g(0.01), lr=1e-3, foreach=True).step,
        "SGD momentum foreach": lambda: (
            torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True).step
        ),
    }
    try:
        import torch_optimizer

        out["torch-optimizer Lamb"] = lambda: torch_optimizer.Lamb(g(0.01), lr=1e-3).step
    except ImportError:
        print(
            "torch-optimizer not installed: its Lamb is left out (pip install torch-optimizer)",
            file=sys.stderr,
        )
    out["scaleout LAMB"] = lambda: LAMB(g(0.01), lr=1e-3).step
    out["scaleout LAMB clip=1"] = lamb_clip
    out["scaleout LARS"] = lambda: LARS(g(5e-5), lr=0.1).step
    out["AdamW fused"] = lambda: torch.optim.AdamW(g(0.01), lr=1e-3, fused=True).step
    out["SGD momentum fused"] = lambda: (
        torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True).step
    )
    out["scaleout LAMB onepass"] = lambda: LAMB(g(0.01), lr=1e-3, onepass=True).step
    out["scaleout LARS onepass"] = lambda: LARS(g(5e-5), lr=0.1, onepass=True).step
    if compiled:
        out["scaleout LAMB onepass compiled"] = lambda: _compiled_step(
            LAMB(g(0.01), lr=1e-3, onepass=True)
        )
        out["scaleout LARS onepass compiled"] = lambda: _compiled_step(
            LARS(g(5e-5), lr=0.1, onepass=True)
        )
    for c in chunks:
        out[f"scaleout LAMB chunk={c}"] = lambda c=c: LAMB(g(0.01), lr=1e-3, chunk=c).step
        out[f"scaleout LARS chunk={c}"] = lambda c=c: LARS(g(5e-5), lr=0.1, chunk=c).step
    return out


def _check_compiled() -> float:
    """Largest relative difference, over 3 steps on small shapes, between the one-pass LAMB/LARS
    compiled on the CPU and their eager kernels (compiling happens here)."""
    import torch

    from scaleout.optim import LAMB, LARS

    worst = 0.0
    for make in (
        lambda gs: LAMB(gs, lr=1e-3, weight_decay=0.01, onepass=True),
        lambda gs: LARS(gs, lr=0.1, weight_decay=5e-5, onepass=True),
    ):
        finals = []
        for compiled in (False, True):
            params, groups = _make([(64, 48), (48,), (300, 7)], seed=1)
            opt = make(groups)
            step = _compiled_step(opt) if compiled else opt.step
            gen = torch.Generator().manual_seed(2)
            for _ in range(3):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen) * 1e-3
                step()
            finals.append([p.detach().clone() for p in params])
        for a, b in zip(*finals, strict=True):
            worst = max(worst, float((a - b).abs().max() / b.abs().max()))
    return worst


def _time_model(
    model: str, repeats: int, chunks: list[int], compiled: bool = False
) -> list[dict[str, Any]]:
    """Each contender runs in rounds with both baselines (AdamW, SGD): per-round ratios are
    paired."""

    import torch

    from scaleout.optim.bytecount import step_bytes

    shapes = shapes_of(model)
    params, groups = _make(shapes)
    facts = _factories(params, groups, chunks, compiled)
    base = {k: facts[k]() for k in BASELINES}
    times: dict[str, list[float]] = {k: [] for k in facts}
    ratios: dict[str, dict[str, list[float]]] = {k: {b: [] for b in BASELINES} for k in facts}
    contenders = [k for k in facts if k not in BASELINES]
    with torch.no_grad():
        for fn in base.values():
            fn()  # warm-up: allocates state
        nbytes = {k: step_bytes(fn, params)[0] for k, fn in base.items()}
        for i, name in enumerate(contenders):
            step = facts[name]()
            step()
            nbytes[name] = step_bytes(step, params)[0]
            samples = interleave(
                {**base, name: step},
                repeats,
                alternate=False,
                say=lambda line, i=i, name=name: print(
                    f"  {model}: {name} ({i + 1}/{len(contenders)}){line}",
                    file=sys.stderr,
                    flush=True,
                ),
            )
            for k, ts in samples.items():
                times[k] += [t.wall for t in ts]
                for b in BASELINES:
                    ratios[k][b] += [t.wall / u.wall for t, u in zip(ts, samples[b], strict=True)]
            del step, samples
            gc.collect()
    n = sum(math.prod(s) for s in shapes)
    return [
        {
            "model": model,
            "optimizer": k,
            "tensors": len(shapes),
            "params": n,
            "median_ms": statistics.median(ts) * 1e3,
            "bytes_per_param": nbytes[k],
            "vs_adamw": statistics.median(ratios[k]["AdamW foreach"]),
            "vs_sgd": statistics.median(ratios[k]["SGD momentum foreach"]),
            "times_ms": [t * 1e3 for t in ts],
        }
        for k, ts in times.items()
    ]


def _rank_main(rank: int, world_size: int, port: int, model: str, steps: int, queue: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        import torch

        torch.set_num_threads(1)  # world_size processes share the cores, like ranks on a node
        world = scaleout.init(environment="torchrun")
        with torch.no_grad():
            res = _lamb_vs_sharded(world, model, steps)
        world.close()
        queue.put((rank, res))
    except BaseException as e:  # noqa: BLE001 -- name the rank and carry on to the parent
        queue.put((rank, f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _lamb_vs_sharded(world: World, model: str, steps: int) -> dict[str, Any]:
    """This rank's LAMB step and the sharded LAMB's phases on the same gradients, every rank busy
    at once."""
    import torch

    from scaleout.optim import LAMB, ShardedLAMB, state_bytes

    params, groups = _make(shapes_of(model), seed=0)
    g = torch.Generator().manual_seed(100 + world.rank)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    groups[0]["weight_decay"] = 0.01
    opt = LAMB(groups, lr=1e-3)
    lamb = interleave({"lamb": opt.step}, steps, warmup=1, world=world, slowest=False)["lamb"]
    res: dict[str, Any] = {
        "lamb_ms": statistics.median(t.wall for t in lamb) * 1e3,
        "lamb_state_bytes": state_bytes(opt),
    }
    del opt
    sharded = ShardedLAMB(groups, world, lr=1e-3)

    def step() -> dict[str, float]:
        sharded.step()
        return dict(sharded.timings)

    phases = [
        t.value
        for t in interleave({"sharded": step}, steps, warmup=1, world=world, slowest=False)[
            "sharded"
        ]
    ]
    res.update({f"{k}_ms": statistics.median(p[k] for p in phases) * 1e3 for k in phases[0]})
    res["sharded_state_bytes"] = state_bytes(sharded)
    return res


def _sharded(world_size: int, model: str, steps: int) -> list[dict[str, Any]]:
    from scaleout.env import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, model, steps, queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    print(
        f"  sharded LAMB: {world_size} ranks, {model} shapes, {steps} timed steps ...",
        file=sys.stderr,
        flush=True,
    )
    got: dict[int, Any] = {}
    while len(got) < world_size:
        rank, res = queue.get(timeout=1800)
        if isinstance(res, str):
            for p in procs:
                p.kill()
            raise RuntimeError(res)
        got[rank] = res
    for p in procs:
        p.join()
    return [got[r] for r in range(world_size)]


def _plot(plt: Any, rows: list[dict[str, Any]]) -> Any:
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models, strict=True):
        rs = [r for r in rows if r["model"] == m]
        ax.barh([r["optimizer"] for r in rs], [r["vs_adamw"] for r in rs])
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_xlabel("step time / AdamW-foreach (median of per-round ratios)")
        ax.set_title(f"{m}: {rs[0]['tensors']} tensors, {rs[0]['params'] / 1e6:.1f} M params")
    fig.tight_layout()
    return fig


def run(args: argparse.Namespace) -> int:
    import torch

    from scaleout.errors import UserError

    models = parse_csv(args.models, "--models", choices=SHAPES, allow_empty=True)
    if not models and args.sharded_ranks <= 0:
        raise UserError(
            f"--models={args.models!r}: expected a comma list of {', '.join(SHAPES)} ('' with "
            "--sharded-ranks)"
        )
    chunks = parse_csv(args.chunks, "--chunks", int, at_least=1, allow_empty=True)
    check_counts(args, repeats=1, threads=0)
    if args.threads:
        torch.set_num_threads(args.threads)
    payload: dict[str, Any] = {"threads": torch.get_num_threads()}
    if args.compiled and models:
        payload["compiled_max_rel_diff"] = diff = _check_compiled()
        print(f"one-pass LAMB/LARS compiled vs eager on the CPU: max rel diff {diff:.2e}")
    rows = [row for m in models for row in _time_model(m, args.repeats, chunks, args.compiled)]
    payload["rows"] = rows
    if rows:
        emit(
            args,
            NAME,
            ["model", "optimizer", "median ms", "x AdamW-foreach", "x SGD-foreach", "B/param"],
            [
                [
                    r["model"],
                    r["optimizer"],
                    r["median_ms"],
                    r["vs_adamw"],
                    r["vs_sgd"],
                    r["bytes_per_param"],
                ]
                for r in rows
            ],
            payload,
            plot=lambda plt: _plot(plt, rows),
        )
    if args.sharded_ranks > 0:
        per_rank = _sharded(args.sharded_ranks, args.sharded_model, args.sharded_steps)
        payload["sharded"] = {
            "ranks": args.sharded_ranks,
            "model": args.sharded_model,
            "per_rank": per_rank,
        }
        print(
            f"\nsharded LAMB, {args.sharded_ranks} ranks, {args.sharded_model} shapes (all ranks "
            "busy at once in both "
            "columns)"
        )
        emit(
            args,
            NAME,
            [
                "rank",
                "LAMB step ms",
                "sharded update ms",
                "x LAMB",
                "comm ms (pack+rs+norms+ag)",
                "reduce-scatter ms",
                "all-gather ms",
                "state MiB",
                "x LAMB state",
            ],
            [_sharded_row(r, res) for r, res in enumerate(per_rank)],
            payload,
        )
    return 0


def _sharded_row(rank: int, res: dict[str, Any]) -> list[Any]:
    comm = sum(
        res.get(f"{k}_ms", 0.0) for k in ("pack", "reduce_scatter", "norm_allreduce", "all_gather")
    )
    return [
        rank,
        res["lamb_ms"],
        res["update_ms"],
        res["update_ms"] / res["lamb_ms"],
        comm,
        res["reduce_scatter_ms"],
        res["all_gather_ms"],
        res["sharded_state_bytes"] / 2**20,
        res["sharded_state_bytes"] / res["lamb_state_bytes"],
    ]
