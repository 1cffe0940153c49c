"""scaleout bench data: samples/s per CPU core of the trainer's input pipelines, and host cores
per accelerator."""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from typing import Any

import scaleout
from scaleout.argtypes import parse_csv
from scaleout.bench._harness import add_standard_arguments, emit

NAME = "data"
HELP = (
    "input pipeline samples/s per CPU core (packed BERT; JPEG decode paths: PIL float, PIL "
    "reduced-scale uint8, GPU decode's host share, DALI), 0/1/2 workers; host cores per accelerator"
)
DESCRIPTION = """\
Measures the trainer's own input pipeline (the task's micro_batches through
scaleout/train/prefetch.py, exactly what `scaleout train` runs) on this host, for:

  bert128  tokenized BERT samples of the offline pydoc corpus (configs/bert_tiny_cpu.yaml), packed
           (LPFHP, <= 3 per row), collated into packed rows of 128 tokens
  bert512  full-length synthetic BERT samples of 512 tokens (76 mask slots, MLPerf's), the upper
           bound of host work per phase-2 sequence
  resnet-float  ImageNet-like JPEGs (--jpeg-size, quality 90, made with PIL from synthetic
           images and written to a temporary ImageFolder), the host path before issue 27: full
           PIL decode + MLPerf augmentation (random-resized crop to --image-size, flip) +
           normalise to float32 CHW on the host (4 bytes per pixel value to the device)
  resnet   the same JPEGs, today's CPU path (data.decode=cpu): PIL reduced-scale decode
           (Image.draft, the crop still >= the output size) + crop + flip, uint8 HWC out (1 byte
           per value; the device normalises)
  resnet-gpu  the same JPEGs, the host share of data.decode=gpu: read the file, parse the JPEG
           header, decide crop box + flip; decode/crop/resize happen on the GPU (not measured
           here: `scaleout bench gpucheck` has the device's rate)
  resnet-dali  the same JPEGs, data.decode=dali on DALI's CPU back-end (device_id=None): read,
           decode + random-resized crop, resize, flip in DALI's C++ threads, uint8 HWC out (needs
           scaleout[dali]). "workers" = DALI threads (0 = one thread); on a GPU, decode runs
           on nvJPEG ("mixed") and the host keeps the file reads

Each runs synchronously (0 workers: the baseline) and with 1 and 2 worker processes at --prefetch
depths. Two numbers per row: samples/s with a consumer that takes no time (the pipeline's rate), and
samples per CPU-second (CPU time of this process and its workers, from getrusage: robust on a shared
machine, and what "per core" means). Then, with a consumer that sleeps as long as the synchronous
path needs per step (an accelerator as fast as one host core; sleeping uses no CPU, like waiting on
a GPU), the fraction of the consumer's time spent waiting for data: the synchronous path waits about
half the time, a prefetching worker should hide it.

Last, the host:accelerator ratio: host cores needed to feed one accelerator = its samples/s (public
numbers and the issue-27 targets, below; add your own with --accel NAME:PIPELINE=RATE, where
PIPELINE=resnet applies to every resnet-* path) / samples per CPU-second of one core. The "H2D
B/sample" column is what one sample sends to the device (images: pixels, or the JPEG bytes).
Host work per sample does not depend on the model's size, so the tiny model's pipeline is
BERT-large's.

examples:
  scaleout bench data
  scaleout bench data --pipelines resnet --workers 0,1,2 --prefetch 1,4 --steps 12 --batch 32
  scaleout bench data --pipelines resnet-float,resnet,resnet-gpu --workers 0 --steps 10
  scaleout bench data --accel my-npu:resnet=5000
"""

