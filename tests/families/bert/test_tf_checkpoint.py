"""``scaleout ckpt convert``: the MLCommons phase-1 TensorFlow checkpoint -> model.init_checkpoint.

The checkpoint is written by TensorFlow itself (tf.compat.v1 ``Saver``, as Google BERT's
``run_pretraining.py`` wrote ``model.ckpt-28252``), with the reference's variable names and its
LAMB slots, from a random ``transformers.BertForPreTraining``; the converted file must hold that
model's weights and give its logits. TensorFlow runs only in subprocesses (the writer and the CLI),
so its import cannot change this process's torch; the test extra installs tensorflow-cpu, so a
missing one fails the writer instead of skipping.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import transformers  # the test extra installs it: missing is a failure, not a skip

from scaleout.cli import ckpt as ckpt_cli
from scaleout.errors import UserError
from scaleout.families.bert.config import BertConfig
from scaleout.families.bert.convert import load_init_checkpoint
from scaleout.families.bert.data.bert_batch import build_batch, padded_packs, synthetic_sequences
from scaleout.families.bert.model import BertForPreTraining
from scaleout.families.bert.tf_checkpoint import hf_name

VOCAB, HIDDEN, LAYERS, HEADS, FFN, POS = 101, 32, 2, 4, 64, 64

# Written out by hand from Google BERT's modeling.py / run_pretraining.py (not derived from the
# code under test): TF variable -> (HF name, transposed?)
_TF_EMB = {
    "bert/embeddings/word_embeddings": ("bert.embeddings.word_embeddings.weight", False),
    "bert/embeddings/position_embeddings": ("bert.embeddings.position_embeddings.weight", False),
    "bert/embeddings/token_type_embeddings": (
        "bert.embeddings.token_type_embeddings.weight",
        False,
    ),
    "bert/embeddings/LayerNorm/gamma": ("bert.embeddings.LayerNorm.weight", False),
    "bert/embeddings/LayerNorm/beta": ("bert.embeddings.LayerNorm.bias", False),
    "bert/pooler/dense/kernel": ("bert.pooler.dense.weight", True),
    "bert/pooler/dense/bias": ("bert.pooler.dense.bias", False),
    "cls/predictions/transform/dense/kernel": ("cls.predictions.transform.dense.weight", True),
    "cls/predictions/transform/dense/bias": ("cls.predictions.transform.dense.bias", False),
    "cls/predictions/transform/LayerNorm/gamma": (
        "cls.predictions.transform.LayerNorm.weight",
        False,
    ),
    "cls/predictions/transform/LayerNorm/beta": ("cls.predictions.transform.LayerNorm.bias", False),
    "cls/predictions/output_bias": ("cls.predictions.bias", False),
    "cls/seq_relationship/output_weights": ("cls.seq_relationship.weight", False),  # [2, H]
    "cls/seq_relationship/output_bias": ("cls.seq_relationship.bias", False),
}
_TF_LAYER = {
    "attention/self/query": "attention.self.query",
    "attention/self/key": "attention.self.key",
    "attention/self/value": "attention.self.value",
    "attention/output/dense": "attention.output.dense",
    "intermediate/dense": "intermediate.dense",
    "output/dense": "output.dense",
}
_TF_LN = {
    "attention/output/LayerNorm": "attention.output.LayerNorm",
    "output/LayerNorm": "output.LayerNorm",
}


def mlcommons_names() -> dict[str, tuple[str, bool]]:
    names = dict(_TF_EMB)
    for i in range(LAYERS):
        tf, hf = f"bert/encoder/layer_{i}/", f"bert.encoder.layer.{i}."
        for t, h in _TF_LAYER.items():
            names[f"{tf}{t}/kernel"] = (f"{hf}{h}.weight", True)
            names[f"{tf}{t}/bias"] = (f"{hf}{h}.bias", False)
        for t, h in _TF_LN.items():
            names[f"{tf}{t}/gamma"] = (f"{hf}{h}.weight", False)
            names[f"{tf}{t}/beta"] = (f"{hf}{h}.bias", False)
    return names


def hf_model(seed: int = 0) -> torch.nn.Module:
    """transformers' BertForPreTraining (gelu_new: Google's tanh GELU) with every weight random."""
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=FFN,
        max_position_embeddings=POS,
        hidden_act="gelu_new",
        layer_norm_eps=1e-12,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    m = transformers.BertForPreTraining(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return m


WRITER = textwrap.dedent(
    """
    import os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import numpy as np
    import tensorflow as tf
    values = dict(np.load(sys.argv[1]))
    with tf.Graph().as_default():
        tfv = {n: tf.compat.v1.Variable(v, name=n) for n, v in values.items()}
        step = tf.compat.v1.train.get_or_create_global_step()
        saver = tf.compat.v1.train.Saver(var_list={**tfv, "global_step": step})
        with tf.compat.v1.Session() as s:
            s.run(tf.compat.v1.global_variables_initializer())
            s.run(step.assign(28252))
            print(saver.save(s, sys.argv[2], global_step=28252, write_meta_graph=False))
    """
)


def write_tf_checkpoint(hf: torch.nn.Module, tmp_path) -> tuple[str, dict]:
    """Google BERT's variables (plus the LAMB slots adam_m/adam_v) written by TF's Saver."""
    sd = hf.state_dict()
    values = {}
    for tf_name, (name, transposed) in mlcommons_names().items():
        v = sd[name].numpy()
        values[tf_name] = np.ascontiguousarray(v.T if transposed else v)
        values[tf_name + "/adam_m"] = np.full_like(values[tf_name], 7.0)
        values[tf_name + "/adam_v"] = np.full_like(values[tf_name], 9.0)
    npz = tmp_path / "vars.npz"
    np.savez(npz, **values)
    prefix = tmp_path / "phase1" / "model.ckpt"
    res = subprocess.run(
        [sys.executable, "-c", WRITER, str(npz), str(prefix)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.strip().splitlines()[-1], sd


@pytest.mark.full_system
def test_convert_mlcommons_tf_checkpoint_gives_hf_weights_and_logits(tmp_path):
    """`scaleout ckpt convert` of a TF-written checkpoint: every weight by name and value, kernels
    transposed (a non-square one would fail on shape, a square one on value), slots and
    global_step dropped; --config checks it against the model; the model loaded from it gives
    transformers' logits to 1e-5 (NSP columns swapped: ours is class 1 = is-next)."""
    hf = hf_model()
    prefix, want = write_tf_checkpoint(hf, tmp_path)
    assert prefix.endswith("model.ckpt-28252")
    out = tmp_path / "phase1.pt"
    cmd = [sys.executable, "-m", "scaleout", "ckpt", "convert", prefix, "--out", str(out)]
    cfg = [
        "--config",
        "bert_tiny_cpu",
        f"model.bert.vocab_size={VOCAB}",
        f"model.bert.hidden={HIDDEN}",
        f"model.bert.layers={LAYERS}",
        f"model.bert.heads={HEADS}",
        f"model.bert.intermediate={FFN}",
        f"model.bert.max_position={POS}",
    ]
    # a config of another shape: one line naming the mismatch, exit 2, nothing written
    bad = subprocess.run(
        cmd + cfg + ["model.bert.intermediate=48"], capture_output=True, text=True, timeout=300
    )
    assert bad.returncode == 2, bad.stderr[-2000:]
    last = bad.stderr.strip().splitlines()[-1]
    assert "mis-shaped" in last and "intermediate.dense.weight (64, 32) (expected (48, 32))" in last
    assert not out.exists() and not list(tmp_path.glob("phase1.pt*"))
    res = subprocess.run(cmd + cfg, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "checked against bert_tiny_cpu's model.bert" in res.stdout
    got = torch.load(out, weights_only=True)
    tied = {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
    buffers = {k for k in want if k.endswith(("position_ids", "token_type_ids"))}
    assert set(got) == set(want) - tied - buffers
    for k, v in got.items():
        torch.testing.assert_close(v, want[k], atol=0, rtol=0, msg=k)

    model = BertForPreTraining(
        BertConfig(
            vocab_size=VOCAB,
            hidden=HIDDEN,
            layers=LAYERS,
            heads=HEADS,
            intermediate=FFN,
            max_position=POS,
            dropout=0.0,
            activation="gelu_tanh",
            unpad_mlm_head=True,
        )
    ).eval()
    assert load_init_checkpoint(model, out) == "huggingface/nvidia"
    seqs = synthetic_sequences([17, 9, 30, 12], VOCAB, seed=3)
    ids = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=torch.long)
    types, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], types[i, : len(s)] = torch.tensor(s.tokens), torch.tensor(s.segments)
        mask[i, : len(s)] = 1
    with torch.no_grad():
        ref = hf(input_ids=ids, token_type_ids=types, attention_mask=mask)
        ours = model(build_batch(seqs, padded_packs(len(seqs)), POS))
    ref_mlm = torch.cat(
        [ref.prediction_logits[i, list(s.mlm_positions)] for i, s in enumerate(seqs)]
    )
    torch.testing.assert_close(ours.mlm_logits, ref_mlm, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        ours.nsp_logits, ref.seq_relationship_logits.flip(-1), atol=1e-5, rtol=0
    )


@pytest.mark.unit
def test_tf_names_map_to_hf_and_slots_are_dropped():
    """Every Google BERT variable maps to its Hugging Face name; optimizer slots and the step
    counter map to nothing."""
    for tf_name, (name, _) in mlcommons_names().items():
        assert hf_name(tf_name) == name, tf_name
        assert hf_name(tf_name + "/adam_m") is None and hf_name(tf_name + "/adam_v") is None
    assert hf_name("global_step") is None


@pytest.mark.unit
@pytest.mark.parametrize("out", [None, "x.pt"])
def test_convert_bad_input_is_one_line(tmp_path, out):
    """No --out, or a path that is no TF checkpoint: a UserError naming it, before TF loads."""
    (tmp_path / "model.ckpt-1.data-00000-of-00001").write_bytes(b"")
    with pytest.raises(UserError, match="--out" if out is None else "not a TensorFlow checkpoint"):
        ckpt_cli.convert(str(tmp_path), out and str(tmp_path / out), None)
    assert "tensorflow" not in sys.modules
