"""multihead.interop.hf.layers: one HF attention layer as a standalone multihead.Attention.

The real model is all-MiniLM-L6-v2 (bundled offline); GPT-2, Llama (GQA, scaled RoPE),
Qwen2 (q/k/v biases, no o bias) and Mistral (MQA, sliding window) are tiny random-weight
models built from their config classes. Every check compares numbers and prints the max
difference. (Whole models on multihead: test_interop_hf_registry.py; DeepSeek's MLA:
test_interop_hf_latent_attention.py.)
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import assert_close  # noqa: E402
from multihead import Attention  # noqa: E402
from multihead.interop import hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


SENTENCES = ["The cat sat on the mat.", "Hi there",
             "A much longer sentence, with many more tokens in it, to pad the others."]


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------ MiniLM


@pytest.fixture(scope="module")
def minilm():
    from transformers import AutoModel, AutoTokenizer

    from multihead.interop.loaders import minilm_path

    path = str(minilm_path())
    tok = AutoTokenizer.from_pretrained(path)
    eager = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    sdpa = AutoModel.from_pretrained(path, attn_implementation="sdpa").eval()
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    assert (batch["attention_mask"] == 0).any(), "the batch must be padded"
    with torch.no_grad():
        ref = eager(**batch, output_attentions=True)
        ref_sdpa = sdpa(**batch)
    return {"eager": eager, "sdpa": sdpa, "batch": batch, "ref": ref, "ref_sdpa": ref_sdpa}


# ------------------------------------------------------- tiny decoder models


def _tiny(family: str, impl: str):
    from transformers import (
        GPT2Config,
        GPT2Model,
        LlamaConfig,
        LlamaModel,
        MistralConfig,
        MistralModel,
        Qwen2Config,
        Qwen2Model,
    )

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=101,
                  max_position_embeddings=64)
    if family == "gpt2":
        cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=101,
                         scale_attn_by_inverse_layer_idx=True, bos_token_id=0, eos_token_id=0)
        cls = GPT2Model
    elif family == "llama":  # GQA: 8 query heads share 2 K/V heads; Llama 3's rope_theta
        cfg = LlamaConfig(num_attention_heads=8, num_key_value_heads=2, rope_theta=500000.0, **common)
        cls = LlamaModel
    elif family == "qwen2":  # q/k/v biases, no o bias
        cfg = Qwen2Config(num_attention_heads=4, num_key_value_heads=2, **common)
        cls = Qwen2Model
    else:  # mistral: MQA and a sliding window shorter than the input
        cfg = MistralConfig(num_attention_heads=4, num_key_value_heads=1, sliding_window=5, **common)
        cls = MistralModel
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # random biases, so that a dropped or misplaced one shows
        for name, p in model.named_parameters():
            if name.endswith("bias") and "norm" not in name and "ln" not in name:
                p.normal_(0, 0.5)
    return model


FAMILIES = ["gpt2", "llama", "qwen2", "mistral"]


# ------------------------------------------------------ standalone modules


def test_from_bert_standalone(minilm):
    block = minilm["eager"].encoder.layer[2].attention
    attn = hf.from_bert(block)
    x = torch.randn(2, 7, 384)
    with torch.no_grad():
        expected = block.output.dense(block.self(x)[0])
        got = attn(x)
    assert_close(got, expected, atol=1e-5, rtol=0, what="from_bert")


def test_from_gpt2_standalone_folds_the_layer_scale():
    model = _tiny("gpt2", "eager")
    x = torch.randn(2, 9, 64)
    for layer in (0, 1):  # layer 1 scales scores by 1 / (sqrt(D) * 2)
        src = model.h[layer].attn
        with torch.no_grad():
            # eager with no mask is not causal in transformers 5; pass the causal mask
            causal = torch.full((9, 9), float("-inf")).triu(1)[None, None]
            expected = src(x, attention_mask=causal)[0]
            got = hf.from_gpt2(src)(x)
        assert_close(got, expected, atol=1e-5, rtol=0, what=f"from_gpt2 layer {layer}")


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_from_llama_standalone(family):
    model = _tiny(family, "eager")
    src = model.layers[0].self_attn
    x = torch.randn(2, 9, 64)
    pos = torch.arange(9)[None].expand(2, -1)
    cos, sin = model.rotary_emb(x, pos)
    allowed = torch.ones(9, 9, dtype=torch.bool).tril()
    window = getattr(model.config, "sliding_window", None) if family == "mistral" else None
    if window:
        allowed &= ~torch.ones(9, 9, dtype=torch.bool).tril(-window)
    float_mask = torch.zeros(9, 9).masked_fill(~allowed, float("-inf"))[None, None]
    with torch.no_grad():
        expected = src(x, position_embeddings=(cos, sin), attention_mask=float_mask)[0]
        got = hf.from_llama(src)(x)  # Mistral's window is the module's sliding_window
    assert hf.from_llama(src).sliding_window == window
    assert_close(got, expected, atol=1e-5, rtol=0, what=f"from_llama {family}")


def test_convert_dispatch_and_errors(minilm):
    from transformers import LlamaConfig, LlamaModel

    assert isinstance(hf.from_layer(minilm["eager"].encoder.layer[0].attention), Attention)
    with pytest.raises(TypeError, match="no multihead conversion for Linear"):
        hf.from_layer(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="received BertSelfAttention"):
        hf.from_gpt2(minilm["eager"].encoder.layer[0].attention.self)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      vocab_size=50, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                      "short_factor": [1.0] * 4, "long_factor": [1.0] * 4,
                                                      "original_max_position_embeddings": 16})
    with pytest.raises(ValueError, match="rope_type 'longrope' is not supported; valid: 'default', 'linear'"):
        hf.from_llama(LlamaModel(cfg).layers[0].self_attn)


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0},
                                  {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
                                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}])
def test_from_llama_scaled_rope_equals_hf(rope):
    """Llama 3's and YaRN-scaled models convert with their scaling (float32 angles in HF,
    float64 in multihead: equal to float32 rounding over these positions)."""
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=50, max_position_embeddings=32,
                      rope_parameters={"rope_theta": 10000.0, **rope})
    torch.manual_seed(0)
    model = LlamaModel(cfg).eval()
    src = model.layers[0].self_attn
    T = 20
    x = torch.randn(2, T, 64)
    angles = model.rotary_emb(x, torch.arange(T)[None].expand(2, -1))
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        expected = src(x, position_embeddings=angles, attention_mask=causal)[0]
        got = hf.from_llama(src)(x)
    d = assert_close(got, expected, atol=1e-5, rtol=0, what=f"from_llama {rope['rope_type']}")
    print(f"{rope['rope_type']}: max |diff| {d:.1e}")


def test_hf_mask_forms():
    assert hf.hf_mask(None) is None
    keep = torch.tensor([[1, 1, 0]])
    assert torch.equal(hf.hf_mask(keep), keep.bool()[:, None, None, :])
    additive = torch.zeros(1, 1, 2, 3).masked_fill(~keep.bool()[:, None, None, :], torch.finfo(torch.float32).min)
    out = hf.hf_mask(additive)  # blocked keys become -inf; nothing is read back to the host
    assert torch.equal(torch.isneginf(out), ~keep.bool()[:, None, None, :].expand(1, 1, 2, 3))
    assert (out[~torch.isneginf(out)] == 0).all()
    biased = additive + torch.tensor([0.5, -0.25, 0.0])
    out = hf.hf_mask(biased)
    assert out.dtype == torch.float32 and torch.isneginf(out[..., 2]).all() and out[0, 0, 0, 0] == 0.5
    with pytest.raises(TypeError, match="attention mask of type object is not supported"):
        hf.hf_mask(object())
