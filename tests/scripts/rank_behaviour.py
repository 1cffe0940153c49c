"""A rank program for launcher-supervision tests.

Writes its pid (and a grandchild's pid) to $PID_DIR, then behaves per argv[1]:
  ok        exit 0 after a moment
  exit3     rank $TARGET exits 3 after 1 s, the others sleep (must be stopped by the launcher)
  sleep     every rank sleeps (the test sends SIGTERM to the launcher, or SIGKILLs a rank)
  ignoreterm  like sleep, but ignores SIGTERM (the launcher must SIGKILL after its grace period)
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
if mode == "exit3" and rank == target:
    time.sleep(1.0)
    sys.exit(3)
time.sleep(300)
