"""multihead.interop.hf: HF attention layers as multihead.Attention, and patched models.

The real model is all-MiniLM-L6-v2 (bundled offline); GPT-2, Llama (GQA), Qwen2 (q/k/v
biases, no o bias) and Mistral (MQA, sliding window) are tiny random-weight models built
from their config classes. Every check compares numbers and prints the max difference.
"""

from __future__ import annotations

import copy

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

    from multihead.inspect.capture import minilm_path

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


def test_minilm_patched_hidden_states_padded_batch(minilm):
    batch = minilm["batch"]
    # The default backend runs torch's fused kernel: it equals HF's own fused (sdpa) path.
    patched = hf.patch(copy.deepcopy(minilm["sdpa"]))
    assert n_params(patched) == n_params(minilm["sdpa"])
    with torch.no_grad():
        out = patched(**batch).last_hidden_state
    d_fused = assert_close(out, minilm["ref_sdpa"].last_hidden_state, atol=1e-5, rtol=0,
                           what="patched (auto) vs HF sdpa")
    # The explicit path equals HF's eager path.
    patched_math = hf.patch(copy.deepcopy(minilm["eager"]), backend="math")
    with torch.no_grad():
        out_math = patched_math(**batch).last_hidden_state
    d_math = assert_close(out_math, minilm["ref"].last_hidden_state, atol=1e-5, rtol=0,
                          what="patched (math) vs HF eager")
    # Fused vs explicit differ by float32 rounding through 6 layers, exactly as much as
    # HF's own sdpa vs eager do.
    d_cross = assert_close(out, minilm["ref"].last_hidden_state, atol=1e-4, rtol=0, what="patched (auto) vs eager")
    d_hf = (minilm["ref_sdpa"].last_hidden_state - minilm["ref"].last_hidden_state).abs().max().item()
    assert d_cross <= 2 * d_hf + 1e-6, f"patched (auto) vs eager {d_cross:.2e}; HF sdpa vs eager {d_hf:.2e}"
    print(f"max |diff| hidden: auto vs sdpa {d_fused:.1e}, math vs eager {d_math:.1e}, auto vs eager {d_cross:.1e}")


def test_minilm_weights_equal_eager_output_attentions(minilm):
    batch = minilm["batch"]
    patched = hf.patch(copy.deepcopy(minilm["eager"]))
    with torch.no_grad():
        out = patched(**batch, output_attentions=True)
    assert len(out.attentions) == 6
    worst = 0.0
    for layer, (a, b) in enumerate(zip(out.attentions, minilm["ref"].attentions)):
        assert a.shape == b.shape == (3, 12, batch["input_ids"].shape[1], batch["input_ids"].shape[1])
        worst = max(worst, assert_close(a, b, atol=1e-5, rtol=0, what=f"layer {layer} weights"))
    print(f"max |diff| weights vs eager output_attentions: {worst:.1e}")


def test_minilm_layer_weights_on_the_same_input(minilm):
    """Given eager's own hidden states, each patched layer's weights match to float32 rounding."""
    from transformers import AutoModel  # noqa: F401  (transformers is loaded)

    batch = minilm["batch"]
    eager = minilm["eager"]
    with torch.no_grad():
        ref = eager(**batch, output_attentions=True, output_hidden_states=True)
    patched = hf.patch(copy.deepcopy(eager))
    mask = batch["attention_mask"].bool()[:, None, None, :]  # (B, 1, 1, S)
    for i, layer in enumerate(hf.patched_layers(patched)):
        layer.weight_heads = [0, 5, 11]
        with torch.no_grad():
            layer(ref.hidden_states[i], attention_mask=mask)
        assert layer.last_weights.shape[1] == 3
        assert_close(layer.last_weights, ref.attentions[i][:, [0, 5, 11]], atol=1e-6, rtol=0, what=f"layer {i}")


