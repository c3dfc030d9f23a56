"""`multihead.convert.to_gqa` on Hugging Face models: num_key_value_heads changed on a
trained (here: random-init) Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma2 and Gemma3 model
running attn_implementation="multihead"; saved, reloaded by stock transformers (eager
attention, transformers' own code) and compared; the pooled weights against NumPy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import assert_close, attn_implementation  # noqa: E402
from multihead import convert  # noqa: E402
from multihead.interop import hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 101
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=V, max_position_embeddings=64,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, num_attention_heads=4, num_key_value_heads=4)
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3"]


def _config(name: str):
    t = transformers
    if name == "llama":
        return t.LlamaConfig(**COMMON)
    if name == "mistral":
        return t.MistralConfig(sliding_window=5, **COMMON)
    if name == "qwen2":  # q/k/v biases
        return t.Qwen2Config(**COMMON)
    if name == "qwen3":  # per-head q/k RMSNorm, head_dim set freely
        return t.Qwen3Config(head_dim=32, **COMMON)
    if name == "gemma":
        return t.GemmaConfig(head_dim=16, **COMMON)
    if name == "gemma2":  # softcap, alternating sliding/global layers
        return t.Gemma2Config(head_dim=16, sliding_window=5, attn_logit_softcapping=5.0, query_pre_attn_scalar=24,
                              **COMMON)
    if name == "gemma3":
        return t.Gemma3TextConfig(head_dim=16, sliding_window=5, query_pre_attn_scalar=16, **COMMON)
    raise AssertionError(name)


def build(name: str):
    torch.manual_seed(0)
    cfg = _config(name)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # random biases where there are some, so that pooling them is tested
        for pname, p in model.named_parameters():
            if pname.endswith("bias"):
                p.normal_(0.0, 0.5)
    model.set_attn_implementation("multihead")
    return model


def _ids():
    return torch.randint(3, V, (2, 11), generator=torch.Generator().manual_seed(1))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("name", FAMILIES)
def test_keeping_the_heads_is_exact(name):
    model = build(name)
    ids = _ids()
    same, report = convert.to_gqa(model, 4, return_report=True)
    assert report.errors == (0.0, 0.0)
    assert_close(_logits(same, ids), _logits(model, ids), atol=1e-6, rtol=0, what=f"{name} to_gqa(model, 4)")


@pytest.mark.parametrize("name", FAMILIES)
def test_saved_converted_model_reloads_in_stock_transformers(name, tmp_path):
    model = build(name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = _ids()
    gqa, report = convert.to_gqa(model, 2, return_report=True)
    assert gqa.config.num_key_value_heads == 2 and model.config.num_key_value_heads == 4
    assert [layer.name for layer in report.layers] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert all(0 < e < 1 for e in report.errors)
    for k, v in before.items():  # the input is untouched
        assert torch.equal(model.state_dict()[k], v), k
    # the pooled weights are the mean of each group of two heads (NumPy, by hand)
    attn, src = gqa.model.layers[1].self_attn, model.model.layers[1].self_attn
    D = src.head_dim
    w = src.v_proj.weight.detach().numpy().reshape(2, 2, D, -1)
    np.testing.assert_allclose(attn.v_proj.weight.detach().numpy(), ((w[:, 0] + w[:, 1]) / 2).reshape(2 * D, -1),
                               atol=1e-7)
    if src.k_proj.bias is not None:
        b = src.k_proj.bias.detach().numpy().reshape(2, 2, D)
        np.testing.assert_allclose(attn.k_proj.bias.detach().numpy(), ((b[:, 0] + b[:, 1]) / 2).reshape(-1),
                                   atol=1e-7)
    assert attn_implementation(gqa.config) == "multihead"
    converted = _logits(gqa, ids)
    gqa.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert loaded.config.num_key_value_heads == 2
    assert loaded.model.layers[0].self_attn.k_proj.out_features == 2 * D
    assert_close(_logits(loaded, ids), converted, atol=1e-5, rtol=0,
                 what=f"{name}: converted on multihead vs saved and reloaded, eager")


def test_hf_conversion_equals_the_multihead_layer_conversion():
    """from_llama(converted HF layer) == to_gqa(from_llama(original HF layer)), for every init."""
    model = build("qwen2")
    for init in ("mean", "first", "random"):
        gqa = convert.to_gqa(model, 1, init=init, generator=torch.Generator().manual_seed(5))
        layer = hf.from_llama(model.model.layers[0].self_attn)
        want = convert.to_gqa(layer, 1, init=init, generator=torch.Generator().manual_seed(5))
        got = hf.from_llama(gqa.model.layers[0].self_attn)
        for k, v in want.state_dict().items():
            assert torch.equal(got.state_dict()[k], v), (init, k)


def test_generation_uses_the_smaller_cache():
    model = build("llama")
    mqa = convert.to_gqa(model, 1)
    ids = _ids()
    with torch.no_grad():
        out = mqa.generate(input_ids=ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                           pad_token_id=0)
        eager = convert.to_gqa(model, 1)
        eager.set_attn_implementation("eager")
        ref = eager.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(out.sequences, ref)
    layer0 = out.past_key_values.layers[0]
    assert layer0.keys.shape[1] == 1  # (B, Hkv, S, D): one key head cached


def test_bad_input():
    model = build("llama")
    with pytest.raises(ValueError, match=r"must divide the model's 4 key/value heads \(config.num_key_value_heads\); "
                                         r"received 3; valid: 1, 2, 4"):
        convert.to_gqa(model, 3)
    with pytest.raises(ValueError, match=r"init must be one of mean, first, random"):
        convert.to_gqa(model, 2, init="svd")
    phi3 = transformers.Phi3ForCausalLM(transformers.Phi3Config(**COMMON))
    with pytest.raises(TypeError, match=r"fused qkv projection"):
        convert.to_gqa(phi3, 2)
    with pytest.raises(ValueError, match=r"to_mla: a transformers model has RoPE in every layer, so rope_dim"):
        convert.to_mla(model, 8)  # to_mla converts Llama-family models (tests/test_convert_hf_mla.py)
