"""The report's FLOP count against torch's own counter
(``torch.utils.flop_counter.FlopCounterMode``).

The model FLOPs of a step are the FLOPs of each sequence run alone at its real length: that is the
work packing saves and padding wastes. FlopCounterMode counts matmuls the same way (2 per
multiply-add); its attention count needs SDPA's math backend (the fused CPU flash kernel is not in
its registry).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from scaleout.families.bert.config import BertConfig
from scaleout.families.bert.data.bert_batch import build_batch, synthetic_sequences
from scaleout.families.bert.flops import head_rows, sequence_flops
from scaleout.families.bert.model import BertForPreTraining

pytestmark = pytest.mark.multi_process

LENGTHS = [20, 30, 13, 64, 40, 7]
PACKS = [[0, 1], [2, 4, 5], [3]]


def _counted_by_torch(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(batch).loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def _model(**kw) -> BertForPreTraining:
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=512,
        hidden=64,
        layers=2,
        heads=2,
        intermediate=256,
        max_position=64,
        dropout=0.0,
        **kw,
    )
    return BertForPreTraining(cfg)


@pytest.mark.parametrize("unpad", [True, False])
def test_packed_step_flops_equal_each_sequence_run_alone(unpad: bool) -> None:
    model = _model(unpad_mlm_head=unpad)
    seqs = synthetic_sequences(LENGTHS, 512, seed=1)
    alone = sum(
        _counted_by_torch(model, build_batch(seqs, [[i]], len(seqs[i]))) for i in range(len(seqs))
    )
    n_masked = sum(len(s.mlm_positions) for s in seqs)
    # what the packed step runs: 3 rows of 64 tokens; the MLM head at the masked positions
    # (unpadded) or at every row position (the decoder runs over padding too, so that is counted)
    mlm, nsp = head_rows(
        model.cfg,
        rows=len(PACKS),
        max_len=64,
        n_masked=n_masked,
        n_seqs=len(seqs),
        mlm_slots=0,
        nsp_slots=0,
    )
    counted = sequence_flops(model.cfg, LENGTHS, mlm, nsp)
    if unpad:
        assert counted == alone
    else:  # each sequence alone runs its head on len(seq) rows; the packed step on 3 x 64
        extra = (mlm - sum(LENGTHS)) * 3 * (2 * 64 * 64 + 2 * 64 * 512)
        assert counted == alone + extra
    # and the counter on the packed batch itself sees more: padding and the masked-out attention
    # blocks
    assert _counted_by_torch(model, build_batch(seqs, PACKS, 64)) > counted


def test_padded_full_rows_and_static_heads_equal_the_counter() -> None:
    """No padding, no packing: the step's count is exactly what FlopCounterMode sees, for the
    default and the capture-safe (static-slot) heads."""
    for static in (False, True):
        model = _model(unpad_mlm_head=True, static_shapes=static)
        seqs = synthetic_sequences([64, 64, 64], 512, seed=2)
        slots = 12
        batch = build_batch(seqs, [[0], [1], [2]], 64, max_predictions=slots, max_per_pack=1)
        n_masked = sum(len(s.mlm_positions) for s in seqs)
        mlm, nsp = head_rows(model.cfg, 3, 64, n_masked, 3, mlm_slots=slots, nsp_slots=1)
        assert sequence_flops(model.cfg, [64, 64, 64], mlm, nsp) == _counted_by_torch(model, batch)


def test_micro_batches_count_the_flops_they_train(tmp_path) -> None:
    """The FLOPs each micro-batch carries (counted where it is built, from the batch itself) sum,
    over a step, to the formula over exactly the packs the sampler picks for that step."""
    import scaleout
    from scaleout.config.load import load_config
    from scaleout.families.bert.task import BertTask
    from scaleout.train.prefetch import Prefetcher

    cfg = load_config(
        "bert_tiny_cpu",
        [
            "data.source=synthetic",
            "launch.env=single",
            "train.global_batch=8",
            "train.max_steps=20",
            f"train.output_dir={tmp_path}",
        ],
    )
    world = scaleout.init(cfg)
    try:
        task = BertTask(cfg, world)
        idx = task.sampler.global_indices(16)
        seq_idx = [i for p in idx for i in task.packs[p]]
        lens = task.lengths[seq_idx]
        masked = sum(len(task.train_seqs[i].mlm_positions) for i in seq_idx)
        mlm, nsp = head_rows(
            task.model.cfg,
            len(idx),
            cfg.data.max_seq_len,
            masked,
            len(seq_idx),
            task.max_pred,
            task.depth,
        )
        counted = sum(mb.flops for mb in task.batches.micro_batches(16, 2))
        assert counted == pytest.approx(sequence_flops(task.model.cfg, lens, mlm, nsp), rel=1e-12)
        assert counted > 0
        # The same micro-batches through the prefetcher (what data.num_workers > 0 trains on) keep
        # their FLOPs: the report's FLOPs and MFU must not depend on who built the batch.
        with Prefetcher(task, cfg.train.global_batch, 1, 2, 3, num_workers=0) as pf:
            fetched = pf.get(2)
        assert [mb.flops for mb in fetched] == [mb.flops for mb in task.micro_batches(16, 1)]
    finally:
        world.close()
