"""A user script that trains with scaleout.DataParallel and simply ends (no world.close()).

scaleout launch --nnodes 2 --nproc-per-node 2 -- tests/scripts/exit_without_close.py ALGORITHM
[CALLBACK_S]

CALLBACK_S > 0 also adds a done-callback to one all-reduce handle that is still running Python when
the script ends (the same situation as the reducer's own completion callbacks, made certain instead
of rare).
"""

import sys
import time

import torch

import scaleout
from scaleout.comm import all_reduce

algorithm = sys.argv[1] if len(sys.argv) > 1 else "hierarchical"
callback_s = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
world = scaleout.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
dp = scaleout.DataParallel(model, world, algorithm=algorithm, bucket_mb=0.05)  # several buckets
opt = torch.optim.SGD(dp.parameters(), lr=0.1)
for _ in range(3):
    dp(torch.randn(16, 64)).square().mean().backward()
    opt.step()
    opt.zero_grad()
if callback_s > 0:
    if world.rank == 1:
        time.sleep(
            0.5
        )  # rank 0's handle completes on a gloo worker thread, after its callback is added
    handle = all_reduce(torch.ones(8), world, "flat", async_op=True)
    handle.future.add_done_callback(lambda _f: time.sleep(callback_s))
    handle.wait()
print(f"rank {world.rank}: done", flush=True)
