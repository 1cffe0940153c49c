"""DistributedOptimizer step time with and without tensor fusion, on 2 emulated nodes x 2 gloo
ranks.

    PYTHONPATH=$PWD python tests/horovod/hvd_bench.py [--steps 24]

A model of many small tensors (Linear layers) is where one collective per tensor is latency-bound;
the baseline in the same run is the same engine with HOROVOD_FUSION_THRESHOLD=0 (one all-reduce per
tensor, what the pre-engine shim did). Prints the median step time (max over ranks) per algorithm
and model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn

MODELS = [
    (100, 64),
    (24, 512),
]  # (layers, width): 200 tensors / 1.7 MB, 48 tensors / 25 MB of gradients


def step_ms(world, alg: str, layers: int, width: int, steps: int, fusion: str | None) -> float:
    import scaleout.horovod as hvd

    if fusion is not None:
        os.environ["HOROVOD_FUSION_THRESHOLD"] = fusion
    try:
        hvd.init(world=world, algorithm=alg)
    finally:
        os.environ.pop("HOROVOD_FUSION_THRESHOLD", None)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1e-3), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), 0)
    x = torch.randn(8, width)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    hvd.shutdown()
    return statistics.median(times[steps // 5 :]) * 1e3


def main() -> None:
    from tests.distutil import run_dist

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=24)
    args = p.parse_args()
    print(f"{'algorithm':<13} {'model':<9} {'fused ms':>9} {'unfused ms':>11}")
    for alg in ("flat", "hierarchical"):
        for layers, width in MODELS:
            fused, unfused = (
                max(run_dist(step_ms, 2, 2, args=(alg, layers, width, args.steps, f), timeout=900))
                for f in (None, "0")
            )
            print(f"{alg:<13} {f'{layers}x{width}':<9} {fused:>9.1f} {unfused:>11.1f}", flush=True)


if __name__ == "__main__":
    main()
