"""The ResNet baseline of ``scaleout bench ttt --task resnet``: the plain torch script a user would
write instead of scaleout.

One process per rank under any torchrun-style launcher (``scaleout launch`` sets RANK, WORLD_SIZE,
...): ``DistributedDataParallel`` (25 MB buckets, its own all-reduce), ``torch.optim.SGD`` with
momentum 0.9 and weight decay (not on BN weights and biases), plain cross-entropy, fp32, linear
warm-up then cosine decay to 0, and torchvision-style augmentation written out without torchvision
(which cannot be imported on CPU-only machines here): ``Resize(S/0.875)`` (the eval's resize),
``RandomCrop(S, padding=--pad)``, ``RandomHorizontalFlip``, then the ImageNet mean/std normalisation
(the eval's center crop is one of the training crops); a
``DistributedSampler`` + ``DataLoader`` (``data.num_workers`` workers) reading the PNGs with PIL.

What it shares with scaleout is what the comparison holds equal: the PNG class folders at
``data.path`` (Fashion-MNIST, written on first use as scaleout train does), the model class
(``scaleout.families.resnet.model.build_resnet`` with the config's ``model.resnet``, plain BN), the
evaluation (scaleout's ``ImageFolder`` val images, top-1 over ``data.eval_samples``) and MLPerf's
clock (``run_start`` -> ``run_stop`` in ``mlperf.log``). Rank 0 also writes ``report.json``.

    scaleout launch --nnodes 2 --nproc-per-node 2 -- \\
        python -m scaleout.bench._ttt_baseline_resnet --lr 0.2 --global-batch 128 \\
        --max-steps 900 --warmup-steps 45 --eval-every 117 --target 0.85 --out runs/b
"""

from __future__ import annotations

import argparse
import math
from types import SimpleNamespace
from typing import Any

import numpy as np

from scaleout.bench._ttt_baseline import (
    _past,
    add_ddp_arguments,
    add_run_arguments,
    checked,
    timed_main,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m scaleout.bench._ttt_baseline_resnet",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_arguments(
        p, config="resnet_cpu", unit="images", target="top-1", seed_help="model initialisation"
    )
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument(
        "--weight-decay", type=float, default=5e-4, help="SGD weight decay (not BN/bias)"
    )
    p.add_argument("--pad", type=int, default=0, help="random-crop zero padding in pixels (0)")
    add_ddp_arguments(p)
    return checked(p, argv)


class PaddedCropFlip:
    """torchvision's ``Resize(size / 0.875)`` + ``RandomCrop(size, padding=pad)`` +
    ``RandomHorizontalFlip()`` + ``ToTensor()`` + ``Normalize(MEAN, STD)`` on the class-foldered
    PNGs, without torchvision."""

    def __init__(self, folder: Any, size: int, pad: int, seed: int):
        # folder: scaleout's ImageFolder (its file index: path(i), labels), the list a user's
        # torchvision ImageFolder would hold
        self.folder, self.size, self.pad, self.seed = folder, size, pad, seed
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch
        from PIL import Image

        from scaleout.families.resnet.data.folder import MEAN, STD

        path, label = self.folder.path(i), int(self.folder.labels[i])
        with Image.open(path) as im:
            big = round(self.size / 0.875)  # as the eval: resize, then crop S
            a = np.asarray(im.convert("RGB").resize((big, big), Image.BILINEAR), np.float32)
        rng = np.random.default_rng([self.seed, self.epoch, i])
        p, s = self.pad, self.size
        a = np.pad(a / 255.0, ((p, p), (p, p), (0, 0)))
        top, left = rng.integers(0, a.shape[0] - s + 1, size=2)
        a = a[top : top + s, left : left + s]
        if rng.random() < 0.5:
            a = a[:, ::-1]
        a = ((a - MEAN) / STD).transpose(2, 0, 1)
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)), label


