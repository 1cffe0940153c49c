"""``LlamaTask``: next-token prediction on packed rows of ``seq_len`` tokens (documents kept apart),
metric = the evaluation set's log-perplexity (mean next-token cross-entropy, nats), MLPerf's
``llama31_8b`` quality metric (lower is better)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from scaleout.data.batches import MicroBatch
from scaleout.data.sampler import ShardedSampler, make_sampler
from scaleout.errors import ConfigError
from scaleout.families.llama.config import LlamaConfig
from scaleout.families.llama.data.c4 import c4_corpus
from scaleout.families.llama.data.indexed import IndexedTokens
from scaleout.families.llama.data.pydoc import pydoc_corpus
from scaleout.families.llama.data.rows import Rows
from scaleout.families.llama.flops import training_flops
from scaleout.families.llama.fp8 import enable_fp8, require_fp8
from scaleout.families.llama.model import LlamaForCausalLM
from scaleout.families.task import Counts, Task

EVAL_BATCH = 8  # rows per evaluation forward


def _doc_lengths(doc_ids: np.ndarray) -> list[int]:
    """Lengths of the runs of equal ids in one row."""
    cuts = np.flatnonzero(np.diff(doc_ids)) + 1
    return np.diff(np.concatenate(([0], cuts, [len(doc_ids)]))).tolist()


class LlamaBatches:
    """Data only (it pickles: the corpus reopens its memory maps in a worker): this rank's
    micro-batches of rows at a data position."""

    def __init__(self, rows: Rows, sampler: ShardedSampler, c: LlamaConfig):
        self.rows, self.sampler, self.c = rows, sampler, c

    def micro_batches(self, position: int, grad_accum: int) -> list[MicroBatch]:
        out = []
        for part in np.array_split(self.sampler.local_indices(position), grad_accum):
            got = [self.rows[int(i)] for i in part]
            tokens = torch.from_numpy(np.stack([t for t, _ in got]))
            doc_ids = torch.from_numpy(np.stack([d for _, d in got]))
            # without the document mask a row's attention spans the whole row
            lengths = [n for _, d in got for n in _doc_lengths(d)]
            if not self.c.document_mask:
                lengths = [self.c.seq_len] * len(got)
            flops = training_flops(self.c, lengths)
            out.append(
                MicroBatch(
                    {"tokens": tokens, "doc_ids": doc_ids}, None, len(part), tokens.numel(), flops
                )
            )
        return out


def corpus_of(cfg: Any) -> tuple[Any, Any]:
    """(training documents, held-out documents) of ``data.source``: indexed token files, read by
    the trainer and by ``bench ttt``'s plain-torch baseline alike."""
    if cfg.data.source == "c4":  # MLPerf's preprocessed C4 at data.path
        return c4_corpus(cfg.data.path)
    if cfg.data.source == "pydoc":
        # the first rank of a host to take the cache's lock builds; the others then open it
        train, held = pydoc_corpus(cfg.model.llama.vocab_size)
        return IndexedTokens(train), IndexedTokens(held)
    raise ConfigError(f"data.source={cfg.data.source!r}: the llama family reads 'pydoc' or 'c4'")


@torch.no_grad()
def evaluate_rows(
    model: torch.nn.Module, rows: Rows, idx: np.ndarray, world: Any, autocast: Any
) -> float:
    """The held-out log-perplexity (mean nats per predicted token) of ``rows[idx]``, documents
    kept apart, split over the ranks of ``world`` (rank, world_size, device) and all-reduced once;
    ``autocast()`` is the forward's precision context. The family's metric, for the trainer and
    the plain-torch baseline alike."""
    counts = Counts(world)
    was_training = model.training
    model.eval()
    inner = getattr(model, "module", model)
    mine = idx[world.rank :: world.world_size]
    for start in range(0, len(mine), EVAL_BATCH):
        got = [rows[int(i)] for i in mine[start : start + EVAL_BATCH]]
        tokens = torch.from_numpy(np.stack([t for t, _ in got])).to(world.device)
        doc_ids = torch.from_numpy(np.stack([d for _, d in got])).to(world.device)
        with autocast():
            logits = model(tokens, doc_ids)
        nll = inner.loss_of(logits, tokens, doc_ids, reduction="sum")
        counts.add(nll, inner.predicted(tokens, doc_ids))
    model.train(was_training)
    return counts.ratio()


class LlamaTask(Task):
    def __init__(self, cfg: Any, world: Any):
        super().__init__(cfg, world)
        c = cfg.model.llama
        train_docs, eval_docs = corpus_of(cfg)
        self.train_rows = Rows(train_docs, c.seq_len)  # type: ignore[arg-type]
        self.eval_rows = Rows(eval_docs, c.seq_len)
        self.rows = len(self.train_rows)
        if self.rows < cfg.train.global_batch:
            raise ConfigError(
                f"train.global_batch={cfg.train.global_batch}: the corpus holds {self.rows} rows "
                f"of model.llama.seq_len={c.seq_len} tokens"
            )
        self.sampler = make_sampler(
            cfg.data.order,
            self.rows,
            cfg.train.global_batch,
            world.rank,
            world.world_size,
            seed=cfg.data.seed,
        )
        self.batches = LlamaBatches(self.train_rows, self.sampler, c)
        n_eval = min(cfg.data.eval_samples, len(self.eval_rows))
        self.eval_idx = np.arange(n_eval)
        self.model = LlamaForCausalLM(c).to(world.device)
        if c.fp8:
            enable_fp8(self.model, require_fp8(world.device))
        self.info = {
            "rows": self.rows,
            "eval_rows": n_eval,
            "tokens": self.train_rows.corpus.total_tokens,
        }

    def loss(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        x = mb.inputs
        inner = getattr(model, "module", model)  # the family's loss on whatever wraps the model
        # model.llama.document_mask=false: the row as one causal sequence (naive concatenation)
        doc_ids = x["doc_ids"] if self.cfg.model.llama.document_mask else None
        with self.autocast():
            logits = model(x["tokens"], doc_ids)
        return inner.loss_of(logits, x["tokens"], doc_ids)

    def evaluate(self, model: torch.nn.Module) -> float:
        return evaluate_rows(model, self.eval_rows, self.eval_idx, self.world, self.autocast)

    def samples_per_step(self, position: int) -> tuple[int, int]:
        g = self.cfg.train.global_batch
        return g, g * self.cfg.model.llama.seq_len

    @property
    def eval_size(self) -> int:
        return len(self.eval_idx)
