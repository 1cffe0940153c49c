"""The Llama family's model against Hugging Face's ``LlamaForCausalLM`` (the installed
transformers), packed rows against their documents alone, and the FLOP count against torch's
counter."""

from __future__ import annotations

import pytest
import torch

from scaleout.families.llama.config import LlamaConfig
from scaleout.families.llama.flops import llama_params, training_flops
from scaleout.families.llama.hf import export_hf, import_hf
from scaleout.families.llama.model import LlamaForCausalLM, labels_of, positions_of

# GQA (4 query heads over 2 key/value heads), the llama3 RoPE scaling with an original context
# short enough that all three wavelength bands occur at head size 16
TINY = LlamaConfig(
    vocab_size=97,
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    intermediate=96,
    seq_len=64,
    rope_theta=10000.0,
    rope_factor=8.0,
    rope_original_max_position=32,
)


def _model(c: LlamaConfig = TINY, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(c).eval()


@pytest.mark.unit
def test_logits_equal_hugging_face_after_export_and_import(tmp_path) -> None:
    from transformers import LlamaForCausalLM as HFLlama

    ours = _model()
    export_hf(ours, TINY, tmp_path / "hf")
    hf = HFLlama.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    assert sum(p.numel() for p in hf.parameters()) == llama_params(TINY)
    tokens = torch.randint(0, TINY.vocab_size, (2, 48))
    with torch.no_grad():
        want = hf(input_ids=tokens).logits
        got = ours(tokens)
    # same weights, same arithmetic up to the attention kernel's summation order
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # and back: the imported checkpoint is the same model
    c, state = import_hf(tmp_path / "hf")
    assert c == TINY.model_copy(update={"seq_len": c.seq_len})
    back = LlamaForCausalLM(c).eval()
    back.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(back(tokens), got, rtol=0, atol=0)


@pytest.mark.unit
def test_rope_scaling_is_hugging_faces_llama3() -> None:
    from transformers import LlamaConfig as HFConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from scaleout.families.llama.hf import hf_config
    from scaleout.families.llama.model import rope_inv_freq

    hf = HFConfig(**{k: v for k, v in hf_config(TINY).items() if k != "architectures"})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    got = rope_inv_freq(TINY)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    plain = rope_inv_freq(TINY.model_copy(update={"rope_factor": 1.0}))
    # the scaling touches the long wavelengths only, and some of them
    assert torch.equal(got[:1], plain[:1]) and not torch.equal(got, plain)


@pytest.mark.unit
def test_a_packed_row_gives_each_document_its_own_loss() -> None:
    model = _model()
    lengths = [20, 7, 30, 7]
    docs = [torch.randint(0, TINY.vocab_size, (1, n)) for n in lengths]
    row = torch.cat(docs, dim=1)
    doc_ids = torch.cat([torch.full((1, n), i) for i, n in enumerate(lengths)], dim=1)
    assert positions_of(doc_ids)[0, 20:27].tolist() == list(range(7))
    with torch.no_grad():
        packed = model.loss(row, doc_ids, reduction="none").view(1, -1)
        labels = labels_of(row, doc_ids)
        start = 0
        for d, n in zip(docs, lengths, strict=True):
            alone = model.loss(d, reduction="none")
            torch.testing.assert_close(packed[0, start : start + n], alone, rtol=1e-5, atol=1e-5)
            assert labels[0, start + n - 1] == -100  # the last token predicts nothing
            start += n
        # without doc_ids the documents would see each other: the losses differ
        leaky = model.loss(row, reduction="none").view(1, -1)
        assert not torch.allclose(leaky[0, 20:27], packed[0, 20:27], atol=1e-4)


@pytest.mark.unit
def test_flops_count_what_torch_counts() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    c = TINY.model_copy(update={"layers": 1})
    model = _model(c).train()
    lengths = [24, 40]
    tokens = torch.randint(0, c.vocab_size, (1, sum(lengths)))
    # each document alone (what the packed mask leaves of the attention is each document's own),
    # through SDPA's math kernel: torch's counter sees its matmuls (not the fused CPU kernel's)
    counted = 0
    for n in lengths:
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
            model.loss(tokens[:, :n]).backward()
        counted += fc.get_total_flops()
    # the math kernel multiplies the full S x S block; the causal half is the model's work
    attn_full = sum(3 * 4 * c.hidden * n * n * c.layers for n in lengths)
    attn_causal = sum(3 * 2 * c.hidden * n * (n + 1) * c.layers for n in lengths)
    assert counted - attn_full + attn_causal == training_flops(c, lengths)
