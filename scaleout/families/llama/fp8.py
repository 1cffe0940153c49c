"""FP8 matmuls for the llama family (``model.llama.fp8``), through NVIDIA Transformer Engine.

On an H100/H200 (compute capability 8.9 or newer) the decoder layers' seven projections (q, k, v,
o; gate, up, down) become ``transformer_engine.pytorch.Linear`` modules holding the same weights,
and the decoder stack runs inside ``fp8_autocast`` with the MLCommons reference's delayed-scaling
recipe (small_llm_pretraining/nemo/pretrain_llama31.py: ``fp8="hybrid"``, E4M3 forward and E5M2
gradients, an amax history of 4, the most recent amax). The embedding, the
norms, attention's softmax and the output projection stay in the run's precision (bf16 autocast).
Each replica keeps its own scaling history (``fp8_group`` is left unset): every replica's master
weights still receive the same averaged gradient, so replicas stay identical where it matters.

Transformer Engine is an optional extra (``pip install 'scaleout[fp8]'``, or an NGC PyTorch
container, which ships it). Anywhere else -- a CPU, an older GPU, no Transformer Engine -- asking
for FP8 is a one-line refusal naming what is missing; nothing falls back silently.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from scaleout.errors import ConfigError

MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9) and Hopper (9.0) onwards
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def require_fp8(
    device: torch.device, capability: Callable[[torch.device], tuple[int, int]] = _capability
) -> Any:
    """Transformer Engine's PyTorch module, or a ConfigError naming why FP8 cannot run here."""
    if device.type != "cuda":
        raise ConfigError(
            f"model.llama.fp8=true: FP8 matmuls need an H100/H200-class CUDA GPU and Transformer "
            f"Engine; this run is on {device.type} (expected model.llama.fp8=false)"
        )
    cap = capability(device)
    if tuple(cap) < MIN_CAPABILITY:
        raise ConfigError(
            f"model.llama.fp8=true: this GPU has compute capability {cap[0]}.{cap[1]}; FP8 "
            "tensor cores need 8.9 or newer (H100, H200, L40S)"
        )
    try:
        return importlib.import_module("transformer_engine.pytorch")
    except ImportError:
        raise ConfigError(
            "model.llama.fp8=true: Transformer Engine is not installed; expected "
            "`pip install 'scaleout[fp8]'` or an NGC PyTorch container"
        ) from None


def enable_fp8(model: nn.Module, te: Any) -> int:
    """Swap the decoder layers' projections of ``model`` (a LlamaForCausalLM) for Transformer
    Engine Linears with the same weights, and run the decoder stack under ``fp8_autocast``.
    Returns the number of projections swapped."""
    swapped = 0
    for layer in model.model.layers:
        for block in (layer.self_attn, layer.mlp):
            for name in PROJECTIONS:
                old = getattr(block, name, None)
                if not isinstance(old, nn.Linear):
                    continue
                new = te.Linear(
                    old.in_features,
                    old.out_features,
                    bias=False,
                    params_dtype=old.weight.dtype,
                    device=old.weight.device,
                )
                with torch.no_grad():
                    new.weight.copy_(old.weight)
                setattr(block, name, new)
                swapped += 1
    recipe_mod = importlib.import_module("transformer_engine.common.recipe")
    recipe = recipe_mod.DelayedScaling(
        fp8_format=recipe_mod.Format.HYBRID, amax_history_len=4, amax_compute_algo="most_recent"
    )
    model.model.stack_context = lambda: te.fp8_autocast(enabled=True, fp8_recipe=recipe)
    return swapped
