"""A real, tiny data-parallel training run that follows the scaleout.goodput.preempt contract
(docs/launchers.md).

Used by tests/launchers/test_slurm.py to prove preemption end to end on the real local Slurm:
signal mid-run
-> agreed stop -> checkpoint -> requeue -> the requeued job resumes -> final weights equal those of
an uninterrupted run. Works under any launcher scaleout.init() knows (srun, scaleout launch,
mpiexec, none).

python tests/scripts/tiny_train.py --ckpt DIR --out final.pt [--steps 40] [--step-sleep 0.1]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

import scaleout
from scaleout.goodput import preempt


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic data: the same (step, rank) gives the same batch in every run and after a
    resume."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def save_atomic(obj: dict, path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)  # a reader never sees a half-written checkpoint


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument(
        "--step-sleep",
        type=float,
        default=0.0,
        help="slow each step down so a signal lands mid-run",
    )
    p.add_argument(
        "--tag", default="", help="ignored; lets a test find this process by its command line"
    )
    args = p.parse_args()

    guard = preempt.install()
    world = scaleout.init(timeout_s=120)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    os.makedirs(args.ckpt, exist_ok=True)
    ckpt = os.path.join(args.ckpt, "latest.pt")
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = state["step"]
    restarts = preempt.restart_count()
    print(
        f"rank {world.rank}/{world.world_size} node {world.node_rank}/{world.num_nodes} "
        f"start step {start} restart {restarts}",
        flush=True,
    )

    def checkpoint(step: int) -> None:
        if world.rank == 0:
            save_atomic(
                {"step": step, "model": model.state_dict(), "optim": opt.state_dict()}, ckpt
            )
            print(
                f"checkpoint step {step} ({guard.received.name if guard.received else 'end'})",
                flush=True,
            )

    done = start
    for step in range(start, args.steps):
        x, y = batch(step, world.rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        try:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world.world_size
        except RuntimeError:
            if not guard.peer_lost():  # a peer left on SIGTERM: wait for ours, else a real failure
                raise
            break  # a peer is gone; the weights are still those after step `done`
        opt.step()
        done = step + 1
        if world.rank == 0:
            print(f"step {done} loss {loss.item():.6f}", flush=True)
        time.sleep(args.step_sleep)
        if done < args.steps and guard.should_stop(world):
            break
    if done < args.steps:
        checkpoint(done)
        if not guard.terminating:
            world.barrier()  # nobody exits before the checkpoint is on disk
            if world.rank == 0:
                print(f"preempted by {guard.received.name} after step {done}; requeue", flush=True)
                preempt.requeue()
        return preempt.EXIT_PREEMPTED
    if world.rank == 0:
        save_atomic({k: v.clone() for k, v in model.state_dict().items()}, args.out)
        print(f"done {done} steps", flush=True)
    world.close()
    guard.uninstall()
    return 0


if __name__ == "__main__":
    sys.exit(main())
