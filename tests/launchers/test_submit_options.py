"""`--slurm KEY=VAL` pass-through (account, qos, constraint, ... for `scaleout submit` and `sweep
--launcher slurm|submit`) and `sweep --resume`.

The local Slurm has no accounts or QOS configured, so the pass-through of those is checked in what
would be submitted (the sbatch command line, submitit's generated #SBATCH script); one real
submission through each path carries a harmless option, --comment, and Slurm's own record of the job
shows it.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from scaleout.cli import main
from scaleout.errors import UserError
from scaleout.launchers import LaunchOptions, make_launcher
from scaleout.launchers.slurm import SlurmLauncher, sbatch_flags
from scaleout.launchers.submit import SubmitSpec, make_executor, parse_slurm_options
from scaleout.launchers.sweep import _finished
from scaleout.sweep import SweepPoint

# synthetic images: the sweep's plumbing, not resnet_cpu's Fashion-MNIST (written on first use)
TINY = [
    "data.source=synthetic",
    "data.prepare=none",
    "data.num_workers=0",
    "model.resnet.bn_group=1",
    "model.resnet.width=4",
    "model.resnet.image_size=16",
    "data.eval_samples=16",
]
SHORT_SWEEP = ["--steps", "2", "--warmup", "1", "--per-rank-batch", "4", "--no-png"]
OPTS = ["account=proj", "qos=high", "--constraint=a100", "exclusive", "mail_type=END"]


@pytest.mark.unit
def test_parse_slurm_options() -> None:
    got = parse_slurm_options(OPTS)
    assert got == {
        "account": "proj",
        "qos": "high",
        "constraint": "a100",
        "exclusive": True,
        "mail_type": "END",
    }
    assert sbatch_flags(got) == [
        "--account=proj",
        "--qos=high",
        "--constraint=a100",
        "--exclusive",
        "--mail-type=END",
    ]
    for bad in ("=x", "acc ount=x", "account=", "9x=1"):
        with pytest.raises(
            UserError, match=re.escape(f"--slurm {bad!r}: expected KEY=VALUE or KEY")
        ):
            parse_slurm_options([bad])


@pytest.mark.unit
def test_sweep_slurm_runner_passes_options_to_sbatch(tmp_path: Path) -> None:
    options = LaunchOptions(slurm=parse_slurm_options(OPTS), time_min=5, gpus=False)
    launcher = make_launcher("slurm", options)
    assert isinstance(launcher, SlurmLauncher)
    args = launcher.sbatch_args(["scaleout", "train", "x.yaml"], 2, 2, tmp_path / "log")
    wrap = args.index("--wrap")
    assert args[wrap - 5 : wrap] == [
        "--account=proj",
        "--qos=high",
        "--constraint=a100",
        "--exclusive",
        "--mail-type=END",
    ]
    with pytest.raises(UserError, match="sbatch options need --launcher slurm or submit"):
        make_launcher("local", LaunchOptions(slurm={"account": "proj"}))
    with pytest.raises(UserError, match="--netns works with --launcher local, not slurm"):
        make_launcher("slurm", LaunchOptions(rate="1gbit"))
    gpu = make_launcher("slurm", LaunchOptions(time_min=5, gpus=True)).sbatch_args(
        ["scaleout", "train"], 2, 2, tmp_path / "log"
    )
    assert "--gpus-per-node=2" in gpu and not any(
        "gpus-per-task" in a for a in gpu
    )  # every rank sees its node's GPUs


@pytest.mark.slurm
def test_submitit_script_carries_the_options(
    slurm_cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The #SBATCH lines submitit would submit (sbatch of the local cluster on PATH, nothing
    submitted)."""
    import submitit

    monkeypatch.setenv("SLURM_CONF", slurm_cluster.env["SLURM_CONF"])
    spec = SubmitSpec(
        argv=["smoke"],
        cluster="slurm",
        folder=str(tmp_path / "%j"),
        extra_slurm=parse_slurm_options(OPTS),
    )
    ex = make_executor(spec)
    script = submitit.slurm.slurm._make_sbatch_string(
        command="true", folder=str(tmp_path), **ex.parameters
    )
    for line in (
        "#SBATCH --account=proj",
        "#SBATCH --qos=high",
        "#SBATCH --constraint=a100",
        "#SBATCH --exclusive",
        "#SBATCH --mail-type=END",
        "#SBATCH --requeue",
    ):
        assert line in script.splitlines(), script
    gpu = make_executor(
        SubmitSpec(argv=["smoke"], cluster="slurm", folder=str(tmp_path / "%j"), gpus_per_node=8)
    )
    gpu_script = submitit.slurm.slurm._make_sbatch_string(
        command="true", folder=str(tmp_path), **gpu.parameters
    )
    assert (
        "#SBATCH --gpus-per-node=8" in gpu_script.splitlines() and "gpus-per-task" not in gpu_script
    ), gpu_script
    with pytest.raises(
        UserError, match="sbatch options, but this job runs on submitit's local executor"
    ):
        make_executor(SubmitSpec(argv=["smoke"], cluster="local", extra_slurm={"qos": "high"}))


