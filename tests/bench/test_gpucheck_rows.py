"""The rows of scripts/gpu-check.sh cannot pass on what the flagship does not run (review
gpu-day-two §7). No GPU exists here: each row's own logic runs on CPU with the GPU's part mocked,
and each mock is named in its test (tests/fakecuda.FakeGraphs for the CUDA-graph API, a fake
``nvidia-smi`` and a fake Nsight Compute output, the device count patched)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from fakecuda import FakeGraphs

from scaleout.bench import _gpuchecks as g
from scaleout.bench import _gpuflagship as fl
from scaleout.bench.gpucheck import listed_gpus
from tests.bench.test_gpucheck import fake_nvidia_smi

TINY = dict(vocab_size=512, hidden=32, layers=2, heads=2, intermediate=64, max_position=64)
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.multi_process  # runs the fake nvidia-smi
def test_environment_fails_when_torch_sees_fewer_gpus_than_nvidia_smi_lists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fake nvidia-smi lists 8 GPUs, torch is made to see 1 (CUDA_VISIBLE_DEVICES=0 left set on
    an 8-GPU box): the environment row FAILs and says so; with all 8 visible it passes."""
    lines = [f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})" for i in range(8)]
    fake = fake_nvidia_smi(tmp_path, lines)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    listed = listed_gpus()
    assert len(listed) == 8
    name, result, number, _ = fl.environment_row(1, listed, "1 x H100", "")
    assert result == "FAIL" and "sees 1 of the 8 GPUs" in number and "'0'" in number, number
    assert fl.environment_row(8, listed, "8 x H100", "")[1] == "PASS"
    assert fl.environment_row(0, [], "no CUDA device", "")[1] == "SKIP"


def _zeroing_step(dp: Any, loss_fn: Any, optimizer: Any = None, precision: Any = None) -> Any:
    """data_parallel_step whose reducer leaves the gradients zeroed: the loss is unchanged."""
    from scaleout.train.capture import data_parallel_step

    real = dp.reducer.reduce_now

    def broken() -> None:
        real()
        for p in dp.module.parameters():
            if p.grad is not None:
                p.grad.zero_()

    dp.reducer.reduce_now = broken
    return data_parallel_step(dp, loss_fn, optimizer, precision)


@pytest.mark.multi_process  # a World of one in this process
def test_capture_row_compares_gradients_and_the_optimizer_step() -> None:
    """torch.cuda's graph API is mocked (FakeGraphs: the capture's body runs on CPU, a replay does
    nothing). The row passes for the real step and FAILs for a step whose reducer zeroes the
    gradients, though its loss is the same (the old row compared the loss only)."""
    import scaleout

    world = scaleout.init(environment="single")
    try:
        with FakeGraphs():
            [good] = fl.check_capture(world, "cpu", TINY)
            [bad] = fl.check_capture(world, "cpu", TINY, step_fn=_zeroing_step)
    finally:
        world.close()
    assert good[1] == "PASS", good
    assert bad[1] == "FAIL" and "grads 1.0e+00" in bad[2], bad
    loss_diff = float(bad[2].split("loss ")[1].split(",")[0])
    assert loss_diff <= fl.CAPTURE_LOSS_RTOL, bad  # the loss alone would have passed


@pytest.mark.unit
def test_resnet_decode_row_fails_without_torchvision_when_the_flagship_decodes_on_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torchvision made unimportable (a mock of a machine without it): SKIP for a config that does
    not need it, FAIL when the ResNet flagship (data.decode: gpu) does."""
    import scaleout.families.resnet.data.gpu_decode as gd
    from scaleout.errors import ConfigError

    def missing() -> None:
        raise ConfigError("data.decode=gpu needs torchvision built for this torch (mocked)")

    monkeypatch.setattr(gd, "require_torchvision", missing)
    assert fl.needs_gpu_decode() == (
        yaml.safe_load((ROOT / "configs/resnet50_128x8.yaml").read_text())["data"]["decode"]
        == "gpu"
    )
    [(_, result, number, _)] = g.check_gpu_decode("cpu", required=True)
    assert result == "FAIL" and "the ResNet flagship sets data.decode=gpu" in number, number
    assert g.check_gpu_decode("cpu", required=False)[0][1] == "SKIP"


NCU_CSV = """==PROF== Connected to process 1234
params=1000
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","python","h","k1","1","7","(256, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","Kbyte","24.00"
"0","1","python","h","k1","1","7","(256, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","16,000"
"1","1","python","h","k2","1","7","(256, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","Mbyte","0.001"
"""  # noqa: E501  (Nsight Compute's --csv layout; the numbers are made up: no GPU here)


@pytest.mark.unit
def test_optimizer_bytes_are_measured_not_declared() -> None:
    """Bytes per parameter come from Nsight Compute's DRAM counters (a made-up ncu CSV here: no GPU
    or ncu exists on this machine), or the row SKIPs saying why: never a count of the kernels'
    operands, which is what the optimizer itself declares."""
    assert fl.parse_ncu_bytes(NCU_CSV) == 24_000 + 16_000 + 1_000
    with pytest.raises(ValueError, match="no dram__bytes_read.sum"):
        fl.parse_ncu_bytes("==PROF== nothing profiled\n")
    per = {"lamb": (44.0, ""), "adamw": (28.0, ""), "lars": (20.0, ""), "sgd": (20.0, "")}
    row = fl.bytes_row("lamb", "adamw", 1.5, per.get)
    assert row[1] == "FAIL" and "44.0 vs 28.0 B/param = 1.57x" in row[2], row
    assert fl.bytes_row("lars", "sgd", 1.5, per.get)[1] == "PASS"
    unmeasured = fl.bytes_row("lamb", "adamw", 1.5, lambda n: (None, "ncu not on PATH"))
    assert unmeasured[1] == "SKIP" and "ncu" in unmeasured[2]


@pytest.mark.unit
def test_training_and_mfu_rows_run_what_the_bert_flagship_runs() -> None:
    """The training row's run takes the flagship's comm section (and sharded/graph switches) and
    checkpoints; the MFU bar is applied at the flagship's per-GPU rows (global batch / GPUs)."""
    cfg = yaml.safe_load((ROOT / "configs/bert_large_256x8.yaml").read_text())
    args = fl.train_row_args("/tmp/x", "bf16", 10)
    assert f"comm.algorithm={cfg['comm']['algorithm']}" in args
    assert "comm.algorithm=flat" not in args or cfg["comm"]["algorithm"] == "flat"
    assert "checkpoint.dir=/tmp/x/ckpt" in args and "checkpoint.every_steps=5" in args
    gpus = cfg["launch"]["nnodes"] * cfg["launch"]["nproc_per_node"]
    assert fl.per_gpu_rows() == cfg["train"]["global_batch"] // gpus // cfg["train"]["grad_accum"]
    [(name, _, number, expected)] = g.check_bert_large("cpu", TINY, rows=1, max_rows=2)
    assert "1 rows/GPU" in name and number.startswith("1 rows: ") and "largest 2 rows" in number
    assert expected.endswith("at 1 rows"), expected


@pytest.mark.unit
def test_checkpoints_in_lists_step_files(tmp_path: Path) -> None:
    assert fl.checkpoints_in(tmp_path / "none") == []
    for step in (5, 10):
        (tmp_path / f"ckpt-{step:08d}.pt").write_bytes(b"")
    assert fl.checkpoints_in(tmp_path) == ["ckpt-00000005.pt", "ckpt-00000010.pt"]
