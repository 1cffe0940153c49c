"""MLPerf ResNet RCPs: the RCP check over seed logs (the real mlperf_logging.rcp_checker, through
scaleout.telemetry.mlperf.check_rcp and ``scaleout mlperf rcp``) and the RCP-backed hyper-parameter
sets
(``scaleout config resnet-rcp``) checked against the package's table."""

from __future__ import annotations

import math

import pytest
import yaml

from scaleout.cli import main
from scaleout.config import load_config
from scaleout.errors import UserError
from scaleout.families.resnet.rcp import bn_group_for_span, rcp_table
from scaleout.telemetry.mlperf import MLPerfLogger, check_rcp
from scaleout.train.hparams import hyperparameters

pytestmark = pytest.mark.unit


def _seed_log(path, batch: int, epochs: int, status: str = "success") -> None:
    """What a seed's run logs for the RCP checker: benchmark, batch, evaluations, run_stop."""
    ml = MLPerfLogger(path)
    ml.cache_clear()
    ml.init_start()
    ml.submission("resnet")
    ml.hyperparameters({"global_batch_size": batch})
    ml.init_stop()
    ml.run_start()
    for e in range(4, epochs + 1, 4):
        ml.eval_accuracy(0.70, epoch_num=e, samples=e * 1_281_167)
    ml.eval_accuracy(0.76, epoch_num=epochs, samples=epochs * 1_281_167)
    ml.run_stop(status)
    ml.close()


def test_rcp_check_over_seeds(tmp_path, capsys):
    """32,768: the RCP converges in ~56 epochs (olympic mean of 10 runs); five seeds at 56 pass,
    five at 40 are faster than the reference allows; an unconverged majority fails; 35,840 (no
    RCP) is interpolated between 32,768 and 49,152."""
    for i, e in enumerate([56, 57, 55, 56, 58]):
        _seed_log(tmp_path / "ok" / f"seed{i}" / "mlperf.log", 32768, e)
    r = check_rcp([tmp_path / "ok"])
    assert r.passed and r.message == "RCP found", r.render()
    assert (r.benchmark, r.ruleset, r.global_batch, r.required_runs) == (
        "resnet",
        "4.0.0",
        32768,
        5,
    )
    assert sorted(r.epochs) == [55, 56, 56, 57, 58]

    fast = [tmp_path / f"fast{i}.log" for i in range(5)]
    for f in fast:
        _seed_log(f, 32768, 40)
    r = check_rcp(fast)
    assert not r.passed and r.message == "RCP found"

    for i, e in enumerate([60, 62, 61]):
        _seed_log(tmp_path / "interp" / f"s{i}" / "mlperf.log", 35840, e)
    r = check_rcp([tmp_path / "interp"])
    assert r.passed and r.message == "RCP Interpolation" and "an RCP claim needs 5" in r.render()

    for i in range(3):
        _seed_log(tmp_path / "bad" / f"s{i}" / "mlperf.log", 32768, 56, "aborted")
    r = check_rcp([tmp_path / "bad"])
    assert not r.passed and "Insufficient convergence" in r.message and math.isinf(r.epochs[0])

    with pytest.raises(UserError, match="at least 3 seed logs"):
        check_rcp(fast[:2])
    with pytest.raises(UserError, match="no such MLPerf log"):
        check_rcp([tmp_path / "nope.log"])

    assert main(["mlperf", "rcp", str(tmp_path / "ok")]) == 0
    assert "PASSED: RCP found" in capsys.readouterr().out
    assert main(["mlperf", "rcp", *map(str, fast)]) == 1


@pytest.mark.parametrize("batch", sorted(rcp_table()))
def test_resnet_rcp_config_logs_the_table_s_hyperparameters(tmp_path, batch):
    """Every RCP batch: the generated config is valid for 8 x 8 GPUs (or 1 x 8 where the batch
    needs it) and the LARS keys its MLPerf log carries are the table's."""
    hp = rcp_table()[batch]
    nodes = 8 if batch % 64 == 0 else 1
    out = tmp_path / "r.yaml"
    assert (
        main(
            [
                "config",
                "resnet-rcp",
                "--global-batch",
                str(batch),
                "--nnodes",
                str(nodes),
                "--nproc-per-node",
                "8",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert yaml.safe_load(out.read_text())["train"]["global_batch"] == batch
    cfg = load_config(str(out))
    spe = math.ceil(1_281_167 / batch)
    logged = hyperparameters(cfg, nodes * 8, "r.yaml", spe)
    assert logged["lars_opt_base_learning_rate"] == hp["opt_base_learning_rate"]
    assert logged["lars_opt_learning_rate_warmup_epochs"] == hp["opt_learning_rate_warmup_epochs"]
    assert logged["lars_opt_momentum"] == hp["opt_momentum"]
    assert logged["lars_opt_weight_decay"] == hp["opt_weight_decay"]
    assert logged["lars_opt_learning_rate_decay_steps"] == hp["opt_learning_rate_decay_steps"]
    assert (logged["lars_opt_end_learning_rate"], logged["lars_epsilon"]) == (1e-4, 0.0)
    assert logged["global_batch_size"] == batch and cfg.model.resnet.label_smoothing == 0.1
    assert cfg.train.eval_every == 4 * spe and cfg.train.max_steps == cfg.optim.total_steps
    per_gpu = batch // (nodes * 8)
    best = min(abs(k * per_gpu - hp["model_bn_span"]) for k in (1, 2, 4, 8))
    assert abs(logged["model_bn_span"] - hp["model_bn_span"]) <= best


def test_resnet_rcp_refuses_a_batch_without_an_rcp(capsys):
    rc = main(
        [
            "config",
            "resnet-rcp",
            "--global-batch",
            "35840",
            "--nnodes",
            "128",
            "--nproc-per-node",
            "8",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "--global-batch 35840: no MLPerf ResNet RCP" in err
    assert "3,264" in err and "65,536" in err
    rc = main(
        ["config", "resnet-rcp", "--global-batch", "3264", "--nnodes", "5", "--nproc-per-node", "8"]
    )
    assert rc == 2 and "not divisible by 40 GPUs" in capsys.readouterr().err


def test_bn_group_closest_to_the_rcp_span():
    assert bn_group_for_span(128, 32, 1024, 8) == 4  # 32 per GPU x 4 = 128
    assert bn_group_for_span(256, 48, 1024, 8) == 4  # 192 or 384: 192 is closer
    assert bn_group_for_span(424, 53, 1280, 8) == 8
    assert bn_group_for_span(204, 51, 16, 8) == 4
    assert bn_group_for_span(1000, 10, 32, 8) == 32  # across whole nodes: 8 x 4 nodes
