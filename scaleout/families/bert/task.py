"""``BertTask``: BERT pre-training (MLM + NSP) on packed or padded sequences, in memory (synthetic,
pydoc) or read lazily from MLPerf shards (wikipedia); metric = masked-LM accuracy."""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from scaleout.data.batches import MicroBatch, to_device
from scaleout.data.sampler import make_sampler
from scaleout.errors import ConfigError
from scaleout.families.bert.convert import load_init_checkpoint
from scaleout.families.bert.data.batches import BertBatches, SequenceTable, ShardBertBatches
from scaleout.families.bert.data.bert_batch import build_batch
from scaleout.families.bert.data.bert_sources import load_bert_data, to_bert_sequences
from scaleout.families.bert.data.shard_source import open_shards
from scaleout.families.bert.flops import batch_flops
from scaleout.families.bert.kernels import choose_attention
from scaleout.families.bert.model import BertForPreTraining
from scaleout.families.bert.packing.assign import assign_sequences
from scaleout.families.bert.packing.hist import histogram_from_lengths
from scaleout.families.bert.packing.pack import pack_histogram
from scaleout.families.task import Counts, Task
from scaleout.log import print0
from scaleout.store_share import share

if TYPE_CHECKING:
    from scaleout.config.schema import Config
    from scaleout.world import World