def test_patch_is_idempotent_and_moves_the_output_dense(minilm):
    model = copy.deepcopy(minilm["eager"])
    before = n_params(model)
    hf.patch(model)
    layers = hf.patched_layers(model)
    hf.patch(model)
    assert hf.patched_layers(model) == layers
    assert n_params(model) == before
    assert [layer.layer_idx for layer in layers] == list(range(6))
    block = model.encoder.layer[0].attention
    assert isinstance(block.output.dense, torch.nn.Identity)
    assert isinstance(block.self, transformers.models.bert.modeling_bert.BertSelfAttention)  # hooks still match
    assert isinstance(block.self.attn, Attention)


def test_output_attentions_hooks_installed_before_patch(minilm):
    model = copy.deepcopy(minilm["eager"])
    batch = minilm["batch"]
    with torch.no_grad():
        model(**batch, output_attentions=True)  # transformers installs its capture hooks now
        hf.patch(model)
        out = model(**batch, output_attentions=True)
    assert len(out.attentions) == 6
    assert_close(out.attentions[3], minilm["ref"].attentions[3], atol=1e-5, rtol=0, what="layer 3")


def test_weight_heads_subset_only(minilm, monkeypatch):
    import multihead.functional as F

    model = hf.patch(copy.deepcopy(minilm["sdpa"]))
    calls = []
    real = F._weights_pass

    def spy(q, k, mask, causal, scale, heads):
        calls.append(tuple(heads))
        return real(q, k, mask, causal, scale, heads)

    monkeypatch.setattr(F, "_weights_pass", spy)
    hf.set_weight_heads(model, {3: [5]})
    with torch.no_grad():
        model(**minilm["batch"])
    assert calls == [(5,)]
    layers = hf.patched_layers(model)
    assert all(layer.last_weights is None for i, layer in enumerate(layers) if i != 3)
    assert_close(layers[3].last_weights, minilm["ref"].attentions[3][:, [5]], atol=1e-5, rtol=0, what="L3 H5")


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


@pytest.fixture(scope="module")
def tokens():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 101, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0  # right padding
    return ids, mask


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_decoder_patched_equals_hf(family, tokens):
    ids, mask = tokens
    ref = _tiny(family, "eager")
    model = hf.patch(copy.deepcopy(ref))
    assert n_params(model) == n_params(ref)
    with torch.no_grad():
        r = ref(ids, attention_mask=mask, output_attentions=True)
        o = model(ids, attention_mask=mask, output_attentions=True)
    d = assert_close(o.last_hidden_state, r.last_hidden_state, atol=1e-5, rtol=0, what=f"{family} hidden")
    assert len(o.attentions) == len(r.attentions) == 2
    dw = max(assert_close(a, b, atol=1e-5, rtol=0, what=f"{family} weights L{i}")
             for i, (a, b) in enumerate(zip(o.attentions, r.attentions)))
    ref_sdpa = _tiny(family, "sdpa")
    model_sdpa = hf.patch(copy.deepcopy(ref_sdpa))
    with torch.no_grad():
        ds = assert_close(model_sdpa(ids, attention_mask=mask).last_hidden_state,
                          ref_sdpa(ids, attention_mask=mask).last_hidden_state, atol=1e-5, rtol=0,
                          what=f"{family} sdpa hidden")
    print(f"{family}: max |diff| hidden {d:.1e} (eager), {ds:.1e} (sdpa), weights {dw:.1e}")


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_decoder_with_hf_cache(family, tokens):
    """Prefill 7 tokens, then 5 more through HF's DynamicCache == one full forward."""
    from transformers import DynamicCache

    ids, _ = tokens
    ref = _tiny(family, "sdpa")
    model = hf.patch(copy.deepcopy(ref))
    with torch.no_grad():
        full = ref(ids).last_hidden_state
        cache = DynamicCache(config=model.config)
        a = model(ids[:, :7], use_cache=True, cache=cache)
        b = model(ids[:, 7:], use_cache=True, cache=a.past_key_values)
    assert_close(torch.cat([a.last_hidden_state, b.last_hidden_state], dim=1), full, atol=1e-5, rtol=0,
                 what=f"{family} cached decode")


