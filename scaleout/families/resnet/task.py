"""``ResNetTask``: image classification (synthetic images, or a real set as class folders or tar
shards), metric = top-1."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from scaleout.data.batches import MicroBatch, to_device
from scaleout.data.sampler import make_sampler
from scaleout.errors import ConfigError
from scaleout.families.resnet.data import ImageBatches, ImageFolder, SyntheticImages
from scaleout.families.resnet.data.dali import DaliInput, check_dali
from scaleout.families.resnet.data.fashion import ensure_prepared
from scaleout.families.resnet.data.gpu_decode import (
    JpegBatch,
    JpegImages,
    check_gpu_decode,
    decode_on_device,
)
from scaleout.families.resnet.data.prepare import IMAGENET_CLASSES, IMAGENET_VAL
from scaleout.families.resnet.data.shards import NodeShardSampler, ShardImages, has_shards
from scaleout.families.resnet.data.transforms import MEAN, STD
from scaleout.families.resnet.flops import training_flops_per_image
from scaleout.families.resnet.group_bn import sync_batchnorm_stats
from scaleout.families.resnet.imagenet import IMAGENET_TRAIN_IMAGES
from scaleout.families.resnet.layout import use_channels_last
from scaleout.families.resnet.model import build_resnet
from scaleout.families.task import Counts, Task

# Images per evaluation forward (model.resnet.eval_bn=batch normalises each such batch by itself).
EVAL_BATCH = 64
# data.cache_eval: the share of the device's memory (the host's per local rank on CPU) this rank's
# cached evaluation images may take.
EVAL_CACHE_SHARE = 1 / 20
# data.cache_decoded: decoded images kept per rank (split over its workers), as NVIDIA's
# DALI_CACHE_SIZE
DECODED_CACHE_BYTES = 12 << 30

if TYPE_CHECKING:
    from scaleout.config.schema import Config
    from scaleout.world import World


class ResNetTask(Task):
    def __init__(self, cfg: Config, world: World):
        super().__init__(cfg, world)
        r, d = cfg.model.resnet, cfg.data
        check_input_pipeline(cfg, world.device)
        self._norm: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._eval_cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._eval_stream: Any = None  # evaluation's decode stream (CUDA), made on first use
        if d.source in ("imagenet", "images"):
            if d.path and d.prepare == "fashion-mnist":
                ensure_prepared(d.path, world)  # first use: rank 0 writes it, the others wait
            self._open_images(cfg, world)
            self.train_set.crop_min_area = d.crop_min_area
            if d.decode == "gpu":  # workers read bytes + crop boxes; decode in prepare_inputs
                self.train_set, self.eval_set = (
                    JpegImages(self.train_set),
                    JpegImages(self.eval_set),
                )
        elif d.source == "synthetic":
            n = max(cfg.train.global_batch * 256, 4096)
            self.train_set = SyntheticImages(
                r.num_classes, r.image_size, n + d.eval_samples, seed=d.seed, uint8=True
            )
            self.eval_set = self.train_set
            # held out: never in the training range
            self._eval_idx = np.arange(n, n + d.eval_samples)
            self.train_set.length = n
            self.rows = len(self.train_set)
            self.sampler = make_sampler(
                d.order,
                self.rows,
                cfg.train.global_batch,
                world.rank,
                world.world_size,
                seed=d.seed,
            )
        else:
            raise ConfigError(
                f"data.source={d.source!r} is not an image source (expected synthetic, imagenet "
                "or images)"
            )
        self.batches = ImageBatches(self.train_set, self.sampler, self.rows)
        self.model = build_resnet(r, world)
        # forward 2 FLOPs per multiply-add, backward 2x forward; any bn_group (flops.py)
        self.batches.flops_per_image = training_flops_per_image(r)
        self.model = self.model.to(world.device)
        local = cfg.train.global_batch // max(world.world_size * cfg.train.grad_accum, 1)
        self.channels_last = use_channels_last(r, world, local)
        if self.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        tune_convolutions(world.device)

    def input_pipeline(self, start_step: int, stop_step: int) -> DaliInput | None:
        """``data.decode=dali``: the DALI pipeline that replaces the prefetch workers for training
        batches (families/resnet/data/dali.py); otherwise None (the workers or the synchronous
        path). Reads nothing until its ``start()``, after run_start."""
        d, train = self.cfg.data, self.cfg.train
        if d.decode != "dali":
            return None
        return DaliInput(
            self,
            train.global_batch,
            train.grad_accum,
            start_step,
            stop_step,
            threads=d.num_workers,
            prefetch=d.prefetch,
            device=self.world.device,
            rank=self.world.rank,
        )

    def prepare_inputs(self, inputs: Any) -> torch.Tensor:
        """On the device: (GPU decode, then) uint8 NHWC pixels -> float NCHW normalised with the
        ImageNet mean/std, in the model's memory format (channels_last: the permute of NHWC is
        channels_last for free)."""
        return normalise_images(self._pixels(inputs), self._norm, channels_last=self.channels_last)

    def _pixels(self, inputs: Any) -> torch.Tensor:
        """uint8 NHWC pixels on the device: a GPU-decode batch decoded, anything else as it is."""
        if isinstance(inputs, JpegBatch):
            return decode_on_device(inputs, self.world.device)
        return inputs

    def _open_images(self, cfg: Config, world: World) -> None:
        """A real labelled set at data.path, as class folders or tar shards (data.format), opened
        lazily: nothing is listed here (the index is built on the first item access, after
        run_start; scaleout/families/resnet/data/index.py). data.source=imagenet also checks
        ImageNet's counts, and its known size is the training set's size until then."""
        r, d = cfg.model.resnet, cfg.data
        if not d.path:
            raise ConfigError(
                f"data.source={d.source} needs data.path (train/ and val/ class folders, or "
                "train-000000.tar ... shards)"
            )
        shards = d.format == "shards" or (d.format == "auto" and has_shards(d.path))
        if shards and d.decode == "dali":
            raise ConfigError(
                f"data.decode=dali reads the class-folder layout: data.path={d.path} holds tar "
                f"shards (data.format={d.format}); use data.decode=cpu or gpu for shards"
            )
        cls = ShardImages if shards else ImageFolder
        imagenet = d.source == "imagenet"
        workers = max(d.num_workers, 1)
        common = {
            "rank": world.rank,
            "index_root": cfg.train.output_dir,
            "expect_classes": IMAGENET_CLASSES if imagenet else None,
            "cache_bytes": DECODED_CACHE_BYTES // workers if d.cache_decoded else 0,
            "max_classes": r.num_classes,
        }
        self.train_set = cls(
            d.path,
            "train",
            r.image_size,
            seed=d.seed,
            expect_images=IMAGENET_TRAIN_IMAGES if imagenet else None,
            **common,
        )
        self.eval_set = cls(
            d.path,
            "val",
            r.image_size,
            classes_from=self.train_set,
            expect_images=IMAGENET_VAL if imagenet else None,
            **common,
        )
        self.info["data_layout"] = "shards" if shards else "folder"
        # ImageNet's size is known; any other set's is read from its index (metadata, which
        # MLPerf allows before the clock: one file read per rank, rank 0 builds it if missing)
        self.rows = IMAGENET_TRAIN_IMAGES if imagenet else len(self.train_set)
        self._eval_idx = None
        g = cfg.train.global_batch
        if shards:
            if d.order != "scaleout":
                raise ConfigError(
                    f"data.order={d.order}: image shards are read in scaleout's node-local order "
                    "only (data.order=scaleout)"
                )
            nodes = world.ranks_per_node
            node = next(n for n, ranks in enumerate(nodes) if world.rank in ranks)
            self.sampler = NodeShardSampler(
                self.train_set,
                self.rows,
                g,
                world.rank,
                world.world_size,
                node,
                len(nodes),
                nodes[node].index(world.rank),
                len(nodes[node]),
                seed=d.seed,
            )
        else:
            self.sampler = make_sampler(d.order, self.rows, g, world.rank, world.world_size, d.seed)

    @property
    def eval_idx(self) -> np.ndarray:
        """The evaluated val samples: all, or data.eval_samples of them spread evenly over the
        (class-sorted) set, so that every class is in a subset. With model.resnet.eval_bn=batch
        they are in a fixed shuffled order (data.seed, the same on every rank): each eval batch is
        normalised by its own statistics, and a batch cut from the class-sorted list holds one or
        two classes, whose statistics erase what tells them apart (top-1 0.27 instead of 0.83 on
        Fashion-MNIST). The set evaluated is the same either way."""
        if self._eval_idx is None:
            n = len(self.eval_set)
            k = min(self.cfg.data.eval_samples, n)
            idx = np.arange(k, dtype=np.int64) * n // k
            if self.cfg.model.resnet.eval_bn == "batch":
                idx = np.random.default_rng(self.cfg.data.seed).permutation(idx)
            self._eval_idx = idx
        return self._eval_idx

    def loss(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        # label smoothing as the MLPerf reference and NVIDIA train ResNet-50 (model.resnet)
        smoothing = self.cfg.model.resnet.label_smoothing
        return F.cross_entropy(model(mb.inputs), mb.target, label_smoothing=smoothing)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> float:
        w = self.world
        self.sync_buffers()  # every rank evaluates with the same (pooled) BN statistics
        counts = Counts(w)
        was_training = model.training
        model.eval()
        for pixels, y in self._eval_pixels():
            x = self.prepare_inputs(pixels)
            with self.autocast():
                pred = model(x).argmax(1)
            counts.add((pred == y).sum(), len(y))
        model.train(was_training)
        return counts.ratio()

    def _eval_pixels(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's evaluation batches (EVAL_BATCH images) as uint8 NHWC pixels and labels on
        the device. The eval transform is deterministic, so with data.cache_eval (and a share that
        fits eval_cache_budget) they are read and decoded at the first evaluation only."""
        if self._eval_cache is not None:
            yield from self._eval_cache
            return
        w = self.world
        mine = self.eval_idx[w.rank :: w.world_size]
        s = self.cfg.model.resnet.image_size
        fits = len(mine) * s * s * 3 <= eval_cache_budget(w)
        keep: list[tuple[torch.Tensor, torch.Tensor]] | None = (
            [] if self.cfg.data.cache_eval and fits else None
        )
        cuda = torch.device(w.device).type == "cuda"
        decode = self._decode_stream() if cuda else None
        for i in range(0, len(mine), EVAL_BATCH):
            x, y = self.eval_set.get(mine[i : i + EVAL_BATCH])
            with torch.cuda.stream(decode) if cuda else contextlib.nullcontext():
                pair = (self._pixels(to_device(x, w.device)), to_device(y, w.device))
            if cuda:  # the compute stream reads them after the decode stream made them, and
                # their blocks are not handed back to the decode stream while it may still read
                compute = torch.cuda.current_stream(w.device)
                compute.wait_stream(decode)
                for t in pair:
                    t.record_stream(compute)
            if keep is not None:
                keep.append(pair)
            yield pair
        if keep is not None:
            if decode is not None:  # only finished pixels are kept for every later evaluation
                decode.synchronize()
            self._eval_cache = keep

    def _decode_stream(self) -> Any:
        """The stream evaluation batches are decoded on (on CUDA): GPU JPEG decode drains the
        stream it runs on first (gpu_decode.decode_on_device), which must not be the compute
        stream with the model's kernels queued on it."""
        if self._eval_stream is None:
            self._eval_stream = torch.cuda.Stream(self.world.device)
        return self._eval_stream

    def sync_buffers(self) -> None:
        sync_batchnorm_stats(self.model, self.world)

    def samples_per_step(self, position: int) -> tuple[int, int]:
        return self.cfg.train.global_batch, 0

    @property
    def eval_size(self) -> int:
        if self._eval_idx is None and self.cfg.data.source == "imagenet":
            return min(self.cfg.data.eval_samples, IMAGENET_VAL)  # known: no listing for it
        return len(self.eval_idx)

    def epoch_of(self, samples: int) -> int:
        return samples // max(self.rows, 1)


