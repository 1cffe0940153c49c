"""A Horovod-style training script. The only change from a horovod.torch script is the import line.

scaleout launch --nnodes 2 --nproc-per-node 2 -- python tests/horovod/hvd_train.py --out w.pt
SCALEOUT_ALGORITHM=torus2d mpiexec -n 4 python tests/horovod/hvd_train.py --out w.pt
"""

from __future__ import annotations

import argparse

import torch

import scaleout.horovod as hvd  # was: import horovod.torch as hvd


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    x = torch.randn(8, 6, generator=g)
    return x, x[:, :1] * 2 - x[:, 1:2]


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 1))


def train(steps: int = 6, passes: int = 1, compression: str = "none") -> dict[str, torch.Tensor]:
    torch.manual_seed(
        hvd.rank()
    )  # deliberately different on every rank: broadcast_parameters fixes it
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    opt = hvd.DistributedOptimizer(
        opt,
        named_parameters=model.named_parameters(),
        backward_passes_per_step=passes,
        compression=hvd.Compression.fp16 if compression == "fp16" else hvd.Compression.none,
    )
    for step in range(steps):
        opt.zero_grad()
        for micro in range(passes):
            x, y = batch(step, micro, hvd.rank())
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference(size: int, steps: int = 6, passes: int = 1) -> dict[str, torch.Tensor]:
    """The same training in one process: rank 0's init, gradient = mean over ranks of the summed
    passes."""
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        total = sum(
            torch.nn.functional.mse_loss(model(x), y)
            for r in range(size)
            for m in range(passes)
            for x, y in [batch(step, m, r)]
        )
        (total / size).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--passes", type=int, default=1)
    args = p.parse_args()
    hvd.init()
    weights = train(passes=args.passes)
    if hvd.rank() == 0:
        torch.save(weights, args.out)
        print(
            f"hvd_train: size {hvd.size()} local_size {hvd.local_size()} cross_size "
            f"{hvd.cross_size()} algorithm {hvd.algorithm()}",
            flush=True,
        )
    hvd.shutdown()


if __name__ == "__main__":
    main()