def _comment_of_jobs_named(cluster, name: str) -> list[str]:
    out = cluster.run(["scontrol", "show", "job", "--oneliner"], check=False).stdout
    return [
        m.group(1)
        for line in out.splitlines()
        if f"JobName={name} " in line
        for m in [re.search(r"Comment=(\S+)", line)]
        if m
    ]


@pytest.mark.slurm
def test_real_submissions_carry_a_comment(slurm_cluster, tmp_path: Path) -> None:
    """One real job per path: `scaleout submit` (submitit) and `sweep --launcher slurm` (sbatch)."""
    tag = f"eco{tmp_path.name[-12:]}".replace("_", "")
    p = slurm_cluster.run(
        [
            sys.executable,
            "-m",
            "scaleout",
            "submit",
            "--command",
            "smoke --numel 1000",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "1",
            "--no-gpu-request",
            "--time",
            "5",
            "--executor",
            "slurm",
            "--name",
            f"sub-{tag}",
            "--folder",
            str(tmp_path / "sub" / "%j"),
            "--slurm",
            f"comment={tag}",
        ],
        timeout_s=300,
        check=False,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert _comment_of_jobs_named(slurm_cluster, f"sub-{tag}") == [tag]
    out = tmp_path / "sweep"
    argv = [
        sys.executable,
        "-m",
        "scaleout",
        "sweep",
        "resnet_cpu",
        "--world",
        "1",
        *SHORT_SWEEP,
        "--launcher",
        "slurm",
        "--no-gpu-request",
        "--time",
        "5",
        "--out-dir",
        str(out),
        "--slurm",
        f"comment={tag}-sw",
        *TINY,
    ]
    p = slurm_cluster.run(argv, timeout_s=300, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    assert _comment_of_jobs_named(slurm_cluster, "sweep-w001-1x1").count(f"{tag}-sw") == 1


@pytest.mark.full_system
def test_sweep_resume_skips_finished_points(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """An interrupted sweep (here: world 2's result lost) reruns only what is missing; a point
    whose command changed is not taken from the earlier run."""
    out = tmp_path / "sweep"
    argv = [
        "sweep",
        "resnet_cpu",
        "--world",
        "1,2",
        "--nproc-per-node",
        "1",
        *SHORT_SWEEP,
        "--threads-per-rank",
        "1",
        "--out-dir",
        str(out),
        *TINY,
    ]
    assert main(argv) == 0, capsys.readouterr().out
    first = json.loads((out / "sweep.json").read_text())["points"]
    log1 = out / "points" / "w001-1x1" / "launch.log"
    stamp = log1.stat().st_mtime_ns
    (
        out / "points" / "w002-2x1" / "report.json"
    ).unlink()  # as if the sweep had stopped during world 2
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0
    text = capsys.readouterr().out
    assert "[1/2] world 1: done before (--resume)" in text
    assert "[2/2] world 2 = 2 node(s) x 1" in text and "running" in text.split("[2/2]", 1)[1]
    assert log1.stat().st_mtime_ns == stamp  # world 1 was not run again
    again = json.loads((out / "sweep.json").read_text())["points"]
    assert again[0]["step_s"] == first[0]["step_s"] and again[1]["status"] == "ok"
    pdir = out / "points" / "w001-1x1"
    recorded = json.loads((pdir / "point.json").read_text())["argv"]
    point = SweepPoint(1, 1, 1, 4)
    assert _finished(point, pdir, recorded) is not None
    assert _finished(point, pdir, [*recorded, "optim.lr=0.5"]) is None


class _FakeTask:
    def __init__(self, exc: Exception | None):
        self.exc = exc

    def exception(self) -> Exception | None:
        return self.exc


class _FakeJob:
    """What SubmitJob reads of a finished submitit job whose task 3 failed."""

    job_id = "42"
    num_tasks = 4
    paths = type("P", (), {"stdout": "/tmp/42_0_log.out"})()
    error = RuntimeError(
        "Job (task=3) failed during processing with trace:\n----\nTraceback ...\n"
        "RuntimeError: rank 3: scaleout train x.yaml exited with code 2\n\nYou can check full logs"
    )

    def results(self) -> list[int]:
        raise self.error

    def task(self, i: int) -> _FakeTask:
        return _FakeTask(self.error if i == 3 else None)


@pytest.mark.unit
def test_submit_failures_read_one_way() -> None:
    """`scaleout submit` and the sweep once cut a failed job's error differently (the CLI kept
    the last line naming an error or a rank, the sweep the last line: here "You can check full
    logs"). Both now read a result through SubmitJob, which also names the failed rank."""
    from scaleout.launchers.submit import SubmitJob, failure_line

    assert failure_line(_FakeJob.error) == (
        "RuntimeError: rank 3: scaleout train x.yaml exited with code 2"
    )
    res = SubmitJob(_FakeJob(), nproc_per_node=2).result()
    assert res.state == "failed" and res.returncode == 1
    assert (res.failed.rank, res.failed.node, res.failed.local_rank, res.failed.returncode) == (
        3,
        1,
        1,
        2,
    )
    assert res.message == (
        "job 42: failed: RuntimeError: rank 3: scaleout train x.yaml exited with code 2 "
        "(log /tmp/42_0_log.out)"
    )
