"""What a rank's process looks like from inside (tests/launchers/test_forkrank.py): prints one
``FACTS {json}`` line, then exits as its first argument says (``ok``, ``exit3``, ``raise``)."""

import json
import os
import signal
import sys

import torch

fds = []
for name in os.listdir("/proc/self/fd"):
    try:
        os.fstat(int(name))  # listdir's own descriptor is closed by now
        fds.append(int(name))
    except OSError:
        pass
watched = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGPIPE,
)
facts = {
    "rank": os.environ.get("RANK"),
    "argv": [os.path.basename(sys.argv[0]), *sys.argv[1:]],
    "name": __name__,
    "own_session": os.getsid(0) == os.getpid() == os.getpgid(0),
    "ppid": os.getppid(),
    "start": os.environ.get("SCALEOUT_RANK_START"),
    "stdin": os.readlink("/proc/self/fd/0"),
    "fds": sorted(fds),
    "handlers": {s.name: repr(signal.getsignal(s)) for s in watched},
    "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "torch_threads": torch.get_num_threads(),
    "omp": os.environ.get("OMP_NUM_THREADS"),
    "path0": sys.path[0],
    "env_from_launch": os.environ.get("FACTS_MARK"),
    "stdout_unbuffered": sys.stdout.write_through or sys.stdout.line_buffering,
    "encodings": [(s.encoding, s.errors) for s in (sys.stdin, sys.stdout, sys.stderr)],
    "cmdline": open("/proc/self/cmdline", "rb").read().split(b"\0")[1:4],
}
facts["cmdline"] = [x.decode() for x in facts["cmdline"]]
print("FACTS " + json.dumps(facts, sort_keys=True), flush=True)
how = sys.argv[1] if len(sys.argv) > 1 else "ok"
if how == "exit3":
    sys.exit(3)
if how == "raise":
    raise RuntimeError("boom from the rank")
