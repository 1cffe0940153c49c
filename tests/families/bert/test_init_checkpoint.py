"""model.init_checkpoint: Hugging Face and NVIDIA MLPerf BERT weights give the same logits as the
real ``transformers.BertForPreTraining`` (a small random BertConfig built locally: no download)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers  # the test extra installs it: missing is a failure, not a skip

from scaleout.errors import UserError
from scaleout.families.bert.config import BertConfig
from scaleout.families.bert.convert import load_init_checkpoint, to_hf
from scaleout.families.bert.data.bert_batch import build_batch, padded_packs, synthetic_sequences
from scaleout.families.bert.model import BertForPreTraining

VOCAB, HIDDEN, LAYERS, HEADS, FFN, POS = 101, 32, 2, 4, 64, 64
HF_ACT = {"gelu": "gelu", "gelu_tanh": "gelu_new"}


def hf_model(act: str, seed: int = 0) -> torch.nn.Module:
    """transformers' BertForPreTraining with every weight random (LayerNorm and biases too, so a
    swapped or dropped tensor shows in the logits)."""
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=FFN,
        max_position_embeddings=POS,
        hidden_act=HF_ACT[act],
        layer_norm_eps=1e-12,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    m = transformers.BertForPreTraining(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    assert m.cls.predictions.decoder.weight is m.bert.embeddings.word_embeddings.weight  # tied
    return m


def ours(act: str, vocab: int = VOCAB) -> BertForPreTraining:
    cfg = BertConfig(
        vocab_size=vocab,
        hidden=HIDDEN,
        layers=LAYERS,
        heads=HEADS,
        intermediate=FFN,
        max_position=POS,
        dropout=0.0,
        activation=act,
        unpad_mlm_head=True,
    )
    torch.manual_seed(123)  # different from the HF weights: only the loaded ones can match
    return BertForPreTraining(cfg).eval()


def hf_logits(m: torch.nn.Module, seqs: list) -> tuple[torch.Tensor, torch.Tensor]:
    """HF on the sequences padded one per row: MLM logits at each sequence's masked positions (in
    order), NSP logits per sequence."""
    n = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), n, dtype=torch.long)
    types, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s.tokens)
        types[i, : len(s)] = torch.tensor(s.segments)
        mask[i, : len(s)] = 1
    with torch.no_grad():
        out = m(input_ids=ids, token_type_ids=types, attention_mask=mask)
    mlm = torch.cat([out.prediction_logits[i, list(s.mlm_positions)] for i, s in enumerate(seqs)])
    return mlm, out.seq_relationship_logits


def our_logits(
    m: BertForPreTraining, seqs: list, packs: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = m(build_batch(seqs, packs, POS))
    return out.mlm_logits, out.nsp_logits


@pytest.fixture(scope="module")
def seqs():
    lengths = [17, 9, 30, 12, 5, 21]
    return synthetic_sequences(lengths, VOCAB, seed=3)


@pytest.mark.multi_process
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh"])
def test_hf_weights_give_hf_logits_packed_and_padded(act, seqs, tmp_path):
    """Same MLM and NSP logits to 1e-5 as transformers, for packed rows (3 + 2 + 1 sequences) and
    padded rows. NSP: HF class 0 = is-next, ours class 1, so ours equals HF's with the two
    columns swapped."""
    hf = hf_model(act)
    path = tmp_path / "hf.pt"
    torch.save(hf.state_dict(), path)
    m = ours(act)
    assert load_init_checkpoint(m, path) == "huggingface/nvidia"
    want_mlm, want_nsp = hf_logits(hf, seqs)
    for packs in ([[0, 1, 2], [3, 4], [5]], padded_packs(len(seqs))):
        order = [i for p in packs for i in p]
        mlm, nsp = our_logits(m, seqs, packs)
        per_seq = np.cumsum([0] + [len(seqs[i].mlm_positions) for i in range(len(seqs))])
        want = torch.cat([want_mlm[per_seq[i] : per_seq[i + 1]] for i in order])
        torch.testing.assert_close(mlm, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(nsp, want_nsp[order].flip(-1), atol=1e-5, rtol=0)
    # the other activation gives different logits: the option is not cosmetic
    other = ours("gelu" if act == "gelu_tanh" else "gelu_tanh")
    load_init_checkpoint(other, path)
    assert (our_logits(other, seqs, padded_packs(len(seqs)))[0] - want_mlm).abs().max() > 1e-4


@pytest.mark.unit
def test_nvidia_mlperf_layout(seqs, tmp_path):
    """NVIDIA's checkpoint: {"model": ...}, DDP's module. prefix, vocabulary padded to a multiple
    of 8 (101 -> 104 rows), fused-MHA attention names (remap_attn_parameters) and dense_act;
    logits as HF's."""
    hf = hf_model("gelu_tanh", seed=1)
    sd = {}
    for k, v in hf.state_dict().items():
        if k.endswith(
            ("word_embeddings.weight", "decoder.weight", "predictions.bias", "decoder.bias")
        ):
            v = torch.cat([v, torch.zeros(104 - VOCAB, *v.shape[1:])])
        k = (
            k.replace("attention.self.query.weight", "attention.multi_head_attention.q_weight")
            .replace("attention.self.key.bias", "attention.multi_head_attention.k_bias")
            .replace(
                "attention.output.dense.weight", "attention.multi_head_attention.out_proj_weight"
            )
            .replace("attention.output.LayerNorm.", "attention.layer_norm.")
            .replace("intermediate.dense.", "intermediate.dense_act.")
        )
        sd["module." + k] = v
    path = tmp_path / "phase1.pt"
    torch.save({"model": sd, "optimizer": {}, "files": [0]}, path)
    m = ours("gelu_tanh")
    load_init_checkpoint(m, path)
    want_mlm, want_nsp = hf_logits(hf, seqs)
    mlm, nsp = our_logits(m, seqs, padded_packs(len(seqs)))
    torch.testing.assert_close(mlm, want_mlm, atol=1e-5, rtol=0)
    torch.testing.assert_close(nsp, want_nsp.flip(-1), atol=1e-5, rtol=0)
    padded = ours("gelu_tanh", vocab=104)  # a model with the padded vocabulary keeps the rows
    load_init_checkpoint(padded, path)
    assert padded.word.weight.shape[0] == 104


