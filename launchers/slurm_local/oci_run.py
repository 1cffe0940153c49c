"""oci.conf's RunTimeRun for the local cluster: add the task's own Slurm variables to the container
Slurm 22.05 generated, then ``exec runc run``.

Slurm 22.05 (``srun --container=<bundle>``) copies the bundle's config.json into the step's spool
folder with the step's environment (SLURM_JOB_ID, SLURM_STEP_NODELIST, ...) but not the task's own
(SLURM_PROCID, SLURM_NODEID, SLURM_LOCALID), keeps the bundle's working directory and runs one task
per node ("unexpected number of tasks 2 > 1" otherwise). A rank needs its number and the step's
folder, so this sets: SLURM_NODEID = the node's index in SLURM_STEP_NODELIST, SLURM_PROCID =
SLURM_NODEID (one task per node), SLURM_LOCALID = 0, and the working directory srun was started in
(PWD). A site's oci.conf does the same with its own wrapper (docs/launchers.md, "Containers").

Usage (oci.conf): RunTimeRun="python3 oci_run.py RUNC_ROOT CONTAINER_ID NODE BUNDLE"
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's scaleout (nodelist)

from scaleout.env.nodelist import expand_nodelist  # noqa: E402


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print("oci_run.py: expected RUNC_ROOT CONTAINER_ID NODE BUNDLE", file=sys.stderr)
        return 2
    root, cid, node, bundle = argv
    path = Path(bundle) / "config.json"
    spec = json.loads(path.read_text())
    proc = spec["process"]
    env = dict(e.split("=", 1) for e in proc.get("env", []) if "=" in e)
    nodes = expand_nodelist(env["SLURM_STEP_NODELIST"])
    node_id = nodes.index(node)
    env.update(
        SLURM_NODEID=str(node_id),
        SLURM_PROCID=str(node_id),
        SLURM_LOCALID="0",
        SLURMD_NODENAME=node,
    )
    proc["env"] = [f"{k}={v}" for k, v in env.items()]
    proc["cwd"] = env.get("PWD", proc.get("cwd", "/"))
    path.write_text(json.dumps(spec))
    os.execvp("runc", ["runc", f"--root={root}", "run", cid, "-b", bundle])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
