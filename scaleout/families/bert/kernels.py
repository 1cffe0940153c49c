"""``model.bert.attention=auto``: which attention kernel a run uses, measured at start-up.

Two kernels compute the same attention (:mod:`scaleout.families.bert.model`): "sdpa", torch's
fused kernels (varlen flash attention for packed bf16/fp16 rows on CUDA, else
``scaled_dot_product_attention``), and "explicit", two matmuls and an fp32 softmax. Which one is
faster depends on torch's kernels for the device and dtype, so ``auto`` decides as follows:

- **CUDA**: "sdpa". The fused kernels are the point there: varlen skips the padding of packed
  rows, and flash attention never writes the L x L scores to memory.
- **CPU, fp32**: "sdpa". Here the two measured within noise of each other (3.5-4.3 ms a layer,
  forward + backward, at the tiny BERT's 8 x 2 x 128 x 64). A measurement that flips on noise would
  change the numerics between two otherwise identical runs.
- **CPU, bf16/fp16 autocast**: measured. torch 2.13's CPU flash-attention backward in bf16 took
  6.6 ms against the explicit kernel's 2.5 ms at that shape (about 20 % of the tiny BERT's step).
  Both kernels run forward + backward on synthetic tensors of the run's per-rank shape
  (micro-batch rows x heads x ``data.max_seq_len`` x head dim, the run's dtype and dropout),
  interleaved, and the best time of each counts. The times are summed over the ranks with one
  all-reduce, so every rank makes the same choice.

The probe runs inside the task's construction, before ``run_start`` (MLPerf-legal: no data is
touched). What was chosen and why is in ``report.json`` (``task.attention``) and printed by rank 0.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from scaleout.families.bert.config import ATTENTION_KERNELS
from scaleout.families.bert.model import BertForPreTraining, attention_fn

if TYPE_CHECKING:
    from scaleout.world import World

KERNELS = {k: attention_fn(k) for k in ATTENTION_KERNELS}
ROUNDS = 3  # timed rounds of each kernel after one untimed warm-up round
BUDGET_S = 2.0  # stop adding rounds once the probe has taken this long (large shapes)


def probe(
    rows: int, heads: int, seq_len: int, head_dim: int, dtype: torch.dtype, dropout: float
) -> dict[str, float]:
    """Best seconds of forward + backward of each kernel on synthetic [rows, heads, seq_len,
    head_dim] inputs with a block-diagonal mask (two sequences per row), interleaved so that the
    machine's noise hits both."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(rows, heads, seq_len, head_dim, generator=g).to(dtype).requires_grad_()
        for _ in range(3)
    )
    grad = torch.randn(rows, heads, seq_len, head_dim, generator=g).to(dtype)
    half = torch.arange(seq_len) < (seq_len + 1) // 2
    mask = (half[:, None] == half[None, :]).expand(rows, 1, seq_len, seq_len)
    best = dict.fromkeys(KERNELS, math.inf)
    start = time.perf_counter()
    for r in range(ROUNDS + 1):
        order = list(KERNELS) if r % 2 else list(reversed(KERNELS))
        for name in order:
            t0 = time.perf_counter()
            KERNELS[name](q, k, v, mask, dropout).backward(grad)
            if r:  # round 0 warms both up (allocations, oneDNN primitives)
                best[name] = min(best[name], time.perf_counter() - t0)
            q.grad = k.grad = v.grad = None
        if r and time.perf_counter() - start > BUDGET_S:
            break
    return best


def choose_attention(
    model: BertForPreTraining, cfg: Any, world: World, dtype: torch.dtype | None
) -> dict[str, Any]:
    """Resolve ``model.bert.attention`` for this run and set it on ``model``; returns what
    report.json records. ``dtype``: the autocast dtype of the forward (None: fp32)."""
    b = cfg.model.bert
    if b.attention != "auto":
        kernel, reason, times = b.attention, "model.bert.attention", None
    elif world.device.type != "cpu":
        kernel, reason, times = "sdpa", f"auto on {world.device.type}: torch's fused kernels", None
    elif dtype not in (torch.bfloat16, torch.float16):
        kernel, reason, times = (
            "sdpa",
            "auto on cpu in fp32: the two kernels are within noise",
            None,
        )
    else:
        micro = max(cfg.train.global_batch // (world.world_size * cfg.train.grad_accum), 1)
        shape = (micro, b.heads, cfg.data.max_seq_len, b.hidden // b.heads)
        best = probe(*shape, dtype, b.dropout)
        summed = torch.tensor([best[k] for k in KERNELS], dtype=torch.float64)
        if world.world_size > 1:  # every rank the same choice: from the same sums
            summed = summed.to(world.device)
            dist.all_reduce(summed)
        per_rank = (summed / world.world_size).tolist()
        times = {k: round(t * 1e3, 3) for k, t in zip(KERNELS, per_rank, strict=True)}
        kernel = min(times, key=lambda k: (times[k], k != "sdpa"))  # a tie keeps sdpa
        dims = " x ".join(map(str, shape))
        reason = (
            f"auto on cpu in {str(dtype).removeprefix('torch.')}: forward + backward at {dims}, "
            + ", ".join(f"{k} {t:.2f} ms" for k, t in times.items())
        )
    model.set_attention(kernel)
    return {"kernel": kernel, "reason": reason, "probe_ms": times}