class BertTask(Task):
    def __init__(self, cfg: Config, world: World):
        super().__init__(cfg, world)
        d, b = cfg.data, cfg.model.bert
        if d.max_seq_len > b.max_position:
            raise ConfigError(
                f"data.max_seq_len={d.max_seq_len} exceeds model.bert.max_position={b.max_position}"
            )
        self.stream: Any = None
        self.step_counts: np.ndarray | None = None
        # MLPerf shards, read lazily (scaleout/families/bert/data/shard_source.py)
        if d.source == "wikipedia":
            self._open_shards(cfg, world)
        else:
            self._load_in_memory(cfg, world)
        # model.bert.static_shapes unset: on exactly when the step is captured in a CUDA graph (the
        # fixed-slot MLM/NSP heads cost a few padded rows; graphs need them, eager/compile need not)
        static = b.static_shapes if b.static_shapes is not None else cfg.model.cuda_graphs
        self.info["bert_static_shapes"] = bool(static)
        model = BertForPreTraining(b.model_copy(update={"static_shapes": bool(static)}))
        # micro-batches count their FLOPs with the heads this model runs
        self.batches.flops = functools.partial(batch_flops, model.cfg)
        # rank 0 checks and reads the file and the trainer broadcasts its weights; the others
        # touch no file, they learn its layout (or its one-line error) through the store
        if cfg.model.init_checkpoint:
            path = cfg.model.init_checkpoint
            self.info["init_checkpoint"] = share(
                world, "init-checkpoint", lambda: load_init_checkpoint(model, path)
            )
        self.model = model.to(world.device)

    def _open_shards(self, cfg: Config, world: World) -> None:
        """Training stream and eval share from the shard index: nothing per sequence is loaded up
        front."""
        if cfg.data.order != "scaleout":
            raise ConfigError(
                f"data.order={cfg.data.order}: the MLPerf shards are read in scaleout's order only "
                "(data.order=scaleout)"
            )
        data = open_shards(
            cfg, world.rank, world.world_size, world.barrier, TorchCollectives(world)
        )
        self.stream, self.eval_seqs, self.depth = data.stream, data.eval, data.depth
        self.step_counts = data.step_counts
        self.rows, self.max_pred = data.stream.total, data.stream.max_pred
        self.sequences_per_row = data.sequences_per_row
        self.info["data"], self.info["packing"] = (
            {k: v for k, v in data.info.items() if k != "packing"},
            data.info["packing"],
        )
        self.batches = ShardBertBatches(data.stream)

    def _load_in_memory(self, cfg: Config, world: World) -> None:
        """pydoc / synthetic: every sequence in memory (small data sets)."""
        d = cfg.data
        # The corpus, tokenizer and samples are built once per node and cached: local rank 0 builds
        # while the others wait, then they load the cache instead of all doing the same minutes of
        # work.
        if world.local_rank == 0:
            data = load_bert_data(cfg)
        world.barrier()
        if world.local_rank != 0:
            data = load_bert_data(cfg)
        self.info["data"] = {k: v for k, v in data.info.items() if k != "cache"}
        self.train_seqs = to_bert_sequences(data.train)
        self.eval_seqs = to_bert_sequences(data.eval[: d.eval_samples])
        self.lengths = np.array([len(s) for s in self.train_seqs], dtype=np.int64)
        if d.packing != "none":
            strategy = pack_histogram(
                histogram_from_lengths(self.lengths, d.max_seq_len),
                d.max_seq_len,
                d.max_per_pack,
                d.packing,
            )
            self.packs = assign_sequences(strategy, self.lengths, seed=d.seed).packs()
            self.depth = d.max_per_pack
            self.info["packing"] = {
                "algorithm": strategy.algorithm,
                "efficiency": float(strategy.efficiency),
                "speedup": float(strategy.speedup),
            }
        else:
            self.packs = [[i] for i in range(len(self.train_seqs))]
            self.depth = 1
        self.rows = len(self.packs)
        self.sequences_per_row = sum(len(p) for p in self.packs) / max(self.rows, 1)
        self.pack_tokens = np.array(
            [int(self.lengths[p].sum()) for p in self.packs], dtype=np.int64
        )
        self.pack_sizes = np.array([len(p) for p in self.packs], dtype=np.int64)
        self.sampler = make_sampler(
            d.order, self.rows, cfg.train.global_batch, world.rank, world.world_size, seed=d.seed
        )
        self.max_pred = d.max_predictions * self.depth
        self.batches = BertBatches(
            SequenceTable(self.train_seqs),
            self.packs,
            self.pack_tokens,
            self.sampler,
            d.max_seq_len,
            self.max_pred,
            self.depth,
        )

    def choose_kernels(self) -> None:
        """model.bert.attention=auto: the faster attention kernel for this run's device, dtype
        and shape (a probe on synthetic tensors before run_start, the same choice on every
        rank)."""
        precision = self.precision.dtype if self.precision is not None else None
        chosen = choose_attention(self.model, self.cfg, self.world, precision)
        self.info["attention"] = chosen
        print0(f"attention: {chosen['kernel']} ({chosen['reason']})", rank=self.world.rank)

    def loss(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        return model(mb.inputs).loss

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> float:
        d = self.cfg.data
        return evaluate_mlm(
            model, self.eval_seqs, d.max_seq_len, d.max_predictions, self.world, self.autocast
        )

    def samples_per_step(self, position: int) -> tuple[int, int]:
        if self.stream is not None:
            step, within = divmod(position, self.cfg.train.global_batch)
            if self.step_counts is not None and not within and step < len(self.step_counts):
                return int(self.step_counts[step, 0]), int(self.step_counts[step, 1])
            return self.stream.global_counts(position)
        idx = self.sampler.global_indices(position)
        return int(self.pack_sizes[idx].sum()), int(self.pack_tokens[idx].sum())

    @property
    def eval_size(self) -> int:
        return len(self.eval_seqs)

    def epoch_of(self, samples: int) -> int:
        # MLPerf BERT counts "epochs" in samples (the reference logs samples as epoch_num)
        return samples


@torch.no_grad()
def evaluate_mlm(
    model: torch.nn.Module,
    eval_seqs: Any,
    max_len: int,
    max_pred: int,
    world: Any,
    autocast: Any = contextlib.nullcontext,
) -> float:
    """Masked-LM accuracy over ``eval_seqs`` (padded rows, each rank a strided share, one
    all-reduce). ``world`` needs ``rank``, ``world_size`` and ``device`` only, so a plain torch
    script (the baseline of ``scaleout bench ttt``) evaluates with exactly this function."""
    mine = list(range(world.rank, len(eval_seqs), world.world_size))
    counts = Counts(world)
    bs = 64
    was_training = model.training
    model.eval()
    for i in range(0, len(mine), bs):
        batch = build_batch(eval_seqs, [[j] for j in mine[i : i + bs]], max_len, max_pred, 1)
        with autocast():
            out = model(to_device(batch, world.device))
        counts.add(out.mlm_correct, out.mlm_total)
    model.train(was_training)
    return counts.ratio()


class TorchCollectives:
    """:func:`open_shards`'s collectives on the world's default group (start-up only)."""

    def __init__(self, world: World):
        self.world = world

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0, device=self.world.device)
        return box[0]

    def sum(self, array: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(np.ascontiguousarray(array, np.int64)).to(self.world.device)
        dist.all_reduce(t)
        return t.cpu().numpy()