@pytest.mark.unit
def test_bad_checkpoints_are_one_line_errors(tmp_path):
    hf = hf_model("gelu")
    good = hf.state_dict()
    cases = {
        "missing [bert.encoder.layer.1.output.dense.bias]": {
            k: v for k, v in good.items() if k != "bert.encoder.layer.1.output.dense.bias"
        },
        "unexpected [bert.encoder.layer.2.output.dense.bias]": {
            **good,
            "bert.encoder.layer.2.output.dense.bias": torch.zeros(HIDDEN),
        },
        "mis-shaped [bert.pooler.dense.weight (32, 16) (expected (32, 32))]": {
            **good,
            "bert.pooler.dense.weight": torch.zeros(HIDDEN, 16),
        },
        "cls.predictions.decoder.weight differs": {
            **good,
            "cls.predictions.decoder.weight": torch.zeros(VOCAB, HIDDEN),
        },
        "neither Hugging Face": {"encoder.w": torch.zeros(2)},
        "not a state dict": {"model": {"a": 1}},
    }
    for needle, sd in cases.items():
        path = tmp_path / "bad.pt"
        torch.save(sd, path)
        with pytest.raises(UserError) as info:
            load_init_checkpoint(ours("gelu"), path)
        assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)
    with pytest.raises(UserError, match="does not exist"):
        load_init_checkpoint(ours("gelu"), tmp_path / "nope.pt")


@pytest.mark.unit
def test_checks_on_every_rank_copy_on_one(tmp_path):
    """copy=False (ranks > 0) validates without touching the weights; round trip through to_hf is
    exact."""
    hf = hf_model("gelu")
    path = tmp_path / "hf.pt"
    torch.save(hf.state_dict(), path)
    m = ours("gelu")
    before = {k: v.clone() for k, v in m.state_dict().items()}
    load_init_checkpoint(m, path, copy=False)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    load_init_checkpoint(m, path)
    back = to_hf(m.state_dict(), LAYERS)
    ref = hf.state_dict()
    assert set(back) == set(ref)
    assert all(torch.equal(back[k], ref[k]) for k in ref)


@pytest.mark.full_system
def test_ckpt_export_loads_into_transformers(tmp_path, capsys):
    """A real (single-process, synthetic data) training run -> `scaleout ckpt show` and `ckpt
    export` -> the HF folder loads with BertForPreTraining.from_pretrained (no missing or
    unexpected keys) and gives the logits of the trained model; the plain .pt loads with
    torch.load and as model.init_checkpoint."""
    import hashlib
    import os
    import subprocess
    import sys

    from scaleout.cli import main as cli_main
    from scaleout.config import load_config

    run = [
        sys.executable,
        "-m",
        "scaleout",
        "train",
        "bert_tiny_cpu",
        "launch.env=single",
        "data.source=synthetic",
        "train.global_batch=8",
        "train.max_steps=2",
        "train.eval_every=2",
        "data.eval_samples=8",
        "optim.warmup_steps=1",
        "optim.total_steps=4",
        "train.progress=false",
        "model.bert.activation=gelu_tanh",
        f"train.output_dir={tmp_path / 'out'}",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
    ]
    r = subprocess.run(
        run, capture_output=True, text=True, timeout=600, env={**os.environ, "SCALEOUT_ENV": ""}
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    ckpt = tmp_path / "ckpt" / "ckpt-00000002.pt"
    assert cli_main(["ckpt", "show", str(tmp_path)]) == 0  # a run directory: finds ckpt/ inside
    shown = capsys.readouterr().out
    assert hashlib.sha256(ckpt.read_bytes()).hexdigest() in shown and "step        2" in shown
    assert "'activation': 'gelu_tanh'" in shown and "one optimizer state" in shown
    out = tmp_path / "export"
    assert cli_main(["ckpt", "export", str(ckpt), "--out", str(out)]) == 0
    hf, info = transformers.BertForPreTraining.from_pretrained(out / "hf", output_loading_info=True)
    assert (
        not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ), info
    assert hf.config.hidden_act == "gelu_new"
    hf.eval()
    plain = torch.load(out / "model_state_dict.pt", weights_only=True)
    cfg = load_config("bert_tiny_cpu", ["model.bert.activation=gelu_tanh"])
    m = BertForPreTraining(cfg.model.bert).eval()
    m.load_state_dict(plain)
    seqs = synthetic_sequences([20, 7, 33, 11], cfg.model.bert.vocab_size, seed=5)
    want_mlm, want_nsp = hf_logits(hf, seqs)
    with torch.no_grad():
        got = m(build_batch(seqs, [[0, 1, 2], [3]], 128))
    torch.testing.assert_close(got.mlm_logits, want_mlm, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.nsp_logits, want_nsp.flip(-1), atol=1e-5, rtol=0)
    fresh = BertForPreTraining(cfg.model.bert)
    assert load_init_checkpoint(fresh, out / "model_state_dict.pt") == "scaleout"
    assert all(torch.equal(a, plain[k]) for k, a in fresh.state_dict().items())
    capsys.readouterr()
    assert cli_main(["ckpt", "export", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert "nope does not exist" in err and "\n" not in err