def tune_convolutions(device: torch.device) -> None:
    """On CUDA, let cuDNN benchmark its convolution algorithms (``cudnn.benchmark``): the ResNet
    step's shapes are fixed (one image size, one local batch), so each convolution is timed once
    and the fastest kernel kept, as NVIDIA's MLPerf ResNet does; the default heuristic pick can be
    several times slower for channels_last bf16 convolutions."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True


def normalise_images(
    x: torch.Tensor,
    cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] | None = None,
    channels_last: bool | None = None,
) -> torch.Tensor:
    """uint8 NHWC pixels on any device -> float32 NCHW ``(x / 255 - MEAN) / STD``: the same
    float32 operations the host used to run (transforms.normalise_reference), so equal to it.
    ``cache`` keeps the per-device mean/std tensors (made once per device). ``channels_last``:
    the result's strides (None: channels_last on CUDA only). A float tensor is taken as already
    prepared."""
    if x.dtype != torch.uint8:
        return x
    dev = x.device
    consts = None if cache is None else cache.get(dev)
    if consts is None:
        consts = tuple(
            to_device(torch.from_numpy(a.copy()).view(1, 3, 1, 1), dev) for a in (MEAN, STD)
        )
        if cache is not None:
            cache[dev] = consts
    mean, std = consts
    y = x.permute(0, 3, 1, 2).float().div_(255.0).sub_(mean).div_(std)
    if dev.type == "cuda" if channels_last is None else channels_last:
        return y.contiguous(memory_format=torch.channels_last)  # a no-op for a permuted NHWC
    return y.contiguous()


def check_input_pipeline(cfg: Config, device: torch.device) -> None:
    """Input settings that cannot feed this device, refused in one line before anything runs."""
    d = cfg.data
    if d.decode == "gpu":
        check_gpu_decode(device)
    elif d.decode == "dali":  # its own threads: data.num_workers=0 is one DALI thread
        check_dali(device)
    elif (
        d.source in ("imagenet", "images")
        and d.num_workers == 0
        and torch.device(device).type == "cuda"
    ):
        raise ConfigError(
            f"data.num_workers=0 with data.source={d.source} on a GPU decodes every image on the "
            "training thread (about a tenth of what a GPU trains): set data.num_workers (8-12 "
            "per GPU; scaleout bench data measures it) or data.decode=gpu"
        )


def eval_cache_budget(world: Any) -> int:
    """Bytes of cached evaluation images one rank may keep (data.cache_eval): EVAL_CACHE_SHARE of
    its CUDA device's memory, or of the host's physical memory split over the node's ranks."""
    dev = torch.device(world.device)
    if dev.type == "cuda":
        total = torch.cuda.get_device_properties(dev).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        total //= max(getattr(world, "local_size", 1), 1)
    return int(total * EVAL_CACHE_SHARE)
