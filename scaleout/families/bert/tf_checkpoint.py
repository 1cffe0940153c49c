"""The MLCommons BERT phase-1 TensorFlow checkpoint -> a state dict ``model.init_checkpoint`` reads.

MLPerf BERT phase 2 starts from ``model.ckpt-28252`` (the reference's tf.train checkpoint, written
by the TF1 ``Saver`` of Google's BERT ``run_pretraining.py``). Its variables use Google BERT's
names; :func:`hf_name` maps each to Hugging Face ``BertForPreTraining`` names, which
:func:`scaleout.families.bert.convert.load_init_checkpoint` already reads::

    bert/embeddings/{word,position,token_type}_embeddings  -> bert.embeddings.*_embeddings.weight
    .../LayerNorm/gamma, beta                              -> .../LayerNorm.weight, .bias
    .../{query,key,value,dense}/kernel  [in, out]          -> ...weight [out, in] (transposed)
    .../bias                                               -> ...bias
    cls/predictions/output_bias                            -> cls.predictions.bias
    cls/seq_relationship/output_weights [2, H]             -> cls.seq_relationship.weight (as is:
                                                              Google's BERT multiplies by its
                                                              transpose)
    cls/seq_relationship/output_bias                       -> cls.seq_relationship.bias

The optimizer's slots (``.../adam_m``, ``.../adam_v``) and ``global_step`` carry no weights and
are left out. Reading the checkpoint needs TensorFlow (``pip install 'scaleout[tf]'``): its
bundle reader is the one that wrote the file, so nothing here re-implements the format.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from scaleout.errors import UserError
from scaleout.families.bert.config import BertConfig
from scaleout.families.bert.convert import from_hf
from scaleout.families.bert.model import BertForPreTraining
from scaleout.fsutil import atomic_write_path

# TF names that are not model weights: LAMB/Adam slots, the step counter, the LR schedule's state
_SKIP = re.compile(r"(/adam_[mv]$|^global_step$|AdamWeightDecayOptimizer|LAMB|/Momentum$)")
_RENAMES = [  # applied in order to the TF path after '/' -> '.'
    (r"_embeddings$", "_embeddings.weight"),
    (r"\.LayerNorm\.gamma$", ".LayerNorm.weight"),
    (r"\.LayerNorm\.beta$", ".LayerNorm.bias"),
    (r"\.kernel$", ".weight"),
    (r"\.layer_(\d+)\.", r".layer.\1."),
    (r"^cls\.predictions\.output_bias$", "cls.predictions.bias"),
    (r"^cls\.seq_relationship\.output_weights$", "cls.seq_relationship.weight"),
    (r"^cls\.seq_relationship\.output_bias$", "cls.seq_relationship.bias"),
]


def hf_name(tf_name: str) -> str | None:
    """Hugging Face name of a Google BERT TF variable; None for an optimizer slot or counter."""
    if _SKIP.search(tf_name):
        return None
    name = tf_name.replace("/", ".")
    for pat, rep in _RENAMES:
        name = re.sub(pat, rep, name)
    return name


def checkpoint_prefix(path: str | os.PathLike[str]) -> str:
    """The tf.train prefix (``.../model.ckpt-28252``) of a prefix, its ``.index`` file or a
    directory holding exactly one checkpoint."""
    p = Path(path)
    if p.suffix == ".index" and p.is_file():
        return str(p.with_suffix(""))
    if p.with_name(p.name + ".index").is_file():
        return str(p)
    if p.is_dir():
        found = sorted(p.glob("*.index"))
        if len(found) == 1:
            return str(found[0].with_suffix(""))
        if found:
            names = ", ".join(f.stem for f in found)
            raise UserError(f"{p}: holds {len(found)} TF checkpoints ({names}); name one prefix")
    raise UserError(
        f"{p}: not a TensorFlow checkpoint; expected a prefix such as model.ckpt-28252 (beside "
        "model.ckpt-28252.index and .data-00000-of-00001) or the directory holding it"
    )


def _tf():  # noqa: ANN202 - the tensorflow module, imported only here (a 15 s import)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # only errors from TF's C++ logging
    try:
        import tensorflow as tf  # deferred: optional (the tf extra), a 15 s import
    except ImportError:
        raise UserError(
            "reading a TensorFlow checkpoint needs tensorflow: pip install 'scaleout[tf]' "
            "(tensorflow-cpu)"
        ) from None
    return tf


def read_tf_checkpoint(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The model weights of a Google BERT TF checkpoint, in Hugging Face names (kernels
    transposed to torch's [out, in]). Raises UserError for a TF name this mapping does not know,
    so a different model's checkpoint is not silently half-converted."""
    prefix = checkpoint_prefix(path)
    tf = _tf()
    try:
        reader = tf.train.load_checkpoint(prefix)
    except Exception as exc:  # noqa: BLE001 - TF raises its own error types for a bad bundle
        raise UserError(f"{prefix}: TensorFlow cannot read this checkpoint ({exc})") from None
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for tf_name in sorted(reader.get_variable_to_shape_map()):
        name = hf_name(tf_name)
        if name is None:
            continue
        if not name.startswith(("bert.", "cls.")):
            unknown.append(tf_name)
            continue
        value = torch.from_numpy(reader.get_tensor(tf_name).copy())
        out[name] = value.t().contiguous() if tf_name.endswith("/kernel") else value
    if unknown or not out:
        what = f"variables {unknown[:4]} are not Google BERT's" if unknown else "no BERT weights"
        raise UserError(f"{prefix}: {what} (expected bert/..., cls/... names)")
    return out


def convert(
    src: str | os.PathLike[str], out: str | os.PathLike[str], bert: BertConfig | None = None
) -> dict[str, torch.Tensor]:
    """Write the weights of TF checkpoint ``src`` to ``out`` (torch.save, Hugging Face names:
    ``model.init_checkpoint=out`` loads it); returns them. With ``bert`` (a model.bert config),
    they are first checked against that model's names and shapes, so a mismatch writes nothing."""
    sd = read_tf_checkpoint(src)
    if bert is not None:
        with torch.device("meta"):  # names and shapes only: no memory for the weights
            model_sd = BertForPreTraining(bert).state_dict()
        from_hf(sd, model_sd, bert.layers, source=f"{checkpoint_prefix(src)} (model.bert config)")
    atomic_write_path(Path(out), lambda tmp: torch.save(sd, tmp))
    return sd