# Per-accelerator training throughput, mixed precision, single GPU (public numbers): ResNet-50 v1.5:
# NVIDIA DeepLearningExamples PyTorch/Classification/ConvNets/resnet50v1.5/README.md, "Training
# performance: NVIDIA DGX A100 (8x A100 80GB)" 1 GPU AMP 2470 img/s; DGX-1 (V100 16GB) 1200 img/s.
# BERT-large pre-training: NVIDIA DeepLearningExamples PaddlePaddle/LanguageModeling/BERT/README.md,
# "Pre-training NVIDIA DGX A100 (8x A100 80GB)" 1 GPU AMP: 694 seq/s at 128, 264 seq/s at 512.
# 2,500 and 3,000 img/s: issue 27's per-A100 target for the input pipeline (MLPerf-class ResNet-50
# submissions train at ~2,500-3,000 img/s per A100).
ACCELERATORS = {
    "A100 (ResNet-50 target, issue 27)": ("resnet", 2500.0),
    "A100 (ResNet-50 target high, issue 27)": ("resnet", 3000.0),
    "A100 (ResNet-50 AMP, NVIDIA DLE)": ("resnet", 2470.0),
    "V100 (ResNet-50 AMP, NVIDIA DLE)": ("resnet", 1200.0),
    "A100 (BERT-large seq 128 AMP, NVIDIA DLE)": ("bert128", 694.0),
    "A100 (BERT-large seq 512 AMP, NVIDIA DLE)": ("bert512", 264.0),
}
PIPELINES = ("bert128", "bert512", "resnet-float", "resnet", "resnet-gpu", "resnet-dali")
RESNET = ("resnet-float", "resnet", "resnet-gpu", "resnet-dali")
SMOKE_ARGS = [
    "--pipelines",
    "bert512",
    "--workers",
    "0,1",
    "--prefetch",
    "1",
    "--steps",
    "2",
    "--batch",
    "2",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--pipelines", default=",".join(PIPELINES), help=f"comma list of {', '.join(PIPELINES)}"
    )
    p.add_argument(
        "--workers", default="0,1,2", help="comma list of worker counts (0 = synchronous baseline)"
    )
    p.add_argument(
        "--prefetch", default="1,4", help="comma list of queue depths for worker rows (default 1,4)"
    )
    p.add_argument("--steps", type=int, default=20, help="steps timed per row (default 20)")
    p.add_argument(
        "--batch", type=int, default=64, help="samples (BERT: packed rows) per step (default 64)"
    )
    p.add_argument(
        "--image-size", type=int, default=224, help="crop size of the augmentation (default 224)"
    )
    p.add_argument(
        "--jpeg-size",
        default="500x375",
        help="synthetic JPEG WxH (default 500x375, a common ImageNet size)",
    )
    p.add_argument("--images", type=int, default=256, help="distinct synthetic JPEGs (default 256)")
    p.add_argument(
        "--accel",
        action="append",
        default=[],
        metavar="NAME:PIPELINE=RATE",
        help="an extra accelerator: samples/s it trains on PIPELINE (repeatable)",
    )
    add_standard_arguments(p, NAME, png=True)


def _accelerators(extra: list[str]) -> dict[str, tuple[str, float]]:
    from scaleout.errors import UserError

    out = dict(ACCELERATORS)
    for spec in extra:
        try:
            name, rest = spec.split(":", 1)
            pipe, rate = rest.split("=", 1)
            out[name] = (pipe, float(rate))
        except ValueError:
            raise UserError(
                f"--accel {spec!r}: expected NAME:PIPELINE=RATE, e.g. h100:resnet=5000"
            ) from None
        if pipe not in PIPELINES or out[name][1] <= 0:
            raise UserError(
                f"--accel {spec!r}: PIPELINE must be one of {', '.join(PIPELINES)} and RATE > 0"
            )
    return out


