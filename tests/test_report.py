"""Run report and step timers."""

from __future__ import annotations

import time

import pytest
import torch

from scaleout.errors import UserError
from scaleout.report import (
    PEAK_FLOPS,
    RunReport,
    bert_flops_per_token,
    device_peak_flops,
    measure_cpu_peak,
    resnet_flops_per_image,
    valid_flops,
)
from scaleout.timers import Timers


def test_flop_formulas():
    # BERT-large: ~335M params, of which ~302M in the encoder matmuls; 6N + 12 L d s at s = 512
    f = bert_flops_per_token(302_000_000, 24, 1024, 512)
    assert f == 6 * 302e6 + 12 * 24 * 1024 * 512
    assert resnet_flops_per_image() == pytest.approx(3 * 2 * 4.1e9)
    assert resnet_flops_per_image(image_size=112) == pytest.approx(3 * 2 * 4.1e9 / 4)
    with pytest.raises(UserError, match="layers=0"):
        bert_flops_per_token(10, 0, 8, 8)


def test_valid_flops_and_mfu():
    assert valid_flops(100.0, 0.759, 0.759, 5) == 100.0
    assert valid_flops(100.0, 0.70, 0.759, 5) == pytest.approx(100 * (0.70 / 0.759) ** 5)
    r = RunReport(arch="resnet", time_to_train_s=10.0, steps=100, samples=8000, flops_per_sample=1e9,
                  devices=8, achieved=0.74, target=0.759, device_name="A100", peak_flops_per_device=PEAK_FLOPS["A100"])
    assert r.samples_per_s == 800 and r.flops_per_s == 8e11
    assert r.mfu == pytest.approx(8e11 / (8 * 312e12))
    assert r.valid_flops_per_s == pytest.approx(8e11 * (0.74 / 0.759) ** 5)
    assert r.quality_exponent == 5
    text = r.render()
    assert "time to train" in text and "MFU" in text and "Valid" in text
    with pytest.raises(UserError, match="time_to_train_s"):
        RunReport(arch="bert", time_to_train_s=0, steps=1, samples=1, flops_per_sample=1, devices=1)
    assert device_peak_flops("cpu")[1] == PEAK_FLOPS["cpu"]
    assert device_peak_flops("cpu", override=5e12) == ("configured", 5e12)
    assert measure_cpu_peak(0.05, n=128) > 1e6  # positive even on a loaded machine


def test_timers_breakdown_in_report():
    t = Timers("cpu")
    for _ in range(3):
        with t("data"):
            time.sleep(0.002)
        with t("forward"):
            torch.randn(64, 64) @ torch.randn(64, 64)
        with t("backward"):
            time.sleep(0.004)
        t.add("comm", 0.001)
        with t("optimizer"):
            pass
        done = t.step()
        assert set(done) == {"data", "forward", "backward", "comm", "optimizer"}
    m = t.mean()
    assert t.steps == 3 and m["backward"] >= 0.004 and m["data"] >= 0.002 and m["comm"] == pytest.approx(0.001)
    assert m["backward"] > m["data"] > m["optimizer"]
    r = RunReport(arch="bert", time_to_train_s=1.0, steps=3, samples=96, flops_per_sample=1e6, devices=1,
                  real_tokens=5000, breakdown_s=m)
    lines = r.render().splitlines()
    phases = [ln.split("|")[1].strip() for ln in lines if ln.startswith("| ") and "ms/step" not in ln]
    assert phases[-5:] == ["data", "forward", "backward", "comm", "optimizer"]
    assert "real tokens/s" in r.render()
    t2 = Timers()
    t2.load_state_dict(t.state_dict())
    assert t2.mean() == m


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_timers_synchronize_cuda_and_peak_table():
    t = Timers("cuda")
    assert t.sync
    a = torch.randn(8192, 8192, device="cuda")
    with t("forward"):
        for _ in range(4):
            a = a @ a / 8192
    t.step()
    # 4 x 2 x 8192^3 FLOPs = 4.4 TFLOP: even an H100 needs > 4 ms; unsynchronised launches take microseconds
    assert t.mean()["forward"] > 2e-3
    name, peak = device_peak_flops("cuda")
    assert peak in PEAK_FLOPS.values() and name


def test_progress_bar_rank0_and_rate_limited():
    import io

    from scaleout.report import Progress

    out = io.StringIO()
    p = Progress(100, rank=0, stream=out, line_every_s=3600)
    p.update(1, samples=32, loss=7.5)  # first line always
    p.update(2, samples=64)  # rate-limited away
    p.update(50, samples=1600, force=True, mlm_acc=0.25)
    p.update(100, samples=3200)  # the last step always prints
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("step 1/100") and "loss 7.5" in lines[0] and "eta" in lines[0]
    assert "[##########----------]  50%" in lines[1] and "mlm_acc 0.25" in lines[1] and "samples/s" in lines[1]
    assert lines[2].startswith("step 100/100") and "eta" not in lines[2]
    quiet = io.StringIO()
    Progress(10, rank=1, stream=quiet).update(10, force=True)
    assert quiet.getvalue() == ""
