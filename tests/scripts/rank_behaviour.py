"""A rank program for launcher-supervision tests.

Writes its pid (and a grandchild's pid) to $PID_DIR, then behaves per argv[1]:
  ok        exit 0 after a moment
  exit3     rank $TARGET exits 3 after 1 s, the others sleep (must be stopped by the launcher)
  sleep     every rank sleeps (the test sends SIGTERM to the launcher, or SIGKILLs a rank)
  ignoreterm  like sleep, but ignores SIGTERM (the launcher must SIGKILL after its grace period)
  verdict   ranks other than $TARGET print the same traceback (C++ frames at per-process
            addresses) and the hang verdict naming rank $TARGET, as failing trainer ranks do; rank
            1 then exits 1 first, the others sleep
"""

import os
import signal
import subprocess
import sys
import time

mode = sys.argv[1]
rank = int(os.environ["SCALEOUT_RANK"])
target = int(os.environ.get("TARGET", "0"))
pid_dir = os.environ["PID_DIR"]
child = subprocess.Popen(["sleep", "300"])  # a grandchild: must not outlive the launcher
with open(os.path.join(pid_dir, f"{rank}.pid"), "w") as f:
    f.write(f"{os.getpid()} {child.pid}\n")
print(
    f"started node={os.environ['SCALEOUT_NODE_RANK']} local={os.environ['SCALEOUT_LOCAL_RANK']}",
    flush=True,
)
if mode == "ignoreterm":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "ok":
    time.sleep(0.5)
    child.kill()
    sys.exit(0)
if mode == "verdict" and rank != target:
    me = f"rank {rank} (node {rank // 2}, local rank {rank % 2})"
    print(
        "Traceback (most recent call last):\n"
        '  File "trainer.py", line 12, in train_step\n'
        "    dist.all_reduce(flags)\n"
        "RuntimeError: Connection closed by peer\n"
        "Exception raised from recvBytes at Utils.hpp:682 (most recent call first):\n"
        f"frame #0: c10::Error::Error() + 0x98 ({hex(id(child))} in libc10.so)\n"
        f"scaleout: {me}: verdict: rank {target} (node {target // 2}, local rank {target % 2}) is "
        "behind: step 5 in data, collective #9 while the others are at #10 (step 5, grad-sync)",
        flush=True,
    )
    if rank == 1:
        time.sleep(1.0)
        sys.exit(1)
if mode == "exit3" and rank == target:
    time.sleep(1.0)
    sys.exit(3)
time.sleep(300)
