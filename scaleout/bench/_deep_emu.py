"""The ``emu`` part of ``scaleout bench gpudeep``: the rank program of 4 ranks sharing one GPU.

NCCL refuses two ranks on one device, so the ranks talk over gloo on CUDA tensors: gloo's CUDA works
copy on a stream that waits for the issuing thread's current stream and make the waiter's stream
wait on their end, the contract ProcessGroupNCCL gives, so scaleout's comm stream, its thread rule,
the caching allocator and the cross-stream frees all run for real. Launched as 2 emulated nodes x 2
by ``scaleout launch``; every rank writes ``rank<r>.json`` into the folder it is given.

    (a) the real Trainer on bert_tiny_cpu: hierarchical, flat, the node-sharded LAMB: all finish
        and every replica ends with the same weights;
    (b) the weights agree across the algorithms;
    (c) the thread that runs gradient hooks on CUDA (the autograd device thread, not the main one:
        the second issuing thread the CPU emulation cannot model);
    (d) hierarchical again with a delay enqueued on the comm stream first: the same weights (every
        consumer waits on the comm stream's event, not on luck);
    (e) a non-contiguous hierarchical all-reduce while the caller keeps allocating: the right sum
        (its staging copy is kept for the comm stream).
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

import torch

VARIANTS = {
    "hierarchical": ["comm.algorithm=hierarchical"],
    "flat": ["comm.algorithm=flat"],
    "sharded": ["comm.algorithm=flat", "optim.sharded=true", "optim.shard=node"],
    "delayed": ["comm.algorithm=hierarchical"],
}
STEPS = 10
# fp32 sums in another order (flat vs the hierarchy's phases, a sharded LAMB) drift by rounding
# only; 1 % after STEPS steps separates that from a lost or stale bucket (a whole step's update)
ALGO_RTOL = 1e-2


def _train(world: Any, out: Path, name: str) -> torch.Tensor:
    from scaleout.config import load_config
    from scaleout.train.trainer import Trainer

    over = [
        *VARIANTS[name],
        "comm.bucket_mb=0.25",
        "checkpoint.dir=null",
        "checkpoint.every_steps=0",
        f"train.max_steps={STEPS}",
        f"train.eval_every={STEPS}",
        "train.target=null",
        "train.progress=false",
        f"train.output_dir={out / name}",
    ]
    trainer = Trainer(load_config("bert_tiny_cpu", over), world)
    result = trainer.train()
    if result.steps != STEPS:
        raise RuntimeError(f"{name}: {result.steps} steps of {STEPS} ({result.status})")
    return torch.cat([p.detach().float().flatten().cpu() for p in trainer.model.parameters()])


def _delay_comm_stream() -> None:
    """Enqueue ~5 ms of GPU sleep on the comm stream before every schedule (part (d))."""
    from scaleout.comm import handles

    original = handles.on_comm_stream

    def delayed(tensor: torch.Tensor, job: Any, cuda_future: bool = True) -> Any:
        with torch.cuda.stream(handles.comm_stream(tensor.device)):
            torch.cuda._sleep(int(1e7))
        return original(tensor, job, cuda_future)

    handles.on_comm_stream = delayed


def _hook_thread() -> str:
    lin = torch.nn.Linear(8, 8).cuda()
    names: list[str] = []
    lin.weight.register_post_accumulate_grad_hook(
        lambda p: names.append(threading.current_thread().name)
    )
    lin(torch.randn(4, 8, device="cuda")).sum().backward()
    return names[0] if names else "no hook ran"


def _noncontiguous(world: Any) -> bool:
    from scaleout.comm import all_reduce

    n = world.world_size
    base = torch.arange(64 * 32, dtype=torch.float32, device="cuda").view(64, 32)
    x = (base * (world.rank + 1)).t()  # non-contiguous: a staging copy goes out
    handle = all_reduce(x, world, "hierarchical", async_op=True)
    for _ in range(16):  # the caller allocates (and fills) while the comm stream works
        torch.full((64 * 32,), -1.0, device="cuda").mul_(2)
    handle.wait()
    torch.cuda.synchronize()
    return bool(torch.equal(x, base.t() * (n * (n + 1) // 2)))


def main(out: Path) -> None:
    import scaleout

    torch.cuda.set_device(0)
    world = scaleout.init(backend="gloo")  # gloo: every rank on cuda:0 (module docstring)
    world.device = torch.device("cuda", 0)
    report: dict[str, Any] = {"rank": world.rank, "hook_thread": _hook_thread()}
    weights = {}
    for name in VARIANTS:
        if name == "delayed":
            _delay_comm_stream()
        weights[name] = _train(world, out, name)
        w = weights[name].double()
        report[name] = [float(w.sum()), float(w.square().sum())]  # replicas: equal bit for bit
    ref = weights["hierarchical"]
    report["diff"] = {
        name: float((w - ref).abs().max() / ref.abs().max()) for name, w in weights.items()
    }
    report["noncontiguous_ok"] = _noncontiguous(world)
    (out / f"rank{world.rank}.json").write_text(json.dumps(report))
    world.close()


def verdict(ranks: list[dict[str, Any]]) -> tuple[str, str]:
    """The part's row from every rank's report (module docstring, (a)-(e))."""
    replicas = all(r[name] == ranks[0][name] for r in ranks for name in VARIANTS)
    diffs = {name: max(r["diff"][name] for r in ranks) for name in VARIANTS}
    algos = all(d <= ALGO_RTOL for d in diffs.values())
    noncontig = all(r["noncontiguous_ok"] for r in ranks)
    threads = sorted({r["hook_thread"] for r in ranks})
    ok = replicas and algos and noncontig
    return ("PASS" if ok else "FAIL"), (
        f"{len(VARIANTS)} runs x {STEPS} steps; replicas {'agree' if replicas else 'DIFFER'}; vs "
        "hierarchical: "
        + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items() if k != "hierarchical")
        + f" (bar {ALGO_RTOL:g}); non-contiguous all-reduce {'right' if noncontig else 'WRONG'}; "
        f"hook thread {threads}"
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