def _build(a: argparse.Namespace, cfg: Any, rank: int, world: int) -> SimpleNamespace:
    import torch
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from scaleout.families.resnet.data import ImageFolder
    from scaleout.families.resnet.data.fashion import prepare
    from scaleout.families.resnet.model import build_resnet

    d, r = cfg.data, cfg.model.resnet.model_copy(update={"bn_group": 1})
    if d.prepare == "fashion-mnist":  # as scaleout train: written once on first use
        if rank == 0:
            prepare(d.path)
        torch.distributed.barrier()
    train = ImageFolder(d.path, "train", r.image_size, rank=rank)  # the file list only
    evals = ImageFolder(d.path, "val", r.image_size, rank=rank, classes_from=train)
    torch.manual_seed(a.seed)
    model = build_resnet(r)
    ddp = DistributedDataParallel(model, bucket_cap_mb=a.bucket_mb)
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    opt = torch.optim.SGD(
        [{"params": decay, "weight_decay": a.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=a.lr,
        momentum=a.momentum,
    )

    def factor(step: int) -> float:
        if step < a.warmup_steps:
            return (step + 1) / a.warmup_steps
        t = (step - a.warmup_steps) / max(a.max_steps - a.warmup_steps, 1)
        return 0.5 * (1.0 + math.cos(math.pi * min(t, 1.0)))

    data = PaddedCropFlip(train, r.image_size, a.pad, d.seed)
    sampler = DistributedSampler(data, world, rank, shuffle=True, seed=d.seed, drop_last=True)
    loader = DataLoader(
        data,
        batch_size=a.global_batch // world,
        sampler=sampler,
        drop_last=True,
        num_workers=d.num_workers,
        persistent_workers=d.num_workers > 0,
    )
    return SimpleNamespace(
        model=model,
        ddp=ddp,
        opt=opt,
        sched=torch.optim.lr_scheduler.LambdaLR(opt, factor),
        data=data,
        sampler=sampler,
        loader=loader,
        evals=evals,
        eval_idx=np.arange(min(d.eval_samples, len(evals))),
        rank=rank,
        world=world,
    )


def _evaluate(a: argparse.Namespace, run: SimpleNamespace, log: Any, samples: int) -> float:
    import torch
    import torch.distributed as dist

    from scaleout.families.resnet.data.transforms import normalise_reference

    log.block_stop(samples, samples)
    log.eval_start(samples, samples)
    run.model.eval()
    mine = run.eval_idx[run.rank :: run.world]
    counts = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for i in range(0, len(mine), 256):
            x, y = run.evals.get(mine[i : i + 256])  # uint8 NHWC, scaleout's eval crop
            x = torch.from_numpy(normalise_reference(x.numpy()))
            counts += torch.tensor([(run.model(x).argmax(1) == y).sum().item(), len(y)])
    dist.all_reduce(counts)
    run.model.train()
    metric = float(counts[0] / counts[1])
    log.eval_accuracy(metric, samples, samples)
    log.eval_stop(samples, samples)
    if run.rank == 0:
        print(f"samples {samples}: top1 {metric:.4f} (target {a.target})", flush=True)
    return metric


def _loop(
    a: argparse.Namespace, run: SimpleNamespace, log: Any, t0: float
) -> tuple[str, int, int, float | None]:
    import torch.nn.functional as F

    step, samples, metric, status, epoch = 0, 0, None, "max_steps", 0
    log.block_start(0, 1, 0)
    while status == "max_steps" and step < a.max_steps:
        run.sampler.set_epoch(epoch)
        run.data.epoch = epoch  # read by the workers when the epoch's iterator starts
        for x, y in run.loader:
            F.cross_entropy(run.ddp(x), y).backward()
            run.opt.step()
            run.sched.step()
            run.opt.zero_grad(set_to_none=True)
            step, samples = step + 1, samples + a.global_batch
            if step % a.eval_every == 0 or step == a.max_steps:
                metric = _evaluate(a, run, log, samples)
                if metric >= a.target:
                    status = "success"
                    break
                if a.time_budget is not None and _past(t0, a.time_budget):
                    status = "time_budget"
                    break
                log.block_start(samples, 1, samples)
            if step == a.max_steps:
                break
        epoch += 1
    return status, step, samples, metric


def main(argv: list[str] | None = None) -> int:
    return timed_main(
        parse_args(argv),
        _build,
        _loop,
        lambda run: len(run.eval_idx),
        lambda run: {"optimizer": "SGD"},
        "images",
    )


if __name__ == "__main__":
    raise SystemExit(main())