def test_geometry_and_biases():
    llama = hf.patch(_tiny("llama", "eager"))
    attn = hf.patched_layers(llama)[0].attn
    assert (attn.n_heads, attn.n_kv_heads, attn.head_dim) == (8, 2, 8)
    assert attn.rope.base == 500000.0 and not attn.rope.interleaved
    assert attn.q_proj.bias is None and attn.o_proj.bias is None
    qwen = hf.patch(_tiny("qwen2", "eager"))
    attn = hf.patched_layers(qwen)[0].attn
    assert all(p.bias is not None for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert attn.o_proj.bias is None
    assert "o_proj.bias" not in dict(attn.named_parameters())
    gpt2 = hf.patch(_tiny("gpt2", "eager"))
    assert all(layer.attn.causal for layer in hf.patched_layers(gpt2))


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
    from multihead.masks import sliding_window

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
        got = hf.from_llama(src)(x, mask=sliding_window(window) if window else None)
    assert_close(got, expected, atol=1e-5, rtol=0, what=f"from_llama {family}")


def test_convert_dispatch_and_errors(minilm):
    from transformers import LlamaConfig, LlamaModel

    assert isinstance(hf.convert(minilm["eager"].encoder.layer[0].attention), Attention)
    with pytest.raises(TypeError, match="no multihead conversion for Linear"):
        hf.convert(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="received BertSelfAttention"):
        hf.from_gpt2(minilm["eager"].encoder.layer[0].attention.self)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      vocab_size=50, rope_scaling={"rope_type": "linear", "factor": 2.0})
    scaled = LlamaModel(cfg).layers[0].self_attn
    with pytest.raises(ValueError, match="rope_type 'linear'"):
        hf.from_llama(scaled)
    assert isinstance(hf.from_llama(scaled, strict_rope=False), Attention)
    with pytest.raises(ValueError, match="no supported attention layer in Sequential"):
        hf.patch(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(TypeError, match="received str"):
        hf.patch("bert")


def test_hf_mask_forms():
    assert hf.hf_mask(None) is None
    keep = torch.tensor([[1, 1, 0]])
    assert torch.equal(hf.hf_mask(keep), keep.bool()[:, None, None, :])
    additive = torch.zeros(1, 1, 2, 3).masked_fill(~keep.bool()[:, None, None, :], torch.finfo(torch.float32).min)
    assert torch.equal(hf.hf_mask(additive), keep.bool()[:, None, None, :].expand(1, 1, 2, 3))
    biased = additive + torch.tensor([0.5, -0.25, 0.0])
    out = hf.hf_mask(biased)
    assert out.dtype == torch.float32 and torch.isneginf(out[..., 2]).all() and out[0, 0, 0, 0] == 0.5
    with pytest.raises(TypeError, match="attn_implementation='eager' or 'sdpa'"):
        hf.hf_mask(object())


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_generate_with_left_padding_equals_unpatched(family):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if family == "gpt2":
        cls, cfg = GPT2LMHeadModel, GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=101,
                                               bos_token_id=0, eos_token_id=0, pad_token_id=0)
    else:
        cls, cfg = LlamaForCausalLM, LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                 num_attention_heads=8, num_key_value_heads=2, vocab_size=101,
                                                 max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    ref = cls(cfg).eval()
    model = hf.patch(copy.deepcopy(ref))
    ids = torch.randint(1, 101, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding, as batched generation uses
    with torch.no_grad():
        ref_scores = ref.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                  output_scores=True, return_dict_in_generate=True)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
    assert torch.equal(got.sequences, ref_scores.sequences)
    assert_close(torch.stack(got.scores), torch.stack(ref_scores.scores), atol=1e-4, rtol=0,
                 what=f"{family} generation logits")
