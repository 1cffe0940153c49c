"""Hugging Face Llama checkpoints (``config.json`` + ``model.safetensors``), both ways.

The module names of :class:`~scaleout.families.llama.model.LlamaForCausalLM` are Hugging Face's,
and so is the rotation (half-split), so the tensors move unchanged; only the config is translated.
``config.json`` is written in the form every transformers release since 4.43 reads (``rope_theta``
and ``rope_scaling`` with ``rope_type: llama3``); reading takes that form and the newer
``rope_parameters``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from scaleout.errors import UserError
from scaleout.families.llama.config import LlamaConfig
from scaleout.fsutil import atomic_write, atomic_write_path

WEIGHTS = "model.safetensors"


def hf_config(c: LlamaConfig) -> dict[str, Any]:
    """``config.json`` of ``LlamaForCausalLM`` for the model ``c`` describes."""
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden,
        "intermediate_size": c.intermediate,
        "num_hidden_layers": c.layers,
        "num_attention_heads": c.heads,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max(c.seq_len, c.rope_original_max_position),
        "rms_norm_eps": c.rms_eps,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": c.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    if c.rope_factor != 1.0:
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": c.rope_factor,
            "low_freq_factor": c.rope_low_freq_factor,
            "high_freq_factor": c.rope_high_freq_factor,
            "original_max_position_embeddings": c.rope_original_max_position,
        }
    return out


def llama_config_of(hf: dict[str, Any], seq_len: int | None = None) -> LlamaConfig:
    """``model.llama`` from a Hugging Face ``config.json`` (one line naming what is unsupported)."""
    if hf.get("model_type") != "llama":
        raise UserError(f"config.json model_type={hf.get('model_type')!r}: expected 'llama'")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise UserError(f"config.json {key}=true: scaleout's Llama has no biases")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("llama3", "default"):
        raise UserError(f"config.json rope_type={kind!r}: expected 'llama3' or 'default'")
    heads = hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, hf["hidden_size"] // heads):
        raise UserError(f"config.json head_dim={hf['head_dim']}: expected hidden_size / heads")
    values: dict[str, Any] = {
        "vocab_size": hf["vocab_size"],
        "hidden": hf["hidden_size"],
        "layers": hf["num_hidden_layers"],
        "heads": heads,
        "kv_heads": hf.get("num_key_value_heads") or heads,
        "intermediate": hf["intermediate_size"],
        "rms_eps": hf.get("rms_norm_eps", 1e-6),
        "rope_theta": rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "seq_len": seq_len or hf.get("max_position_embeddings", 8192),
    }
    if kind == "llama3":
        values.update(
            rope_factor=rope["factor"],
            rope_low_freq_factor=rope["low_freq_factor"],
            rope_high_freq_factor=rope["high_freq_factor"],
            rope_original_max_position=rope["original_max_position_embeddings"],
        )
    else:
        values["rope_factor"] = 1.0
    return LlamaConfig(**values)


def export_hf(model: torch.nn.Module, c: LlamaConfig, out_dir: str | Path) -> Path:
    """Write ``model`` (scaleout's LlamaForCausalLM, or its state dict's owner) as a Hugging Face
    checkpoint directory: ``config.json`` and ``model.safetensors`` (fp32 as trained)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if c.tie_embeddings:
        state.pop("lm_head.weight", None)  # Hugging Face keeps the tied weight once
    atomic_write_path(out / WEIGHTS, lambda tmp: save_file(state, str(tmp), {"format": "pt"}))
    atomic_write(out / "config.json", json.dumps(hf_config(c), indent=2) + "\n")
    return out


def import_hf(path: str | Path, seq_len: int | None = None) -> tuple[LlamaConfig, dict]:
    """(``model.llama``, the state dict) of a Hugging Face Llama checkpoint directory (one
    ``model.safetensors`` or the sharded ``model-0000x-of-0000y.safetensors`` files)."""
    from safetensors.torch import load_file

    root = Path(path)
    if not (root / "config.json").is_file():
        raise UserError(f"{root}: expected a Hugging Face checkpoint directory with config.json")
    c = llama_config_of(json.loads((root / "config.json").read_text()), seq_len)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise UserError(f"{root}: no *.safetensors file (expected {WEIGHTS} or its shards)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    if c.tie_embeddings:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    return c, state
