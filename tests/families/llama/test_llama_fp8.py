"""model.llama.fp8: FP8 matmuls through Transformer Engine on H100/H200, a one-line refusal
anywhere else.

Transformer Engine needs CUDA and cannot be installed here, so the swap is checked against a
stand-in ``transformer_engine`` (a mock for what cannot exist on this machine): its ``Linear`` is a
plain ``nn.Linear`` subclass and its ``fp8_autocast`` counts its entries. What is checked is ours:
which projections are swapped, that the weights move over unchanged, that the logits are unchanged
(the stand-in computes in full precision), that the decoder stack (and only it) runs inside the
autocast, and the refusals."""

from __future__ import annotations

import contextlib
import sys
import types

import pytest
import torch
from torch import nn

from scaleout.config import load_config
from scaleout.errors import ConfigError
from scaleout.families.llama import fp8
from scaleout.families.llama.config import LlamaConfig
from scaleout.families.llama.model import LlamaForCausalLM

TINY = LlamaConfig(
    vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=48, seq_len=16
)


def _stand_in(monkeypatch) -> dict:
    seen = {"autocast": 0, "recipe": None}

    class Linear(nn.Linear):
        def __init__(self, i, o, bias=True, params_dtype=None, device=None):
            super().__init__(i, o, bias=bias, dtype=params_dtype, device=device)

    @contextlib.contextmanager
    def fp8_autocast(enabled, fp8_recipe):
        seen["autocast"] += 1
        seen["recipe"] = fp8_recipe
        yield

    te = types.ModuleType("transformer_engine")
    pt = types.ModuleType("transformer_engine.pytorch")
    pt.Linear, pt.fp8_autocast = Linear, fp8_autocast
    common = types.ModuleType("transformer_engine.common")
    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.Format = types.SimpleNamespace(HYBRID="hybrid")
    recipe.DelayedScaling = lambda **kw: kw
    for name, mod in {
        "transformer_engine": te,
        "transformer_engine.pytorch": pt,
        "transformer_engine.common": common,
        "transformer_engine.common.recipe": recipe,
    }.items():
        monkeypatch.setitem(sys.modules, name, mod)
    seen["Linear"] = Linear
    return seen


@pytest.mark.unit
def test_fp8_is_refused_in_one_line_on_a_cpu_an_older_gpu_and_without_transformer_engine(
    monkeypatch,
):
    with pytest.raises(ConfigError, match=r"^model.llama.fp8=true: .*this run is on cpu"):
        fp8.require_fp8(torch.device("cpu"))
    cuda = torch.device("cuda", 0)  # a name only: the capability is given, no GPU is touched
    with pytest.raises(ConfigError, match=r"compute capability 8\.0; FP8 tensor cores need 8\.9"):
        fp8.require_fp8(cuda, capability=lambda d: (8, 0))
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # import fails
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    with pytest.raises(ConfigError, match=r"Transformer Engine is not installed.*scaleout\[fp8\]"):
        fp8.require_fp8(cuda, capability=lambda d: (9, 0))
    with pytest.raises(ConfigError) as e:
        fp8.require_fp8(torch.device("cpu"))
    assert "\n" not in str(e.value)
    cfg = load_config("llama_tiny_cpu", ["model.llama.fp8=true"])  # the key a user sets
    assert cfg.model.llama.fp8 is True


@pytest.mark.unit
def test_the_decoder_projections_become_transformer_engine_linears_with_the_same_weights(
    monkeypatch,
):
    seen = _stand_in(monkeypatch)
    te = fp8.require_fp8(torch.device("cuda", 0), capability=lambda d: (9, 0))
    torch.manual_seed(0)
    model = LlamaForCausalLM(TINY)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len))
    want = model(tokens)
    assert seen["autocast"] == 0
    assert fp8.enable_fp8(model, te) == 7 * TINY.layers
    swapped = [n for n, m in model.named_modules() if isinstance(m, seen["Linear"])]
    assert len(swapped) == 7 * TINY.layers and not any("lm_head" in n for n in swapped)
    assert isinstance(model.lm_head, nn.Linear) and not isinstance(model.lm_head, seen["Linear"])
    after = model.state_dict()
    assert after.keys() == before.keys()  # the Hugging Face names (export, checkpoints) hold
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert torch.equal(model(tokens), want)
    assert seen["autocast"] == 1  # one fp8_autocast around the decoder stack per forward
    assert seen["recipe"]["fp8_format"] == "hybrid"