def _write_jpegs(root: str, n: int, size: str, seed: int = 0) -> float:
    """n synthetic JPEGs (smooth random fields + noise, quality 90) in an ImageFolder; returns
    mean KB."""

    import numpy as np
    from PIL import Image

    from scaleout.errors import UserError

    try:
        w, h = (int(v) for v in size.lower().split("x"))
    except ValueError:
        raise UserError(f"--jpeg-size={size!r}: expected WxH, e.g. 500x375") from None
    rng = np.random.default_rng(seed)
    total = 0
    for split, count in (("train", n), ("val", 2)):
        for i in range(count):
            d = os.path.join(root, split, f"c{i % 4}")
            os.makedirs(d, exist_ok=True)
            low = rng.uniform(0, 255, (h // 32 + 1, w // 32 + 1, 3)).astype(np.uint8)
            img = np.asarray(Image.fromarray(low).resize((w, h), Image.BICUBIC), dtype=np.float32)
            img = np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8)
            path = os.path.join(d, f"{i}.jpg")
            Image.fromarray(img).save(path, quality=90)
            total += os.path.getsize(path) if split == "train" else 0
    return total / max(n, 1) / 1024


def _task(pipeline: str, args: argparse.Namespace, world, tmp: str):
    from scaleout.config import load_config  # deferred: `scaleout bench --list` stays torch-free
    from scaleout.families.resnet.data.gpu_decode import JpegImages  # deferred: as above
    from scaleout.train.task import build_task

    common = [
        f"train.global_batch={args.batch}",
        f"train.max_steps={args.steps * 4 + 4}",
        "checkpoint.dir=null",
        "checkpoint.every_steps=0",
    ]
    if pipeline == "bert128":
        cfg = load_config("bert_tiny_cpu", common)
    elif pipeline == "bert512":
        cfg = load_config(
            None,
            [
                *common,
                "model.arch=bert",
                "data.source=synthetic",
                "data.max_seq_len=512",
                "data.max_predictions=76",
                "data.packing=lpfhp",
                "data.eval_samples=8",
                "model.bert.hidden=16",
                "model.bert.layers=1",
                "model.bert.heads=2",
                "model.bert.intermediate=32",
                "model.bert.max_position=512",
            ],
        )
    else:  # the resnet-* paths: one ImageFolder task, its image source swapped per path
        cfg = load_config(
            None,
            [
                *common,
                "model.arch=resnet",
                "data.source=images",  # imagenet would check for 1,000 classes
                f"data.path={tmp}",
                "model.resnet.depth=18",
                "model.resnet.width=4",
                "model.resnet.num_classes=4",
                f"model.resnet.image_size={args.image_size}",
                "data.eval_samples=2",
                *(["data.decode=dali"] if pipeline == "resnet-dali" else []),
            ],
        )
    task = build_task(cfg, world)
    if pipeline == "resnet-float":
        task.batches.images = FloatImages(task.train_set)
    elif pipeline == "resnet-gpu":
        task.batches.images = JpegImages(task.train_set)
        task.prepare_inputs = _unchanged  # the device half (nvJPEG) is not part of the host share
    return task


def _unchanged(x: Any) -> Any:
    return x


class FloatImages:
    """The host path before issue 27, for the comparison: full PIL decode (no Image.draft), crop,
    flip, then normalised float32 CHW on the host (transforms.normalise_reference)."""

    def __init__(self, folder: Any):
        self.folder = folder

    def __len__(self) -> int:
        return len(self.folder)

    def get(self, indices: Any, epoch: int = 0) -> tuple[Any, Any]:
        import numpy as np
        import torch

        from scaleout.families.resnet.data.transforms import load_image, normalise_reference

        f = self.folder
        x = np.stack(
            [
                normalise_reference(
                    load_image(
                        f._open(int(i)),
                        f.image_size,
                        f.train,
                        f.seed,
                        epoch,
                        int(i),
                        f.crop_min_area,
                        draft=False,
                    )[None]
                )[0]
                for i in indices
            ]
        )
        y = torch.tensor([int(f.labels[int(i)]) for i in indices], dtype=torch.long)
        return torch.from_numpy(x), y


def _input_bytes(x: Any) -> int:
    """Bytes one micro-batch's inputs send to the device (a JpegBatch: its encoded files)."""
    from scaleout.families.resnet.data.gpu_decode import JpegBatch
    from scaleout.train.prefetch import _nbytes

    if isinstance(x, JpegBatch):
        return x.data.nbytes
    return _nbytes(x)


def _cpu_s() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def _measure(task, args, workers: int, prefetch: int, start: int, consumer_s: float) -> dict:
    """Steps ``start`` .. ``start + args.steps``: the first one warms up (worker start-up)
    untimed, the rest are timed. Returns samples, wall and data-wait seconds of the timed steps,
    and CPU seconds of this process and its workers (worker start-up included: a fork from the
    warm forkserver costs little CPU, mostly wall; the forkserver's own one-time start-up is not
    counted)."""

    from scaleout.families.resnet.data.dali import DaliInput  # deferred: torch
    from scaleout.train.prefetch import Prefetcher

    cpu0 = _cpu_s()
    dali = task.cfg.data.decode == "dali"  # DALI's threads are this process's: RUSAGE_SELF
    pf = (
        DaliInput(
            task,
            args.batch,
            1,
            start,
            start + args.steps + 1,
            threads=max(workers, 1),
            prefetch=prefetch,
            device="cpu",
        )
        if dali
        else Prefetcher(
            task,
            args.batch,
            1,
            start,
            start + args.steps + 1,
            num_workers=workers,
            prefetch=prefetch,
        )
        if workers
        else None
    )
    get = (lambda s: pf.get(s)) if pf else (lambda s: task.micro_batches(s * args.batch, 1))  # noqa: E731
    first = sum(mb.samples for mb in get(start))
    n, wait, t0 = 0, 0.0, time.perf_counter()
    for step in range(start + 1, start + args.steps + 1):
        t = time.perf_counter()
        mbs = get(step)
        wait += time.perf_counter() - t
        n += sum(mb.samples for mb in mbs)
        if consumer_s:
            time.sleep(consumer_s)  # the accelerator's step: host idle, as while waiting on a GPU
    wall = time.perf_counter() - t0
    workers_cpu = 0.0
    if dali:
        pf.close()
    elif pf:
        workers_cpu = (
            pf.worker_cpu_s()
        )  # the workers are the forkserver's children: not in RUSAGE_CHILDREN
        pf.close()
    return {
        "samples": n,
        "wall_s": wall,
        "wait_s": wait,
        "cpu_s": _cpu_s() - cpu0 + workers_cpu,
        "cpu_samples": n + first,
    }


def run(args: argparse.Namespace) -> int:
    import torch

    from scaleout.errors import UserError

    pipes = parse_csv(args.pipelines, "--pipelines", choices=PIPELINES)
    workers = parse_csv(args.workers, "--workers", int, at_least=0)
    depths = parse_csv(args.prefetch, "--prefetch", int, at_least=1)
    if args.steps < 2 or args.batch < 1:
        raise UserError(f"--steps={args.steps} must be >= 2 and --batch={args.batch} >= 1")
    accels = _accelerators(args.accel)
    torch.set_num_threads(1)
    configs = [(0, 0)] + [(w, d) for w in workers if w > 0 for d in depths]
    world = _single_rank()
    results: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="scaleout-bench-data-") as tmp:
            kb = (
                _write_jpegs(tmp, args.images, args.jpeg_size)
                if any(p in RESNET for p in pipes)
                else 0.0
            )
            for pipe in pipes:
                results += _pipeline(pipe, _task(pipe, args, world, tmp), args, configs)
    finally:
        world.close()
    per_core = {r["pipeline"]: r["samples_per_cpu_s"] for r in results if r["workers"] == 0}
    base_rate = {r["pipeline"]: r["samples_per_s"] for r in results if r["workers"] == 0}
    ratios = [
        {
            "accelerator": name,
            "pipeline": pipe,
            "samples_per_s": rate,
            "host_samples_per_core_s": per_core[pipe],
            "cores_per_accelerator": rate / per_core[pipe],
        }
        for name, (family, rate) in accels.items()
        for pipe in per_core
        if pipe == family or pipe.startswith(family + "-")
    ]
    payload = {
        "args": {k: v for k, v in vars(args).items() if not k.startswith("_") and not callable(v)},
        "rows": results,
        "host_cores_per_accelerator": ratios,
        "synthetic_jpeg_mean_kb": kb,
    }
    emit(
        args,
        NAME,
        [
            "pipeline",
            "workers",
            "prefetch",
            "samples/s",
            "x sync",
            "samples/CPU-s",
            "data wait (accel = 1 core)",
            "H2D B/sample",
        ],
        [
            [
                r["pipeline"],
                r["workers"],
                r["prefetch"] or "-",
                r["samples_per_s"],
                r["samples_per_s"] / base_rate[r["pipeline"]],
                r["samples_per_cpu_s"],
                f"{r['data_wait_fraction']:.0%}",
                round(r["h2d_bytes_per_sample"]),
            ]
            for r in results
        ],
        payload,
        plot=lambda plt: _plot(plt, results),
    )
    if ratios:
        print()
        emit(
            args,
            NAME,
            [
                "accelerator",
                "pipeline",
                "its samples/s",
                "host samples/core-s",
                "host cores needed",
            ],
            [
                [
                    r["accelerator"],
                    r["pipeline"],
                    r["samples_per_s"],
                    r["host_samples_per_core_s"],
                    r["cores_per_accelerator"],
                ]
                for r in ratios
            ],
            payload,
        )
    return 0


