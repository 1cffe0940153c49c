"""BERT weights in other layouts: Hugging Face ``BertForPreTraining`` and NVIDIA's MLPerf BERT
checkpoint.

``model.init_checkpoint`` (MLPerf BERT phase 2 starts from the phase-1 checkpoint) goes through
:func:`load_init_checkpoint`; ``scaleout ckpt export`` writes :func:`to_hf` of a run's weights.

Name mapping, ours <- Hugging Face (``L`` = ``bert.encoder.layer.<i>``)::

    word / position / token_type.weight  <-
    bert.embeddings.{word,position,token_type}_embeddings.weight
    emb_ln.{weight,bias}                 <- bert.embeddings.LayerNorm.{weight,bias}
    layers.<i>.attn.qkv.{weight,bias}    <- cat(L.attention.self.{query,key,value}.{weight,bias})
    [3H, H]
    layers.<i>.attn.out                  <- L.attention.output.dense
    layers.<i>.ln1                       <- L.attention.output.LayerNorm
    layers.<i>.fc1 / fc2                 <- L.intermediate.dense / L.output.dense
    layers.<i>.ln2                       <- L.output.LayerNorm
    pooler                               <- bert.pooler.dense
    mlm_transform / mlm_ln               <- cls.predictions.transform.dense / .LayerNorm
    mlm_bias                             <- cls.predictions.bias (= cls.predictions.decoder.bias,
    tied)
    (decoder)                            <- cls.predictions.decoder.weight: tied, must equal the
    word embeddings
    nsp.{weight,bias}                    <- cls.seq_relationship.{weight,bias}, rows swapped

The NSP rows are swapped because Google's BERT, Hugging Face and the MLPerf data use class 0 = "B
follows A" while our batches (:mod:`scaleout.families.bert.data.bert_batch`) use class 1; the logits
are the same numbers in the other order. Activation and LayerNorm eps are not in a state dict: set
``model.bert.activation`` (HF ``gelu`` -> ``gelu``, ``gelu_new``/``gelu_pytorch_tanh`` ->
``gelu_tanh``; NVIDIA's and Google's BERT use the tanh form) and keep HF's ``layer_norm_eps`` at
BERT's 1e-12 (ours).

NVIDIA's MLPerf PyTorch BERT (training_results_v0.7..v3.1, ``modeling.py``) uses the Hugging Face
names. Its checkpoints (``convert_tf_checkpoint.py``, ``run_pretraining.py``) differ in ways
accepted here:

- wrapped: ``{"model": state_dict, ...}`` (``torch.load(init_checkpoint)["model"]``); a ``module.``
  prefix (DDP) is stripped;
- the vocabulary padded to a multiple of 8 (30522 -> 30528 rows in the word embeddings, decoder and
  MLM bias): with ``model.bert.vocab_size`` 30522 the padding rows are dropped (the TF phase-1
  weights are zero there), with 30528 they are kept;
- fused multi-head attention names (``remap_attn_parameters``): ``attention.multi_head_attention.
  {q,k,v}_{weight,bias}``, ``out_proj_{weight,bias}`` and ``attention.layer_norm``; fused bias-GELU
  ``dense_act`` for ``dense``; TF-style LayerNorm ``gamma``/``beta``.

A state dict already in our names (``scaleout ckpt export --format plain``) loads as is. Anything
else is a one-line :class:`~scaleout.errors.UserError` naming the missing, unexpected or mis-shaped
keys.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from scaleout.checkpoint import MAGIC, decode
from scaleout.errors import UserError

# Buffers Hugging Face keeps in some versions; they carry no weights.
_HF_BUFFERS = ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids")
_ALIASES = [  # NVIDIA / TF-era names -> Hugging Face names
    (r"attention\.multi_head_attention\.q_(weight|bias)$", r"attention.self.query.\1"),
    (r"attention\.multi_head_attention\.k_(weight|bias)$", r"attention.self.key.\1"),
    (r"attention\.multi_head_attention\.v_(weight|bias)$", r"attention.self.value.\1"),
    (r"attention\.multi_head_attention\.out_proj_(weight|bias)$", r"attention.output.dense.\1"),
    (r"attention\.layer_norm\.", "attention.output.LayerNorm."),
    (r"\.dense_act\.", ".dense."),
    (r"LayerNorm\.gamma$", "LayerNorm.weight"),
    (r"LayerNorm\.beta$", "LayerNorm.bias"),
]
# (ours, HF) for the weights that map one to one; per-layer names use {i}.
_SIMPLE = [
    ("word.weight", "bert.embeddings.word_embeddings.weight"),
    ("position.weight", "bert.embeddings.position_embeddings.weight"),
    ("token_type.weight", "bert.embeddings.token_type_embeddings.weight"),
    ("emb_ln.weight", "bert.embeddings.LayerNorm.weight"),
    ("emb_ln.bias", "bert.embeddings.LayerNorm.bias"),
    ("pooler.weight", "bert.pooler.dense.weight"),
    ("pooler.bias", "bert.pooler.dense.bias"),
    ("mlm_transform.weight", "cls.predictions.transform.dense.weight"),
    ("mlm_transform.bias", "cls.predictions.transform.dense.bias"),
    ("mlm_ln.weight", "cls.predictions.transform.LayerNorm.weight"),
    ("mlm_ln.bias", "cls.predictions.transform.LayerNorm.bias"),
    ("mlm_bias", "cls.predictions.bias"),
]
_LAYER = [
    ("attn.out", "attention.output.dense"),
    ("ln1", "attention.output.LayerNorm"),
    ("fc1", "intermediate.dense"),
    ("fc2", "output.dense"),
    ("ln2", "output.LayerNorm"),
]
_VOCAB_KEYS = ("word.weight", "mlm_bias")
_NSP = ("cls.seq_relationship.weight", "cls.seq_relationship.bias")


def read_state_dict(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Tensors of a checkpoint file: a plain state dict, NVIDIA's ``{"model": ...}``, or a
    scaleout checkpoint (its ``"model"``, read through :mod:`scaleout.checkpoint`). Memory-mapped
    where the file allows it, so reading shapes costs no I/O until values are copied."""

    p = os.fspath(path)
    if not os.path.isfile(p):
        raise UserError(
            f"model.init_checkpoint={p} does not exist; expected a BERT state dict .pt file"
        )
    with open(p, "rb") as f:
        head = f.read(len(MAGIC))
    if head == MAGIC:
        with open(p, "rb") as f:
            obj: Any = decode(f.read(), p)
    else:
        obj = _torch_load(p)
    for key in ("model", "state_dict", "model_state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        what = type(obj).__name__ if not isinstance(obj, dict) else "dict with non-tensor values"
        raise UserError(
            f"model.init_checkpoint={p}: holds a {what}, not a state dict (a dict of tensors, or "
            "one under 'model')"
        )
    return obj


def _torch_load(p: str) -> Any:
    """torch.load (weights only, memory-mapped where the file allows); a file torch cannot read
    (a foreign or corrupt file: its unpickler raises anything from IndexError to
    UnpicklingError) is one line naming the key and the file."""
    try:
        try:
            return torch.load(p, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # legacy (non-zip) torch.save files cannot be memory-mapped
            return torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure to unpickle is the same bad input
        raise UserError(
            f"model.init_checkpoint={p}: not a checkpoint torch can read "
            f"({type(exc).__name__}); expected a BERT state dict written by torch.save"
        ) from None


def hf_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """NVIDIA/TF-era aliases and a DDP ``module.`` prefix -> Hugging Face names."""
    out = {}
    for k, v in sd.items():
        k = k.removeprefix("module.")
        for pat, rep in _ALIASES:
            k = re.sub(pat, rep, k)
        out[k] = v
    return out


def _expected_hf(model_sd: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Size]:
    shapes = {hf: model_sd[ours].shape for ours, hf in _SIMPLE}
    hidden = model_sd["word.weight"].shape[1]
    for i in range(layers):
        L = f"bert.encoder.layer.{i}."
        for part in ("query", "key", "value"):
            shapes[f"{L}attention.self.{part}.weight"] = torch.Size([hidden, hidden])
            shapes[f"{L}attention.self.{part}.bias"] = torch.Size([hidden])
        for ours, hf in _LAYER:
            for t in ("weight", "bias"):
                shapes[f"{L}{hf}.{t}"] = model_sd[f"layers.{i}.{ours}.{t}"].shape
    shapes[_NSP[0]], shapes[_NSP[1]] = model_sd["nsp.weight"].shape, model_sd["nsp.bias"].shape
    return shapes


def _fit_vocab(key: str, t: torch.Tensor, want: torch.Size) -> torch.Tensor:
    """NVIDIA pads the vocabulary to a multiple of 8: drop those rows when the model has the
    unpadded size."""
    v = want[0]
    if t.shape[1:] == want[1:] and t.shape[0] > v and t.shape[0] == -(-v // 8) * 8:
        return t[:v]
    return t


def from_hf(
    sd: dict[str, torch.Tensor],
    model_sd: dict[str, torch.Tensor],
    layers: int,
    source: str = "checkpoint",
) -> dict[str, torch.Tensor]:
    """A Hugging Face / NVIDIA BertForPreTraining state dict -> ours (``model_sd`` gives names and
    shapes).

    Raises UserError naming the missing, unexpected or mis-shaped keys."""
    sd = hf_names(sd)
    want = _expected_hf(model_sd, layers)
    vocab = {hf for ours, hf in _SIMPLE if ours in _VOCAB_KEYS}
    sd = {k: _fit_vocab(k, v, want[k]) if k in vocab else v for k, v in sd.items()}
    tied = {
        "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
        "cls.predictions.decoder.bias": "cls.predictions.bias",
    }
    missing = [k for k in want if k not in sd]
    unexpected = [k for k in sd if k not in want and k not in tied and k not in _HF_BUFFERS]
    shaped = [
        f"{k} {tuple(sd[k].shape)} (expected {tuple(s)})"
        for k, s in want.items()
        if k in sd and sd[k].shape != s
    ]
    problems = [
        f"{name} {_few(keys)}"
        for name, keys in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", shaped))
        if keys
    ]
    if problems:
        raise UserError(
            f"{source}: not a BertForPreTraining of this model.bert config: {'; '.join(problems)}"
        )
    for (
        k,
        base,
    ) in tied.items():  # our decoder is tied: a checkpoint with an untied one cannot be loaded
        if k in sd and base in sd and not torch.equal(_fit_vocab(k, sd[k], want[base]), sd[base]):
            raise UserError(
                f"{source}: {k} differs from {base}; this model ties them (BERT's tied decoder)"
            )
    out = {ours: sd[hf] for ours, hf in _SIMPLE}
    for i in range(layers):
        L = f"bert.encoder.layer.{i}."
        for t in ("weight", "bias"):
            out[f"layers.{i}.attn.qkv.{t}"] = torch.cat(
                [sd[f"{L}attention.self.{p}.{t}"] for p in ("query", "key", "value")]
            )
            for ours, hf in _LAYER:
                out[f"layers.{i}.{ours}.{t}"] = sd[f"{L}{hf}.{t}"]
    out["nsp.weight"], out["nsp.bias"] = sd[_NSP[0]].flip(0), sd[_NSP[1]].flip(0)
    return out


def to_hf(ours: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """Our state dict -> Hugging Face BertForPreTraining names (the inverse of :func:`from_hf`),
    with the tied decoder weight and bias written out, so ``BertForPreTraining.load_state_dict``
    (strict) accepts it."""
    out = {hf: ours[o] for o, hf in _SIMPLE}
    for i in range(layers):
        L = f"bert.encoder.layer.{i}."
        for t in ("weight", "bias"):
            q, k, v = ours[f"layers.{i}.attn.qkv.{t}"].chunk(3)
            for part, x in (("query", q), ("key", k), ("value", v)):
                out[f"{L}attention.self.{part}.{t}"] = x
            for o, hf in _LAYER:
                out[f"{L}{hf}.{t}"] = ours[f"layers.{i}.{o}.{t}"]
    out["cls.predictions.decoder.weight"] = ours["word.weight"]
    out["cls.predictions.decoder.bias"] = ours["mlm_bias"]
    out[_NSP[0]], out[_NSP[1]] = ours["nsp.weight"].flip(0), ours["nsp.bias"].flip(0)
    copies: dict[
        int, torch.Tensor
    ] = {}  # one copy per source tensor: tied weights stay one tensor on disk
    return {k: copies.setdefault(id(v), v.detach().clone().contiguous()) for k, v in out.items()}


def load_init_checkpoint(
    model: torch.nn.Module, path: str | os.PathLike[str], copy: bool = True
) -> str:
    """Check ``path`` against ``model`` and (``copy``) load its weights; returns the layout found.

    Every rank checks names and shapes (from the memory-mapped file: no data read), so a bad
    checkpoint fails everywhere with the same line; only ranks with ``copy`` read the values
    (rank 0: data-parallel training broadcasts its weights to the others)."""
    sd = read_state_dict(path)
    model_sd = model.state_dict()
    src = f"model.init_checkpoint={os.fspath(path)}"
    if set(sd) == set(model_sd):
        shaped = [
            f"{k} {tuple(sd[k].shape)} (expected {tuple(v.shape)})"
            for k, v in model_sd.items()
            if sd[k].shape != v.shape
        ]
        if shaped:
            raise UserError(f"{src}: mis-shaped {_few(shaped)}")
        layout, ours = "scaleout", sd
    elif any(k.removeprefix("module.").startswith(("bert.", "cls.")) for k in sd):
        layout, ours = "huggingface/nvidia", from_hf(sd, model_sd, _layers(model_sd), src)
    else:
        raise UserError(
            f"{src}: keys {_few(sorted(sd))} are neither Hugging Face/NVIDIA BertForPreTraining "
            "(bert.*, cls.*) nor scaleout BERT names"
        )
    if copy:
        with torch.no_grad():
            for k, v in model_sd.items():
                v.copy_(ours[k])
    return layout


def _layers(model_sd: dict[str, torch.Tensor]) -> int:
    return 1 + max(int(m.group(1)) for k in model_sd if (m := re.match(r"layers\.(\d+)\.", k)))


def _few(keys: list[str], n: int = 4) -> str:
    more = f" and {len(keys) - n} more" if len(keys) > n else ""
    return "[" + ", ".join(keys[:n]) + "]" + more
