"""model.bert.attention: the explicit kernel computes what SDPA computes, and ``auto`` picks a
kernel by measurement where the two differ (CPU with bf16/fp16), the same on every rank."""

from __future__ import annotations

import types

import pytest
import torch

import scaleout.families.bert.kernels as kernels
import scaleout.families.bert.model as bert_mod
from scaleout.config import load_config
from scaleout.families.bert.data.bert_batch import build_batch
from scaleout.families.bert.model import BertForPreTraining, _top1
from tests.distutil import run_dist
from tests.families.bert.test_bert import CFG, L, _compare, _packed_and_alone


def _pair(dropout: float = 0.0):
    torch.manual_seed(0)
    sdpa = BertForPreTraining(CFG.model_copy(update={"dropout": dropout}))
    explicit = BertForPreTraining(
        CFG.model_copy(update={"dropout": dropout, "attention": "explicit"})
    )
    explicit.load_state_dict(sdpa.state_dict())
    assert (sdpa.attention, explicit.attention) == ("sdpa", "explicit")
    return sdpa, explicit


def _loss_and_grads(model, batch, dtype=None):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss = model(batch).loss
    loss.backward()
    return loss.detach().float(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.unit
def test_explicit_attention_equals_sdpa_on_packed_rows():
    """Same loss and gradients as SDPA in fp32 (1e-5) and in bf16 autocast (bf16's rounding), and
    packed sequences still do not see each other."""
    sdpa, explicit = _pair()
    seqs, packs = _packed_and_alone(n=24)
    batch = build_batch(seqs, packs, L)
    a, ga = _loss_and_grads(sdpa.train(), batch)
    b, gb = _loss_and_grads(explicit.train(), batch)
    assert torch.allclose(a, b, rtol=1e-5)
    for x, y in zip(ga, gb, strict=True):
        assert torch.allclose(x, y, rtol=1e-4, atol=1e-6)
    a16, _ = _loss_and_grads(sdpa, batch, torch.bfloat16)
    b16, _ = _loss_and_grads(explicit, batch, torch.bfloat16)
    assert abs(a16 - b16) / a16 < 2e-2
    err, _ = _compare(explicit.eval(), seqs, packs)
    assert err < 1e-5


@pytest.mark.unit
def test_explicit_attention_applies_dropout_in_training_only():
    sdpa, explicit = _pair(dropout=0.3)
    seqs, packs = _packed_and_alone(n=8)
    batch = build_batch(seqs, packs, L)
    explicit.train()
    torch.manual_seed(1)
    a = explicit.encode(batch)
    torch.manual_seed(2)
    b = explicit.encode(batch)
    assert not torch.equal(a, b)
    # and in the attention itself: with the other dropouts at 0 the probabilities are dropped
    q = torch.randn(2, 2, 16, 8)
    mask = torch.ones(2, 1, 16, 16, dtype=torch.bool)
    assert not torch.allclose(
        bert_mod.explicit_attention(q, q, q, mask, 0.5),
        bert_mod.explicit_attention(q, q, q, mask, 0.0),
    )
    with torch.no_grad():
        assert torch.allclose(explicit.eval().encode(batch), sdpa.eval().encode(batch), atol=1e-5)


@pytest.mark.unit
def test_top1_is_argmax_with_ties():
    x = torch.randint(0, 3, (64, 50)).to(torch.bfloat16)  # many ties: the first maximum wins
    assert torch.equal(_top1(x), x.argmax(-1))
    assert torch.equal(_top1(x.float()), x.float().argmax(-1))


def _world(device: str = "cpu", size: int = 1):
    return types.SimpleNamespace(device=torch.device(device), world_size=size, rank=0)


def _cfg(**model_bert):
    cfg = load_config("bert_tiny_cpu")
    return cfg.model_copy(
        update={"model": cfg.model.model_copy(update={"bert": CFG.model_copy(update=model_bert)})}
    )


@pytest.mark.unit
def test_auto_measures_on_cpu_in_bf16_and_the_model_runs_the_choice(monkeypatch):
    cfg = _cfg(dropout=0.0)
    model = BertForPreTraining(cfg.model.bert)
    chosen = kernels.choose_attention(model, cfg, _world(), torch.bfloat16)
    times = chosen["probe_ms"]
    assert set(times) == {"sdpa", "explicit"} and all(t > 0 for t in times.values())
    assert chosen["kernel"] == min(times, key=times.get) == model.attention
    assert "64 x 4 x 128 x 8" in chosen["reason"]  # the per-rank micro-batch x heads x L x d
    # the forward dispatches to the chosen kernel, in every layer
    calls = []
    for name in ("explicit_attention", "_sdpa"):
        real = getattr(bert_mod, name)
        monkeypatch.setattr(bert_mod, name, lambda *a, _n=name, _r=real: calls.append(_n) or _r(*a))
    for kernel, name in (("explicit", "explicit_attention"), ("sdpa", "_sdpa")):
        calls.clear()
        model.set_attention(kernel)
        seqs, packs = _packed_and_alone(n=4)
        with torch.no_grad():
            model.eval().encode(build_batch(seqs, packs, L))
        assert calls == [name] * CFG.layers
    with pytest.raises(ValueError, match="'flash'"):
        model.set_attention("flash")


@pytest.mark.unit
def test_auto_keeps_sdpa_where_no_measurement_is_needed(monkeypatch):
    monkeypatch.setattr(kernels, "probe", lambda *a: pytest.fail("probed"))
    cfg = _cfg()
    for world, dtype, why in (
        (_world(), None, "fp32"),
        (_world("meta"), torch.bfloat16, "meta"),  # stands in for cuda: no probe off the CPU
    ):
        model = BertForPreTraining(cfg.model.bert)
        chosen = kernels.choose_attention(model, cfg, world, dtype)
        assert (chosen["kernel"], model.attention, chosen["probe_ms"]) == ("sdpa", "sdpa", None)
        assert why in chosen["reason"]
    fixed = _cfg(attention="explicit")
    model = BertForPreTraining(fixed.model.bert)
    chosen = kernels.choose_attention(model, fixed, _world(), torch.bfloat16)
    assert (chosen["kernel"], chosen["reason"]) == ("explicit", "model.bert.attention")


def _agree(world):
    """Each rank measures the opposite winner; the all-reduced sums decide for all."""
    fast, slow = (0.001, 0.004) if world.rank == 0 else (0.003, 0.0015)
    kernels.probe = lambda *a: {"sdpa": fast, "explicit": slow}
    cfg = _cfg(dropout=0.0)
    model = BertForPreTraining(cfg.model.bert)
    return kernels.choose_attention(model, cfg, world, torch.bfloat16)["kernel"], model.attention


@pytest.mark.multi_process
def test_every_rank_makes_the_same_choice():
    """Rank 0 alone would pick sdpa (1 vs 4 ms), rank 1 explicit (3 vs 1.5 ms): the sums (4 vs
    5.5 ms) pick sdpa on both. The probe is replaced by fixed times in each rank (what is tested
    is the agreement, not the kernels)."""
    results = run_dist(_agree, nnodes=1, nproc_per_node=2, fresh=True)
    assert results == [("sdpa", "sdpa")] * 2