def _single_rank() -> Any:
    """A one-rank World (the tasks take one), whatever launcher variables are around."""

    from scaleout.env import free_port

    for k, v in (
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_RANK", "0"),
        ("LOCAL_WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", str(free_port())),
    ):
        os.environ.setdefault(k, v)
    return scaleout.init()


def _pipeline(
    pipe: str, task: Any, args: argparse.Namespace, configs: list[tuple[int, int]]
) -> list[dict[str, Any]]:
    """Each (workers, prefetch) of one pipeline: its rate with an instant consumer, and the data
    wait of a consumer as slow as the synchronous path (the emulated accelerator)."""

    out: list[dict[str, Any]] = []
    base_step = None
    probe = task.batches.micro_batches(0, 1)[0]
    h2d_per_sample = _input_bytes(probe.inputs) / max(probe.samples, 1)
    for w, d in configs:
        print(
            f"[{pipe}] workers={w} prefetch={d or '-'}: timing {args.steps} steps ...",
            file=sys.stderr,
            flush=True,
        )
        fast = _measure(task, args, w, d or 1, 0, 0.0)
        if base_step is None:
            base_step = (
                fast["wall_s"] / args.steps
            )  # the synchronous step: the emulated accelerator
        slow = _measure(task, args, w, d or 1, args.steps + 1, base_step)
        out.append(
            {
                "pipeline": pipe,
                "workers": w,
                "prefetch": d,
                **{f"fast_{k}": v for k, v in fast.items()},
                **{f"overlap_{k}": v for k, v in slow.items()},
                "samples_per_s": fast["samples"] / fast["wall_s"],
                "samples_per_cpu_s": fast["cpu_samples"] / max(fast["cpu_s"], 1e-9),
                "data_wait_fraction": slow["wait_s"] / slow["wall_s"],
                "emulated_accelerator_step_s": base_step,
                "h2d_bytes_per_sample": h2d_per_sample,
            }
        )
    return out


def _plot(plt: Any, results: list[dict[str, Any]]) -> Any:
    pipes = list(dict.fromkeys(r["pipeline"] for r in results))
    fig, axes = plt.subplots(1, len(pipes), figsize=(4.5 * len(pipes), 3.6), squeeze=False)
    for ax, pipe in zip(axes[0], pipes, strict=True):
        rs = [r for r in results if r["pipeline"] == pipe]
        labels = ["sync" if r["workers"] == 0 else f"{r['workers']}w/p{r['prefetch']}" for r in rs]
        ax.bar(labels, [r["samples_per_s"] for r in rs], color="tab:blue", label="samples/s")
        ax.plot(
            labels,
            [r["samples_per_cpu_s"] for r in rs],
            "o-",
            color="tab:orange",
            label="samples/CPU-s",
        )
        ax.set_title(pipe)
        ax.tick_params(axis="x", rotation=45)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    return fig
