"""The production script on the real local Slurm (slurm/bert_256node.sh, shrunk on the command line
with the tiny model):

- `sbatch -N 2 --ntasks-per-node 2 slurm/bert_256node.sh <tiny overrides>` runs on the 2 nodes it
  got, without launch.nnodes, and the full recipe on 2x2 is refused in one line before any srun;
- its ranks run inside OCI containers (launch.container.bundle -> `srun --container`, Slurm 22.05
  + runc, the oci.conf launchers/slurm_local/start.sh writes) from a bundle the test builds (a
  rootfs bind-mounting the host's /usr, /lib*, /etc, the checkout and the interpreter; host
  network), and again after a requeue.

Slurm 22.05 runs one container task per node ("unexpected number of tasks 2 > 1" otherwise), so
the OCI job has one rank per node. Nothing is mocked.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from scaleout.launchers.slurm import sbatch
from tests.goodput.test_preempt_slurm import _tiny
from tests.slurmutil import REPO, wait_for_text

pytestmark = pytest.mark.slurm
SCRIPT = "slurm/bert_256node.sh"


def _tiny_without_shape(steps: int) -> list[str]:
    """The tiny model as overrides of the big config, minus the node shape (it comes from the
    allocation now), with a schedule for its batch."""
    return [
        *(o for o in _tiny() if not o.startswith(("launch.nnodes=", "launch.nproc_per_node="))),
        f"train.max_steps={steps}",
        f"optim.total_steps={steps}",
        "optim.warmup_steps=2",
        f"train.eval_every={steps}",
        "train.target=0.001",
        "train.global_batch=16",
        "checkpoint.every_steps=2",
        "data.num_workers=0",
    ]


def _submit(cluster, tmp: Path, nodes: int, tpn: int, overrides: list[str]) -> tuple[int, Path]:
    name = f"i42-{uuid.uuid4().hex[:6]}"
    out = tmp / f"{name}.out"
    env = {**cluster.env, "RUN_ROOT": str(tmp), "PYTHONPATH": str(REPO)}
    opts = [f"--chdir={REPO}", f"--job-name={name}", f"--nodes={nodes}"]
    opts += [f"--ntasks-per-node={tpn}", f"--output={out}"]
    job = sbatch([*opts, SCRIPT, *overrides], env=env)
    return job, out


def test_bert_256node_refuses_its_unshrunk_schedule_on_a_small_allocation(slurm_cluster, tmp_path):
    """The Bar, its refusal half: the unshrunk recipe on `sbatch -N 2 --ntasks-per-node 2
    slurm/bert_256node.sh` stops with one line (exit 2) before any srun. The other half (the shrunk
    recipe completes without launch.nnodes, the node count from the allocation) is
    tests/goodput/test_preempt_slurm.py::test_bert_256node_requeue_resume_resubmit_and_mlperf_log,
    which runs the same script that way through a requeue and a resubmission."""
    refused, refused_out = _submit(slurm_cluster, tmp_path, 2, 2, [])
    try:
        refused_state = slurm_cluster.wait(refused, timeout_s=120)
    finally:
        slurm_cluster.run(["scancel", str(refused)], check=False)
    said = refused_out.read_text()
    assert refused_state == "FAILED", said
    assert slurm_cluster.info(refused).get("ExitCode") == "2:0", slurm_cluster.info(refused)
    lines = [ln for ln in said.splitlines() if "its schedule is for 256x8 GPUs" in ln]
    assert len(lines) == 1 and "expected train.global_batch=8" in lines[0], said
    assert "attempt" not in said, said  # no step was started


def test_h100_scripts_shrink_on_the_command_line(slurm_cluster):
    """The DGX H100 scripts' headers (up to 434 nodes) are accepted on the 4-node cluster once
    -N/--ntasks-per-node override them."""
    scripts = sorted(REPO.glob("slurm/bert_h100_*node.sh"))
    assert len(scripts) == 4, scripts
    for script in scripts:
        p = slurm_cluster.run(
            ["sbatch", "--test-only", "-N", "2", "--ntasks-per-node", "2", str(script)], check=False
        )
        assert p.returncode == 0 and "to start at" in p.stderr, (script, p.stderr)


def _bundle(root: Path) -> Path:
    """An OCI bundle whose rootfs is the host's own files, bind-mounted: /usr, /lib*, /bin, /sbin,
    /etc, /var, /tmp (the run directory), /dev/shm (torch's shared memory), the interpreter's
    prefix and the checkout; a new mount namespace only (host network, PIDs and host name)."""
    bundle = root / "bundle"
    (bundle / "rootfs").mkdir(parents=True)
    subprocess.run(["runc", "spec", "--bundle", str(bundle)], check=True)
    spec = json.loads((bundle / "config.json").read_text())
    proc = spec["process"]
    proc.update(terminal=False, cwd="/", args=["true"])
    proc["env"] = [
        f"PATH={Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
        f"HOME={os.environ.get('HOME', '/root')}",
    ]
    proc.pop("rlimits", None)  # the job's limits, not runc's default 1024 open files
    spec.pop("hostname", None)
    spec["linux"]["namespaces"] = [{"type": "mount"}]
    spec["linux"].pop("resources", None)
    keep = [m for m in spec["mounts"] if m["destination"] not in ("/sys/fs/cgroup", "/dev/shm")]
    host = [
        "/usr",
        "/lib",
        "/lib64",
        "/bin",
        "/sbin",
        "/etc",
        "/var",
        "/tmp",
        "/dev/shm",
        sys.prefix,
        os.path.realpath(sys.prefix),
        str(REPO),
        str(root),
    ]
    seen: set[str] = set()
    for path in host:
        if os.path.islink(path) and path.count("/") == 1:  # /lib -> usr/lib (merged /usr)
            os.symlink(os.readlink(path), bundle / "rootfs" / path[1:])
        elif os.path.isdir(path) and path not in seen:
            seen.add(path)
            keep.append(
                {"destination": path, "type": "bind", "source": path, "options": ["rbind", "rw"]}
            )
    spec["mounts"] = keep
    spec["root"] = {"path": "rootfs", "readonly": False}
    (bundle / "config.json").write_text(json.dumps(spec, indent=1))
    return bundle


class _Containers:
    """Polls runc's state folder for the job's containers (<node>.<user>.<job>.<step>.<task>)."""

    def __init__(self, state: Path, job: int):
        self.root, self.job = state / "run" / "oci", job
        self.seen: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            p = subprocess.run(
                ["runc", f"--root={self.root}", "list", "--format", "json"],
                capture_output=True,
                text=True,
            )
            for c in json.loads(p.stdout or "null") or []:
                if f".{self.job}." in c["id"] and c["status"] == "running":
                    self.seen.append((time.time(), c["id"]))
            time.sleep(0.5)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def nodes(self, after: float = 0.0) -> set[str]:
        return {cid.split(".")[0] for t, cid in self.seen if t >= after}


def _container_job(cluster, tmp_path: Path, overrides: list[str]):
    """The shrunk script on 2 nodes x 1 task in runc containers from a fresh bundle, and a watch
    on runc's state: (job, its log, the bundle, the watch)."""
    if shutil.which("runc") is None:
        pytest.skip("runc is not installed (scripts/setup.sh --test installs it)")
    oci_conf = cluster.local.state / "etc" / "oci.conf"
    assert oci_conf.is_file(), "the local Slurm was started without oci.conf: scaleout slurm down"
    bundle = _bundle(tmp_path)
    overrides = [*overrides, f"launch.container.bundle={bundle}"]
    job, out = _submit(cluster, tmp_path, 2, 1, overrides)
    return job, out, bundle, _Containers(cluster.local.state, job)


def _ended(cluster, job: int, watch: _Containers) -> None:
    watch.stop()
    cluster.run(["scancel", str(job)], check=False)


@pytest.mark.timeout(300)
def test_bert_256node_trains_inside_oci_containers(slurm_cluster, tmp_path):
    """CI's sibling of the requeue bar below (same script, same bundle, minutes less): 3 steps,
    every rank in a runc container Slurm started, seen on both nodes while it trains."""
    overrides = [*_tiny_without_shape(3), "checkpoint.every_steps=0"]
    job, out, _, watch = _container_job(slurm_cluster, tmp_path, overrides)
    try:
        state = slurm_cluster.wait(job, timeout_s=240)
    finally:
        _ended(slurm_cluster, job, watch)
    text = out.read_text()
    assert state == "COMPLETED", text[-4000:]
    assert watch.nodes() == {"n1", "n2"} or len(watch.nodes()) == 2, watch.seen[:10]
    report = json.loads((tmp_path / out.stem / "report.json").read_text())
    assert report["status"] == "success" and report["devices"] == 2, report


@pytest.mark.extended  # minutes: python3 -m pytest -m extended
@pytest.mark.timeout(1500)
def test_bert_256node_trains_inside_oci_containers_and_requeues(slurm_cluster, tmp_path):
    """The Bar: the shrunk production script with launch.container.bundle: every rank runs in a
    runc container Slurm started (seen in runc's state while it trains, on both nodes), the job
    is requeued mid-run (`scontrol requeue`: SIGTERM through runc to the rank, which saves), the
    requeued job's ranks run in containers again and resume to the end."""
    steps = 12
    job, out, bundle, watch = _container_job(slurm_cluster, tmp_path, _tiny_without_shape(steps))
    try:
        wait_for_text(out, r"checkpoint: step 4 ->", timeout_s=400)
        before = watch.nodes()
        requeued_at = time.time()
        slurm_cluster.run(["scontrol", "requeue", str(job)])
        slurm_cluster.release_requeued(job, restart=1, timeout_s=180)
        state = slurm_cluster.wait(job, timeout_s=600)
    finally:
        _ended(slurm_cluster, job, watch)
    text = out.read_text()
    assert state == "COMPLETED", text[-4000:]
    assert before == {"n1", "n2"} or len(before) == 2, (before, watch.seen[:10])
    assert len(watch.nodes(after=requeued_at + 1)) == 2, watch.seen[-10:]
    assert f"--container={bundle}" not in text  # srun's options are not echoed; the log is clean
    resumed = [int(s) for s in re.findall(r"resumed from .* at step (\d+)", text)]
    assert len(resumed) == 1 and 4 <= resumed[0] < steps, text[-4000:]
    report = json.loads((tmp_path / out.stem / "report.json").read_text())
    assert report["status"] == "success" and report["devices"] == 2, report
