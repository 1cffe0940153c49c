"""BERT on packed and padded batches: no cross-contamination, batch layout, MLM-head unpadding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.attention.varlen

import scaleout.families.bert.model as bert_mod
from scaleout.errors import UserError
from scaleout.families.bert.config import BertConfig
from scaleout.families.bert.data.bert_batch import (
    CLS_ID,
    IGNORE_INDEX,
    MASK_ID,
    build_batch,
    padded_packs,
    synthetic_sequences,
)
from scaleout.families.bert.model import BertForPreTraining, attention_mask, cu_seqlens
from scaleout.families.bert.packing import assign_sequences, histogram_from_lengths, pack_histogram

L = 64
CFG = BertConfig(
    vocab_size=97, hidden=32, layers=2, heads=4, intermediate=64, max_position=L, dropout=0.1
)


def _packed_and_alone(seed: int = 0, n: int = 40):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, L + 1, size=n)
    lengths[:3] = [1, 2, L]  # edge cases: a lone [CLS], a 2-token sequence, a full row
    seqs = synthetic_sequences(lengths, CFG.vocab_size, seed=seed)
    strategy = pack_histogram(histogram_from_lengths(lengths, L), L, 3, "lphp")
    packs = assign_sequences(strategy, lengths, seed=seed).packs()
    assert max(len(p) for p in packs) > 1
    return seqs, packs


def _per_sequence(out, seqs, order):
    """Split a model output into per-sequence (mlm logits, pooled) in the given sequence order."""
    counts = [len(seqs[i].mlm_positions) for i in order]
    logits = torch.split(out.mlm_logits, counts)
    return {i: (logits[k], out.pooled[k]) for k, i in enumerate(order)}


def _compare(model, seqs, packs):
    pb = build_batch(seqs, packs, L)
    ab = build_batch(seqs, padded_packs(len(seqs)), L)
    with torch.no_grad():
        packed = _per_sequence(model(pb), seqs, [i for p in packs for i in p])
        alone = _per_sequence(model(ab), seqs, list(range(len(seqs))))
    diffs = [
        torch.cat([(packed[i][0] - alone[i][0]).flatten(), packed[i][1] - alone[i][1]])
        for i in alone
    ]
    return torch.cat(diffs).abs().max().item(), pb


@pytest.mark.multi_process
@pytest.mark.parametrize("unpad", [True, False])
def test_no_cross_contamination(unpad, monkeypatch):
    """Each sequence's MLM logits and pooled output are the same packed as run alone (1e-5), and the
    same comparison fails when the per-sequence mask is replaced by a full (whole-row) mask."""
    torch.manual_seed(0)
    model = BertForPreTraining(CFG.model_copy(update={"unpad_mlm_head": unpad})).eval()
    seqs, packs = _packed_and_alone()
    err, pb = _compare(model, seqs, packs)
    assert err < 1e-5
    # tokens of a packed row attend only within their sequence
    m = attention_mask(pb["seq_ids"])[:, 0]
    s = pb["seq_ids"]
    real = (s[:, :, None] > 0) & (s[:, None, :] > 0)
    assert torch.equal(m & real, (s[:, :, None] == s[:, None, :]) & real)
    monkeypatch.setattr(bert_mod, "attention_mask", lambda seq: attention_mask((seq > 0).long()))
    bad, _ = _compare(model, seqs, packs)
    assert bad > 1e-3, "a full mask must contaminate packed sequences"


@pytest.mark.unit
def test_batch_layout():
    seqs, packs = _packed_and_alone(seed=1, n=30)
    b = build_batch(seqs, packs, L)
    masked_inputs = []
    for r, pack in enumerate(packs):
        start, want_pos = 0, []
        for j, i in enumerate(pack):
            s, n = seqs[i], len(seqs[i])
            assert b["position_ids"][r, start : start + n].tolist() == list(
                range(n)
            )  # restart per sequence
            assert b["seq_ids"][r, start : start + n].tolist() == [j + 1] * n
            assert b["token_type_ids"][r, start : start + n].tolist() == s.segments
            assert b["nsp_positions"][r, j] == start and b["input_ids"][r, start] == CLS_ID
            assert b["nsp_labels"][r, j] == s.nsp_label
            want_pos += [
                (start + p, lab) for p, lab in zip(s.mlm_positions, s.mlm_labels, strict=True)
            ]
            start += n
        assert (b["seq_ids"][r, start:] == 0).all() and (b["input_ids"][r, start:] == 0).all()
        # MLM positions are offset into the row and point at the masked inputs of the right sequence
        valid = b["mlm_labels"][r] != IGNORE_INDEX
        got = list(
            zip(
                b["mlm_positions"][r][valid].tolist(),
                b["mlm_labels"][r][valid].tolist(),
                strict=True,
            )
        )
        assert got == want_pos
        masked_inputs += b["input_ids"][r, b["mlm_positions"][r][valid]].tolist()
    assert 0.6 < np.mean(np.array(masked_inputs) == MASK_ID) < 0.95  # BERT's 80 % [MASK]
    with pytest.raises(UserError, match="longer than max_len"):
        build_batch(seqs, [list(range(len(seqs)))], L)
    with pytest.raises(UserError, match="max_predictions"):
        build_batch(seqs, packs, L, max_predictions=0)


@pytest.mark.unit
def test_packed_and_padded_losses_agree():
    torch.manual_seed(1)
    model = BertForPreTraining(CFG).eval()
    seqs, packs = _packed_and_alone(seed=2)
    with torch.no_grad():
        p = model(build_batch(seqs, packs, L))
        a = model(build_batch(seqs, padded_packs(len(seqs)), L))
    assert p.mlm_loss.item() == pytest.approx(a.mlm_loss.item(), rel=1e-5)
    assert p.nsp_loss.item() == pytest.approx(a.nsp_loss.item(), rel=1e-5)
    assert p.mlm_total == a.mlm_total == sum(len(s.mlm_positions) for s in seqs)
    assert p.mlm_correct == a.mlm_correct and p.nsp_total == len(seqs)


def _loss_and_grads(model, batch):
    model.zero_grad()
    out = model(batch)
    out.loss.backward()
    return out.loss.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.mark.multi_process
def test_unpadded_mlm_head_is_exact():
    """Gathering the masked positions before the vocabulary projection gives the same loss and
    gradients as projecting every token, on packed and padded batches; a wrong gather is
    detected."""
    seqs, packs = _packed_and_alone(seed=3, n=20)
    for layout in (packs, padded_packs(len(seqs))):
        batch = build_batch(seqs, layout, L)
        torch.manual_seed(2)
        full = BertForPreTraining(CFG.model_copy(update={"unpad_mlm_head": False, "dropout": 0.0}))
        unpad = BertForPreTraining(CFG.model_copy(update={"unpad_mlm_head": True, "dropout": 0.0}))
        unpad.load_state_dict(full.state_dict())
        lf, gf = _loss_and_grads(full, batch)
        lu, gu = _loss_and_grads(unpad, batch)
        assert torch.allclose(lf, lu, rtol=1e-6, atol=1e-7)
        assert gf.keys() == gu.keys() and "word.weight" in gu  # tied decoder gets its gradient
        for n in gf:
            assert torch.allclose(gf[n], gu[n], rtol=1e-4, atol=1e-7), n
        shifted = dict(
            batch, mlm_positions=(batch["mlm_positions"] + 1) % L
        )  # an off-by-one gather
        lw, gw = _loss_and_grads(unpad, shifted)
        assert abs(lw - lf) > 1e-4 and not torch.allclose(
            gw["mlm_transform.weight"], gf["mlm_transform.weight"]
        )


@pytest.mark.unit
def test_init_and_tying():
    torch.manual_seed(0)
    cfg = CFG.model_copy(update={"hidden": 64, "intermediate": 256, "vocab_size": 2000})
    model = BertForPreTraining(cfg)
    std = model.layers[0].fc1.weight.std().item()
    assert 0.018 < std < 0.022 and model.layers[0].fc1.bias.abs().max() == 0
    assert model.layers[0].ln1.weight.eq(1).all()
    with torch.no_grad():
        model.word.weight[5].fill_(0.0)
        model.mlm_bias.zero_()
        logits = model.mlm_logits(torch.randn(3, cfg.hidden))
    assert logits[:, 5].abs().max() == 0  # the decoder reads the word embedding matrix
    batch = build_batch(synthetic_sequences([10], cfg.vocab_size), [[0]], 10)
    batch["position_ids"][0, -1] = 600
    with pytest.raises(ValueError, match="max_position"):
        model(batch)


@pytest.mark.unit
def test_cu_seqlens():
    seq = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1], [1, 2, 3, 0, 0, 0]])
    idx, cu, longest = cu_seqlens(seq)
    assert idx.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    assert cu.tolist() == [0, 2, 5, 11, 12, 13, 14] and longest == 6


@pytest.mark.unit
def test_varlen_path_never_drops_attention_dropout(monkeypatch):
    """varlen_attn has no dropout (torch 2.13 hardcodes dropout_p=0): training with
    model.bert.dropout > 0 must take the masked SDPA (which applies it); evaluation and dropout 0
    take varlen. The varlen kernel is GPU-only, so varlen_available and varlen_attn are replaced
    by stubs (the dispatch is what is tested; the kernel's numerics: the GPU test below)."""
    calls = []

    def fake_varlen_attn(q, k, v, *args, **kwargs):
        calls.append(q.shape)
        return q

    monkeypatch.setattr(bert_mod, "varlen_available", lambda x: True)
    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", fake_varlen_attn)
    seqs, packs = _packed_and_alone(n=8)
    batch = build_batch(seqs, packs, L)
    torch.manual_seed(0)
    model = BertForPreTraining(CFG)  # dropout 0.1, the flagship's
    model.train()
    torch.manual_seed(1)
    a = model.encode(batch)
    torch.manual_seed(2)
    b = model.encode(batch)
    assert calls == []  # the masked SDPA ran, with dropout
    model.eval()
    model.encode(batch)
    assert len(calls) == CFG.layers  # evaluation: varlen in every layer
    calls.clear()
    nodrop = BertForPreTraining(CFG.model_copy(update={"dropout": 0.0})).train()
    nodrop.encode(batch)
    assert len(calls) == CFG.layers  # training without dropout: varlen
    assert not torch.equal(a, b)  # dropout is live in training


@pytest.mark.unit
@pytest.mark.gpu(reason="variable-length flash attention")
def test_varlen_attention_matches_masked_sdpa_on_gpu():
    """CUDA + bf16 takes the varlen (cu_seqlens) path; it must agree with the masked SDPA path
    and keep packed sequences separate."""
    torch.manual_seed(0)
    model = BertForPreTraining(CFG.model_copy(update={"dropout": 0.0})).cuda().eval()
    seqs, packs = _packed_and_alone()
    batch = {k: v.cuda() for k, v in build_batch(seqs, packs, L).items()}
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        x = model.word(batch["input_ids"]).to(torch.bfloat16)
        assert bert_mod.varlen_available(x)
        varlen = model(batch)
    orig = bert_mod.varlen_available
    try:
        bert_mod.varlen_available = lambda x: False
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            masked = model(batch)
    finally:
        bert_mod.varlen_available = orig
    assert torch.allclose(
        varlen.mlm_logits.float(), masked.mlm_logits.float(), atol=3e-2, rtol=3e-2
    )
    assert torch.allclose(varlen.pooled.float(), masked.pooled.float(), atol=3e-2, rtol=3e-2)


def _static_pair(unpad: bool, dropout: float = 0.1):
    torch.manual_seed(4)
    dyn = BertForPreTraining(CFG.model_copy(update={"unpad_mlm_head": unpad, "dropout": dropout}))
    static = BertForPreTraining(
        CFG.model_copy(update={"unpad_mlm_head": unpad, "dropout": dropout, "static_shapes": True})
    )
    static.load_state_dict(dyn.state_dict())
    return dyn, static


def _seeded(model, batch):
    torch.manual_seed(7)  # same dropout masks in both models (their encoders run the same ops)
    model.zero_grad()
    out = model(batch)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.multi_process
@pytest.mark.parametrize("unpad", [True, False])
def test_static_shape_heads_equal_the_dynamic_ones(unpad):
    """The capture-safe forward (every fixed MLM/NSP slot gathered, loss weighted by validity)
    gives the default forward's losses, gradients, counts and, at its valid slots, logits and
    pooled outputs, on packed and padded batches with spare slots (max_predictions above what any
    row needs)."""
    dyn, static = _static_pair(unpad)
    seqs, packs = _packed_and_alone(seed=5, n=24)
    for layout, spare in ((packs, 7), (padded_packs(len(seqs)), 3)):
        need = max(sum(len(seqs[i].mlm_positions) for i in p) for p in layout)
        batch = build_batch(seqs, layout, L, need + spare, 3)
        assert (batch["mlm_labels"] == IGNORE_INDEX).any() and (
            batch["nsp_labels"] == IGNORE_INDEX
        ).any()
        d, gd = _seeded(dyn, batch)
        s, gs = _seeded(static, batch)
        b, p = batch["mlm_labels"].shape
        assert s.mlm_logits.shape == (b * p, CFG.vocab_size) and s.pooled.shape == (
            b * 3,
            CFG.hidden,
        )
        for k in ("loss", "mlm_loss", "nsp_loss"):
            torch.testing.assert_close(getattr(s, k), getattr(d, k), rtol=1e-6, atol=1e-7)
        for k in ("mlm_correct", "mlm_total", "nsp_correct", "nsp_total"):
            assert int(getattr(s, k)) == int(getattr(d, k)), k
        torch.testing.assert_close(s.mlm_logits[s.mlm_valid], d.mlm_logits, rtol=0, atol=0)
        torch.testing.assert_close(s.pooled[s.nsp_valid], d.pooled, rtol=0, atol=0)
        assert gs.keys() == gd.keys() and "word.weight" in gs and "nsp.weight" in gs
        for n in gd:
            torch.testing.assert_close(gs[n], gd[n], rtol=1e-5, atol=1e-7, msg=n)
    # the weighting matters: an unweighted mean over all slots would be a different loss
    per_slot = torch.nn.functional.cross_entropy(
        s.mlm_logits.detach(), batch["mlm_labels"].reshape(-1), reduction="none"
    )
    assert abs(float(per_slot.mean()) - float(s.mlm_loss.detach())) > 1e-3


@pytest.mark.multi_process
def test_static_shape_heads_without_labels_give_a_connected_zero():
    """A batch with no masked tokens and no NSP labels: loss 0, counts 0, still backpropagates."""
    _, static = _static_pair(True, dropout=0.0)
    batch = build_batch(synthetic_sequences([10, 12], CFG.vocab_size, seed=1), [[0], [1]], L, 4, 1)
    batch["mlm_labels"].fill_(IGNORE_INDEX)
    batch["nsp_labels"].fill_(IGNORE_INDEX)
    out = static(batch)
    assert float(out.loss.detach()) == 0.0 and int(out.mlm_total) == 0 and int(out.nsp_total) == 0
    out.loss.backward()
    assert static.word.weight.grad is not None


# -- the flagship recipe
# ------------------------------------------------------------------------------- NVIDIA's MLPerf
# Training v0.7 BERT, 256 DGX A100 nodes (mlcommons/training_results_v0.7,
# NVIDIA/benchmarks/bert/implementations/pytorch/config_DGXA100_256x8x4x1.sh); v1.x 256-node configs
# keep the optimizer values (with MAX_STEPS=600).
REF = dict(
    DGXNNODES=256,
    DGXNGPU=8,
    BATCHSIZE=4,
    GRADIENT_STEPS=1,
    LR=0.00288293,
    MAX_STEPS=560,
    WARMUP_STEPS=287,
    START_WARMUP_STEP=-76,
    OPT_LAMB_BETA_1=0.88,
    OPT_LAMB_BETA_2=0.88,
    WEIGHT_DECAY_RATE=0.0166629,
    EVAL_ITER_START_SAMPLES=3047424,
    EVAL_ITER_SAMPLES=507904,
)


def nvidia_lr(k: int, base: float, warmup: int, total: int, start_warmup: int) -> float:
    """NVIDIA's LinearWarmupPolyDecayScheduler.get_lr (schedulers.py, training_results_v1.0; end
    lr 0, degree 1) for the k-th optimizer step (1-based: step() runs before each optimizer step
    with last_epoch = steps taken + 1). Written from their code, independent of scaleout's
    schedule."""
    offset = 1 if start_warmup == 0 else 0
    mod = k - offset - start_warmup
    if mod < warmup:
        return base * mod / (warmup + 1e-6)
    progress = min((k - offset) / total, 1.0)
    return base * (1 - progress)


@pytest.mark.multi_process
def test_flagship_config_is_the_reference_recipe():
    """configs/bert_large_256x8.yaml against the cited reference: LR at every one of the 560
    steps, the global batch in sequences (what the MLPerf log says), and the steps at which it
    evaluates."""
    import math

    from scaleout.config.load import load_config
    from scaleout.optim import build_optimizer, build_schedule
    from scaleout.train.hparams import hyperparameters
    from scaleout.train.trainer import eval_due

    cfg = load_config("bert_large_256x8", [])
    world = REF["DGXNNODES"] * REF["DGXNGPU"]
    assert (cfg.launch.nnodes, cfg.launch.nproc_per_node) == (REF["DGXNNODES"], REF["DGXNGPU"])
    o = cfg.optim
    assert (o.lr, o.betas, o.weight_decay, o.warmup_steps, o.start_warmup_step, o.total_steps) == (
        REF["LR"],
        (REF["OPT_LAMB_BETA_1"], REF["OPT_LAMB_BETA_2"]),
        REF["WEIGHT_DECAY_RATE"],
        REF["WARMUP_STEPS"],
        REF["START_WARMUP_STEP"],
        REF["MAX_STEPS"],
    )
    assert cfg.train.max_steps == REF["MAX_STEPS"] and cfg.train.grad_accum == REF["GRADIENT_STEPS"]
    # schedule: every step's rate, read from a real optimizer driven by the configured scheduler
    # (the same for every placement; the flagship's ShardedLAMB needs a World: a replicated one)
    replicated = ["optim.sharded=false", "optim.shard=world", "optim.overlap_comm=false"]
    opt = build_optimizer(torch.nn.Linear(2, 2), load_config("bert_large_256x8", replicated).optim)
    sched = build_schedule(opt, cfg.optim)
    for k in range(1, REF["MAX_STEPS"] + 1):
        want = nvidia_lr(
            k, REF["LR"], REF["WARMUP_STEPS"], REF["MAX_STEPS"], REF["START_WARMUP_STEP"]
        )
        assert opt.param_groups[0]["lr"] == pytest.approx(want, rel=1e-8, abs=1e-12), k
        opt.step()
        sched.step()
    # after warm-up the rate is the reference's (decay from step 0), not ~2x it (decay from the end
    # of warm-up)
    assert nvidia_lr(300, REF["LR"], 287, 560, -76) / REF["LR"] == pytest.approx(1 - 300 / 560)
    # batch: packed rows x the integer packing rate = the reference's sequences per step; logged as
    # such
    sequences = REF["BATCHSIZE"] * world
    wiki = load_histogram_or_skip()
    rate = pack_histogram(
        wiki, cfg.data.max_seq_len, cfg.data.max_per_pack, cfg.data.packing
    ).speedup
    assert cfg.data.packing == "lphp" and round(rate) == 2
    hp = hyperparameters(cfg, world, "bert_large_256x8.yaml", sequences_per_row=rate)
    assert hp["global_batch_size"] == sequences == cfg.train.global_batch * 2
    assert hp["micro_batch_size"] * world == sequences
    assert (
        hp["start_warmup_step"],
        hp["num_warmup_steps"],
        hp["opt_learning_rate_training_steps"],
    ) == (-76, 287, 560)
    assert (
        abs(cfg.train.global_batch * rate - sequences) / sequences < 0.002
    )  # real sequences per step
    # eval cadence: NVIDIA evaluates when samples_trained reaches start + n * interval
    # (run_pretraining.py)
    ref_steps = [
        math.ceil(s / sequences)
        for s in range(REF["EVAL_ITER_START_SAMPLES"], 12_000_000, REF["EVAL_ITER_SAMPLES"])
        if s / sequences <= 560
    ]
    ours = [
        s
        for s in range(1, cfg.train.max_steps + 1)
        if eval_due(s, cfg.train.eval_every, cfg.train.eval_start_step)
    ]
    assert ref_steps == ours == [372, 434, 496, 558]
    assert cfg.model.bert.activation == "gelu_tanh" and cfg.model.init_checkpoint


def load_histogram_or_skip():
    from conftest import WIKI_HIST

    from scaleout.families.bert.packing import load_histogram

    return load_histogram(WIKI_HIST, 512)


@pytest.mark.unit
def test_flagship_config_captures_its_step_in_cuda_graphs():
    """configs/bert_large_256x8.yaml runs 2 packed rows per GPU, where the eager BERT-large step is
    host-launch-bound (~2.5k launches for ~5 ms of GPU work, and the dynamic forward's host
    syncs): it sets CUDA graphs (model.cuda_graphs; the config's comment says why not
    torch.compile), which selects the capture-safe forward with no host syncs. With the sharded
    LAMB the whole step is captured, optimizer included (capture.sharded_step), and the simulator
    prices what runs (scaleout.train.capture.graphed_step; tests/sim/test_sim_flagship.py)."""
    from scaleout.config.load import load_config
    from scaleout.train.capture import graphed_step

    cfg = load_config("bert_large_256x8", [])
    gpus = cfg.launch.nnodes * cfg.launch.nproc_per_node
    rows_per_gpu = cfg.train.global_batch // (gpus * cfg.train.grad_accum)
    assert rows_per_gpu == 2
    assert cfg.model.cuda_graphs and not cfg.model.compile
    static = cfg.model.bert.static_shapes
    assert (static if static is not None else cfg.model.cuda_graphs) is True
    assert graphed_step(cfg) == (True, True)  # captured, reduce-scatters during backward
