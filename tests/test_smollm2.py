"""The bundled decoder LM, SmolLM2-135M-Instruct (Llama: 30 layers, 9 query / 3 KV heads of
64), as `load_model("smollm2")` gives it: its logits on attn_implementation="multihead" are
sdpa's, a head ablated by `multihead.heads.ablate` is that head's slice of o_proj's input
zeroed in transformers' eager attention, a model pruned by whole KV groups saves and
reloads with stock transformers as the ablated model, and the float32 cache gives back the
dequantized GGUF model exactly. One model load per test process (the `smollm2` fixture)."""

from __future__ import annotations

import copy
import sys
import time

import pytest
import torch

from conftest import assert_close, attn_implementation

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

TEXT = "When Mary and John went to the store, John gave a drink to Mary. The cat sat on the mat"


@pytest.fixture(scope="module")
def ids(smollm2):
    return smollm2.tokenizer(TEXT, return_tensors="pt")["input_ids"]  # (1, T)


@pytest.fixture(scope="module")
def plain(smollm2):
    """A copy of the transformers model the test module may switch between stock attentions."""
    return copy.deepcopy(smollm2.model)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits  # (1, T, vocab)


def _no_lm_quantizer(model):
    return getattr(model, "hf_quantizer", None) is None and getattr(model.config, "quantization_config", None) is None


def test_the_model_is_a_float32_causal_lm_on_multihead(smollm2):
    from multihead.interop.loaders import load_model

    assert load_model("smollm2") is smollm2  # kept for the session
    model = smollm2.model
    assert type(model) is transformers.LlamaForCausalLM
    assert attn_implementation(model.config) == "multihead"
    assert smollm2.has_lm_head and smollm2.is_causal_lm and smollm2.causal
    assert (smollm2.n_layers, smollm2.n_heads, smollm2.meta["n_kv_heads"]) == (30, 9, 3)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert _no_lm_quantizer(model)


def test_registry_logits_equal_sdpa(smollm2, plain, ids):
    plain.set_attn_implementation("sdpa")
    assert_close(_logits(smollm2.model, ids), _logits(plain, ids), atol=1e-5, rtol=0, what="multihead vs sdpa")


def test_ablating_a_head_equals_zeroing_its_slice_of_o_proj_input_in_eager(smollm2, plain, ids):
    from multihead import heads

    layer, head = 3, 4
    D = plain.config.head_dim
    plain.set_attn_implementation("eager")

    def zero_head(module, args):
        x = args[0].clone()  # (B, T, H * D): the heads' outputs side by side, o_proj's input
        x[..., head * D:(head + 1) * D] = 0
        return (x,)

    handle = plain.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(zero_head)
    try:
        expected = _logits(plain, ids)
    finally:
        handle.remove()
    with heads.ablate(smollm2.model, [(layer, head)]):
        got = _logits(smollm2.model, ids)
    assert (got - _logits(smollm2.model, ids)).abs().max() > 1e-3, "the ablation changed nothing"
    assert_close(got, expected, atol=1e-4, rtol=0, what=f"ablate {layer}.{head} vs eager with o_proj's slice zeroed")


