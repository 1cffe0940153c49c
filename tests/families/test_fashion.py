"""Fashion-MNIST as PNG class folders (scaleout.families.resnet.data.fashion), the resnet_cpu config
on it, and the `scaleout bench ttt --task resnet` plumbing.

The idx files here are small ones written by the test (a few hundred images), never the 70k of the
installed package; nothing here trains (the time-to-train is `scaleout train
configs/resnet_cpu.yaml` and `scaleout bench ttt --task resnet`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from scaleout.env.base import free_port
from scaleout.errors import UserError
from scaleout.families.resnet.data import ImageFolder, fashion


def _idx_dir(tmp_path: Path, n_train: int = 200, n_val: int = 60) -> tuple[Path, dict]:
    src = tmp_path / "idx"
    src.mkdir()
    rng = np.random.default_rng(0)
    arrays = {}
    for prefix, n in (("train", n_train), ("t10k", n_val)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) * 7 % 10).astype(np.uint8)
        fashion.write_idx(src / f"{prefix}-images-idx3-ubyte.gz", images)
        fashion.write_idx(src / f"{prefix}-labels-idx1-ubyte.gz", labels)
        arrays[prefix] = (images, labels)
    return src, arrays


@pytest.mark.unit
def test_prepare_writes_png_class_folders_once(tmp_path) -> None:
    src, arrays = _idx_dir(tmp_path)
    out = tmp_path / "fm"
    counts = fashion.prepare(out, src)
    assert (counts["train"], counts["val"]) == (200, 60)
    assert sorted(p.name for p in (out / "train").iterdir()) == list(fashion.CLASSES)
    images, labels = arrays["train"]
    for i in (0, 13, 199):  # pixel-exact, in the folder of its label
        png = out / "train" / fashion.CLASSES[labels[i]] / f"{i}.png"
        assert np.array_equal(np.asarray(Image.open(png)), images[i])
    # the reader sees 10 classes in label order, 3-channel 28 px images
    folder = ImageFolder(out, "val", 28)
    assert folder.classes == list(fashion.CLASSES) and len(folder) == 60
    x, y = folder.get(np.array([0, 59]))
    assert x.shape == (2, 28, 28, 3) and x.dtype == torch.uint8 and y.tolist() == [0, 9]  # NHWC
    # a second call reads the marker and writes nothing
    stamp = (out / fashion.MARKER).stat().st_mtime_ns
    t = time.perf_counter()
    assert fashion.prepare(out, src) == counts
    assert time.perf_counter() - t < 0.5 and (out / fashion.MARKER).stat().st_mtime_ns == stamp
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".fm.")]  # no temp dir left


@pytest.mark.unit
def test_prepare_refuses_bad_input(tmp_path) -> None:
    src, _ = _idx_dir(tmp_path, 20, 10)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("mine")
    with pytest.raises(UserError, match="exists without"):
        fashion.prepare(tmp_path / "other", src)
    bad = tmp_path / "bad.gz"
    fashion.write_idx(bad, np.zeros((2, 2), np.uint8))
    bad.write_bytes(bad.read_bytes()[:-3])  # truncated gzip
    with pytest.raises(UserError):
        fashion.read_idx(bad)
    (src / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(UserError, match="cannot read"):
        fashion.prepare(tmp_path / "fm", src)
    assert not (tmp_path / "fm").exists()  # nothing half-written


@pytest.mark.unit
def test_prepare_cli_writes_and_reports(tmp_path, capsys) -> None:
    from scaleout.cli import main

    src, _ = _idx_dir(tmp_path, 30, 10)
    argv = ["data", "prepare-fashion-mnist", "--out", str(tmp_path / "o"), "--source", str(src)]
    assert main(argv) == 0
    assert "30 train and 10 val PNGs in 10 classes" in capsys.readouterr().out


@pytest.mark.unit
def test_eval_bn_batch_evaluates_class_mixed_batches(tmp_path) -> None:
    """model.resnet.eval_bn=batch normalises each eval batch by its own statistics, so a batch must
    be a sample of the val set: cut from the class-sorted folder list it held two classes (Fashion-
    MNIST top-1 0.27 where the running statistics gave 0.83). The eval order is a fixed shuffle
    then, the set evaluated the same, and running statistics keep the sorted order."""
    from types import SimpleNamespace

    from scaleout.config import load_config
    from scaleout.families.resnet.task import ResNetTask

    src, _ = _idx_dir(tmp_path, 64, 320)
    fashion.prepare(tmp_path / "fm", src)
    world = SimpleNamespace(rank=0, world_size=1, num_nodes=1, device=torch.device("cpu"))
    orders = {}
    for mode in ("running", "batch"):
        over = [f"data.path={tmp_path / 'fm'}", "data.prepare=none", "data.eval_samples=320"]
        over += [f"model.resnet.eval_bn={mode}", "model.resnet.memory_format=contiguous"]
        over += [f"train.output_dir={tmp_path / mode}", "train.global_batch=64"]
        task = ResNetTask(load_config("resnet_cpu", over), world)
        labels = task.eval_set.labels[task.eval_idx]
        orders[mode] = task.eval_idx
        # the batches evaluate() forms on this rank: 64 consecutive of its share
        classes = [len(set(labels[i : i + 64].tolist())) for i in range(0, len(labels), 64)]
        if mode == "batch":
            assert min(classes) >= 8, classes
        else:
            assert max(classes) <= 3, classes  # class-sorted: what batch statistics cannot use
    assert sorted(orders["batch"].tolist()) == orders["running"].tolist()


@pytest.mark.unit
def test_resnet_cpu_config_is_fashion_mnist_and_fits_its_world() -> None:
    from scaleout.config import load_config

    cfg = load_config("configs/resnet_cpu.yaml")
    cfg.check_world(cfg.launch.nnodes * cfg.launch.nproc_per_node, cfg.launch.nproc_per_node)
    d, r = cfg.data, cfg.model.resnet
    assert (d.source, d.prepare, d.eval_samples) == ("images", "fashion-mnist", 10000)
    assert (r.depth, r.width, r.image_size, r.num_classes, r.label_smoothing) == (
        18,
        8,
        28,
        10,
        0.1,
    )
    assert cfg.optim.name == "lars" and 0.85 <= cfg.train.target < 1.0
    assert 0.0 < d.crop_min_area < 1.0 and d.num_workers == 1


@pytest.mark.unit
def test_bench_ttt_resnet_plumbing() -> None:
    """--task resnet: its config and recipe, the SGD sweep, the ablation chain, and the commands
    the two sides run (the baseline module, group BN and smoothing written back)."""
    from scaleout.bench import ttt
    from scaleout.bench._ttt_baseline_resnet import parse_args
    from scaleout.bench._ttt_runs import Plan, Recipe, command
    from scaleout.cli import build_parser
    from scaleout.config import load_config

    args = build_parser().parse_args(["bench", "ttt", "--task", "resnet", "--seeds", "1"])
    cfg = ttt.scaleout_config(args)
    assert (args.config, args.budget, args.baseline_lrs) == ("resnet_cpu", 120000, [0.05, 0.1, 0.2])
    assert args.eval_seqs == 15000
    assert (cfg.optim.name, cfg.model.resnet.bn_group, cfg.train.precision) == ("lars", 1, "fp32")
    # scaleout's warm-up share is its config's (40 of 705 steps), not BERT's 0.1
    assert args.warmup == cfg.optim.warmup_steps / cfg.optim.total_steps == 40 / 705
    best = Recipe("baseline", "torch", "sgd", 128, 0.1, 0.1)
    rec = ttt.recipes(args, cfg, 4, 1.0, best)
    assert [c.name for c in rec["chain"]] == ["abl-framework", "abl-lars", "scaleout"]
    # the report labels each step by the row that ran it: scaleout's own row is the comm step
    assert rec["scaleout"].label == rec["chain"][-1].label == "hierarchical all-reduce + overlap"
    args = build_parser().parse_args(
        ["bench", "ttt", "--task", "resnet", "model.resnet.bn_group=2", "train.precision=bf16"]
    )
    cfg = ttt.scaleout_config(args)
    rec = ttt.recipes(args, cfg, 4, 1.0, best)
    chain = [c.name for c in rec["chain"]]
    assert chain == ["abl-framework", "abl-lars", "abl-groupbn", "abl-comm", "scaleout"]
    assert "scaleout-sharded" not in rec
    plan = Plan("resnet_cpu", 0.85, 180000, 30000, 1.0, "none", task="resnet", power=2.0)
    torch_cmd = command(plan, best, 2, Path("o"))
    assert "scaleout.bench._ttt_baseline_resnet" in torch_cmd
    a = parse_args(torch_cmd[torch_cmd.index("--config") :])
    assert (a.global_batch, a.max_steps, a.eval_every) == (128, 1407, 234)
    frame = command(plan, rec["chain"][0], 2, Path("o"))
    ran = load_config(frame[2], frame[3:])
    assert (ran.optim.name, ran.model.resnet.label_smoothing, ran.model.resnet.bn_group) == (
        "sgd",
        0.0,
        1,
    )
    assert ran.model.resnet.eval_bn == "running"  # the baseline's eval: running statistics
    lars = command(plan, rec["chain"][1], 2, Path("o"))
    assert load_config(lars[2], lars[3:]).model.resnet.eval_bn == "batch"  # scaleout's recipe
    full = load_config(*(lambda c: (c[2], c[3:]))(command(plan, rec["scaleout"], 2, Path("o"))))
    assert (full.model.resnet.bn_group, full.optim.power, full.comm.algorithm) == (
        2,
        2.0,
        "hierarchical",
    )
    with pytest.raises(UserError, match="does not fit --task resnet"):
        ttt.scaleout_config(
            build_parser().parse_args(
                ["bench", "ttt", "--task", "resnet", "--config", "bert_tiny_cpu"]
            )
        )


@pytest.mark.unit
def test_baseline_augmentation_is_padded_crop_and_flip(tmp_path) -> None:
    from scaleout.bench._ttt_baseline_resnet import PaddedCropFlip

    for i in range(64):
        (tmp_path / "train" / "c0").mkdir(parents=True, exist_ok=True)
        (tmp_path / "train" / "c3").mkdir(exist_ok=True)
        png = tmp_path / "train" / ("c3" if i else "c0") / f"{i:02d}.png"
        Image.fromarray(np.full((28, 28), 255, np.uint8)).save(png)
    data = PaddedCropFlip(ImageFolder(tmp_path, "train", 28), 28, 4, seed=0)
    assert len(data) == 64
    shifted = 0
    for i in range(64):
        x, y = data[i]
        assert x.shape == (3, 28, 28) and y == (0 if i == 0 else 1)  # c0 first, then c3
        shifted += int(x[0].min() < 0)  # a zero-padded border entered the crop
    assert 32 <= shifted < 64  # most crops move; (4,4) of 81 offsets does not
    assert (data[5][0] == data[5][0]).all()


@pytest.mark.full_system
def test_baseline_script_trains_and_reports_on_png_folders(tmp_path) -> None:
    """The resnet baseline of `bench ttt` end to end (one gloo rank, a few steps on 200 PNGs):
    its data set, loop, evaluation and report. (It once read a file list the lazy index no longer
    has, and only the 3-seed bench found out.)"""
    src, _ = _idx_dir(tmp_path)
    fashion.prepare(tmp_path / "fm", src)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    env["MASTER_PORT"], env["OMP_NUM_THREADS"] = str(free_port()), "1"
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "scaleout.bench._ttt_baseline_resnet", "--lr", "0.05"]
    cmd += ["--global-batch", "32", "--max-steps", "6", "--warmup-steps", "2", "--eval-every", "3"]
    cmd += ["--target", "0.99", "--out", str(out), f"data.path={tmp_path / 'fm'}"]
    cmd += ["data.prepare=none", "data.num_workers=0", "data.eval_samples=60"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 6 and report["samples"] == 192 and report["status"] == "max_steps"
    assert 0.0 <= report["achieved"] <= 1.0 and report["time_to_train_s"] > 0
    log = (out / "mlperf.log").read_text()
    assert log.count('"key": "eval_accuracy"') == 2 and '"key": "run_stop"' in log
