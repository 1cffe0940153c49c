"""``scaleout bench ttt --task llama``: scaleout's Llama recipe and the ablation chain from the
plain-torch baseline (``scaleout.bench._ttt_baseline_llama``) to it.

Both sides train the same tiny Llama (configs/llama_tiny_cpu.yaml) on the same rows of the same
Megatron indexed files with AdamW (the config's betas, epsilon, weight decay, clipping) under bf16
autocast and a cosine schedule down to a tenth of the peak, to the same held-out log-perplexity
(lower is better). What differs is what scaleout adds:

* **document masks**: a packed row's documents never attend to each other, positions restart at
  every document and no token is predicted from the previous document
  (``model.llama.document_mask``); the baseline's rows are naive concatenations;
* **the all-reduce**: the hierarchical all-reduce with overlap in 1 MB buckets and the gradients
  on the wire in bf16 (fp32 sums), where the baseline has DDP's fp32 all-reduce;
* **the recipe**: scaleout's batch, learning rate and warm-up (the config's) and its data order.

The chain switches them on one per step: scaleout's trainer with the baseline's recipe (flat
all-reduce, DDP's buckets, no document mask, its ``DistributedSampler`` batches: the framework),
+ document masks, + hierarchical all-reduce + overlap + bf16 wire, + scaleout's recipe
(= scaleout). The sharded row runs AdamW on the sharded LAMB's machinery within the node.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

# scaleout's recipe on top of configs/llama_tiny_cpu.yaml (its AdamW, lr 2e-3, cosine to 2e-4,
# clip 1.0 at 32 rows of 128 tokens, warm-up over 40 of its 400 steps; target log-perplexity 5.5,
# reached at 150-175 steps in fp32, docs/ttt.md)
LLAMA_RECIPE = [
    "train.target=5.5",
    "train.global_batch=32",
    "optim.name=adamw",
    "optim.lr=2e-3",
    "model.llama.document_mask=true",
    "train.precision=bf16",  # autocast matmuls, fp32 master weights and AdamW state
    "comm.compression=bf16",  # the gradients all-reduced in bf16
    "comm.algorithm=hierarchical",
    "comm.overlap=true",
    "comm.bucket_mb=1.0",
    "launch.nnodes=2",
    "launch.nproc_per_node=2",
]
# --quick: a 1-layer 32-wide model (the same 4096-token vocabulary: the corpus cache is reused)
QUICK_LLAMA = [
    "model.llama.layers=1",
    "model.llama.hidden=32",
    "model.llama.heads=2",
    "model.llama.kv_heads=1",
    "model.llama.intermediate=64",
    "train.global_batch=16",
    "launch.nnodes=1",
]
CHAIN = ["abl-framework", "abl-docmask", "abl-comm", "scaleout"]


def baseline_recipe(
    name: str, batch: int, lr: float, warmup: float, precision: str = "bf16"
) -> Any:
    """The plain script's recipe: DDP + fused AdamW under bf16 autocast (fp32 where the bench's
    overrides set train.precision=fp32: on a CPU without bf16 both sides then run fp32),
    concatenated rows."""
    from scaleout.bench._ttt_runs import Recipe

    return Recipe(
        name, "torch", "adamw", batch, lr, warmup, precision=precision, label="torch DDP + AdamW"
    )


def llama_recipes(
    args: argparse.Namespace, cfg: Any, best: Any, sharded_buckets: float
) -> dict[str, Any]:
    """scaleout's recipe (read from the resolved ``cfg``), the sharded row (``sharded_buckets`` x
    larger buckets, as the BERT task's: ``ttt.SHARDED_BUCKETS``) and the ablation chain from the
    best baseline ``best``."""
    from scaleout.bench._ttt_runs import Recipe

    full = Recipe.from_config("scaleout", cfg, args.warmup)
    framework = Recipe.framework(
        best,
        "adamw",
        packing=False,  # here: no document mask, the rows as the baseline reads them
        precision=best.precision,
        order="torch",  # the baseline's DistributedSampler batches
    )
    docmask = replace(
        framework, name="abl-docmask", packing=full.packing, label="document masks in packed rows"
    )
    wire = f" + {full.compression} wire" if full.compression != "none" else ""
    comm = replace(
        docmask,
        name="abl-comm",
        comm=full.comm,
        overlap=full.overlap,
        bucket_mb=full.bucket_mb,
        compression=full.compression,
        label=f"{full.comm} all-reduce + overlap{wire}",
    )
    full = replace(
        full,
        label=f"scaleout's recipe: lr {full.lr:g} at {full.batch} rows, warm-up "
        f"{full.warmup:.2g}, its data order",
    )
    sharded = replace(
        full,
        name="scaleout-sharded",
        sharded=True,
        shard="node",
        bucket_mb=full.bucket_mb * sharded_buckets,
        label="sharded AdamW (within the node)",
    )
    return {
        "scaleout": full,
        "scaleout-sharded": sharded,
        "chain": [framework, docmask, comm, full],
    }