def test_prune_whole_kv_groups_save_and_stock_reload_equal_the_ablated_model(smollm2, ids, tmp_path):
    from multihead import heads
    from multihead.interop.loaders import load_model

    cfg = smollm2.model.config
    H, Hkv, D, C = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    G = H // Hkv
    # one whole KV group per layer, a different one from layer to layer (layer 3: KV head 1, query heads 3, 4, 5)
    removed = [(layer, (layer + 1) % Hkv * G + g) for layer in range(cfg.num_hidden_layers) for g in range(G)]
    with heads.ablate(smollm2.model, removed):
        ablated = _logits(smollm2.model, ids)

    own = load_model("smollm2", fresh=True)
    assert own is not smollm2 and own.model is not smollm2.model
    n_before = sum(p.numel() for p in own.model.parameters())
    heads.prune(own.model, removed)
    own.model.save_pretrained(tmp_path)
    own.tokenizer.save_pretrained(tmp_path)

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()  # stock: no gguf, no multihead
    assert type(reloaded) is transformers.LlamaForCausalLM
    assert (reloaded.config.num_attention_heads, reloaded.config.num_key_value_heads) == (H - G, Hkv - 1)
    per_layer = G * D * C * 2 + D * C * 2  # q_proj rows and o_proj columns of G heads, k_proj and v_proj rows of one
    assert sum(p.numel() for p in reloaded.parameters()) == n_before - cfg.num_hidden_layers * per_layer
    assert_close(_logits(reloaded, ids), ablated, atol=1e-4, rtol=0, what="pruned, saved, stock reload vs ablated")
    assert smollm2.model.config.num_attention_heads == H  # the session's model was not the one pruned


def test_a_saved_folder_loads_as_a_causal_lm_with_its_head(smollm2, ids, tmp_path, monkeypatch):
    from multihead.interop import loaders

    smollm2.model.save_pretrained(tmp_path)  # writes files, changes nothing in the model
    smollm2.tokenizer.save_pretrained(tmp_path)
    monkeypatch.setattr(loaders, "_LOADED", {})  # loads afresh: no public call forgets a loaded model
    loaded = loaders.load_model(str(tmp_path))
    assert type(loaded.model) is transformers.LlamaForCausalLM  # not LlamaModel: the LM head is kept
    assert loaded.is_causal_lm
    assert attn_implementation(loaded.model.config) == "multihead"
    assert torch.equal(_logits(loaded.model, ids), _logits(smollm2.model, ids))


def test_the_float32_cache_gives_back_the_dequantized_model_exactly(smollm2, ids, tmp_path, monkeypatch):
    from multihead.interop import loaders

    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path / "cache"))
    path = loaders.smollm2_path()
    folder = loaders.gguf_cache_folder(path)
    assert folder.parent.parent == tmp_path / "cache" and not folder.exists()

    monkeypatch.setattr(loaders, "_LOADED", {})  # loads afresh: no public call forgets a loaded model
    t0 = time.perf_counter()
    first = loaders.load_model(str(path))  # reads the GGUF file and writes the cache
    t1 = time.perf_counter()
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    assert not [p.name for p in folder.parent.iterdir() if p.name.startswith(".")], "a temporary folder was left"

    monkeypatch.setattr(loaders, "_LOADED", {})  # loads afresh: no public call forgets a loaded model
    monkeypatch.setitem(sys.modules, "gguf", None)  # the cache hit must not read the GGUF file
    t2 = time.perf_counter()
    second = loaders.load_model("smollm2")
    t3 = time.perf_counter()
    print(f"SmolLM2 load: GGUF {t1 - t0:.1f} s, from the float32 cache {t3 - t2:.1f} s")

    assert type(second.model) is type(first.model) is transformers.LlamaForCausalLM
    a, b = first.model.state_dict(), second.model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:3]
    assert second.model.lm_head.weight.data_ptr() == second.model.model.embed_tokens.weight.data_ptr()  # tied
    logits = _logits(first.model, ids)
    assert torch.equal(_logits(second.model, ids), logits)
    assert torch.equal(logits, _logits(smollm2.model, ids))
    for text in (TEXT, "  Résumé: naïve café\n\tcode(x) = 42 ", "<|im_start|>user\nhi<|im_end|>"):
        assert first.tokenizer(text)["input_ids"] == second.tokenizer(text)["input_ids"], text
    keep = ("_name_or_path", "transformers_version", "architectures")
    assert ({k: v for k, v in first.model.config.to_dict().items() if k not in keep}
            == {k: v for k, v in second.model.config.to_dict().items() if k not in keep})
    assert _no_lm_quantizer(first.model) and _no_lm_quantizer(second.model)
