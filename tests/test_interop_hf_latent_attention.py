"""use_latent_attention(): DeepSeek-V2/V3 attention as LatentAttention inside a transformers model.

Tiny random-weight DeepSeek models from their config classes: the swapped model's
greedy `generate` gives transformers' tokens (left padding, batch 2), decodes on the
absorbed path with only the latent in its cache (bytes asserted), and saves the
original keys; `restore_attention` restores the original modules. YaRN (the published
DeepSeek-V2/V3 RoPE scaling) is compared with transformers' own layer.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import assert_close  # noqa: E402
from multihead.interop import hf  # noqa: E402
from multihead.latent import LatentAttention  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
R, ROPE, L = 16, 8, 2  # kv_rank, rope dim, layers


def _deepseek(version: int = 2, *, yarn: bool = False, q_rank: int | None = 24, interleave: bool = True):
    t = transformers
    kw = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=L,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=R, q_lora_rank=q_rank, qk_nope_head_dim=16,
              qk_rope_head_dim=ROPE, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
              first_k_dense_replace=1, vocab_size=101, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
    if yarn:
        kw["rope_parameters"] = dict(YARN)
    if version == 2:
        cfg, cls = t.DeepseekV2Config(**kw), t.DeepseekV2ForCausalLM
    else:
        cfg = t.DeepseekV3Config(n_group=1, topk_group=1, rope_interleave=interleave, **kw)
        cls = t.DeepseekV3ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # weights well away from the init, norms included
        for name, p in model.named_parameters():
            if "self_attn" in name:
                p.normal_(0.0 if p.dim() > 1 else 1.0, 0.3)
    return model


def _batch():
    ids = torch.randint(3, 101, (2, 8), generator=torch.Generator().manual_seed(1))
    keep = torch.ones_like(ids)
    keep[1, :3] = 0  # left padding
    return ids, keep


GEN = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)


@pytest.mark.parametrize("version, yarn, interleave", [(2, False, True), (2, True, True), (3, True, True),
                                                       (3, False, False)])
def test_generate_equal_with_a_latent_cache(version, yarn, interleave, monkeypatch):
    ref = _deepseek(version, yarn=yarn, interleave=interleave)
    model = hf.use_latent_attention(copy.deepcopy(ref))
    assert len(hf.latent_attention_layers(model)) == L
    paths = []
    for name in ("attend_absorbed", "attend_naive"):
        real = getattr(LatentAttention, name)
        # records which attention path each step took: the model reports neither
        monkeypatch.setattr(LatentAttention, name,
                            lambda self, *a, _real=real, _name=name, **k: paths.append(_name) or _real(self, *a, **k))
    ids, keep = _batch()
    with torch.no_grad():
        want = ref.generate(input_ids=ids, attention_mask=keep, **GEN)
        got = model.generate(input_ids=ids, attention_mask=keep, **GEN)
    assert torch.equal(got.sequences, want.sequences), f"{got.sequences} vs {want.sequences}"
    d = assert_close(torch.stack(got.scores), torch.stack(want.scores), atol=1e-4, rtol=0, what="logits")
    # prefill (T = 8): naive; every one-token step: absorbed
    assert paths[:L] == ["attend_naive"] * L and set(paths[L:]) == {"attend_absorbed"}
    S = ids.shape[1] + GEN["max_new_tokens"] - 1  # the last token is never fed back
    cache = got.past_key_values
    assert hf.latent_cache_bytes(cache) == L * 2 * S * (R + ROPE) * 4  # layers x B x S x (R + rope_dim) x fp32
    for layer in cache.layers:
        assert tuple(layer.keys.shape) == (2, 1, S, R + ROPE) and layer.values.shape[-1] == 0
    print(f"DeepSeek-V{version} yarn={yarn}: tokens equal, max |diff| logits {d:.1e}, "
          f"cache {hf.latent_cache_bytes(cache)} B (transformers: {hf.latent_cache_bytes(want.past_key_values)} B)")


def test_output_attentions_equal_eager():
    ref = _deepseek(2, yarn=True)
    ref.set_attn_implementation("eager")
    model = hf.use_latent_attention(copy.deepcopy(ref))
    ids, keep = _batch()
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=keep, output_attentions=True)
        got = model(input_ids=ids, attention_mask=keep, output_attentions=True)
    assert len(got.attentions) == L
    for i, (a, b) in enumerate(zip(got.attentions, want.attentions)):
        assert_close(a[0], b[0], atol=1e-5, rtol=0, what=f"weights layer {i}, unpadded row")
        assert_close(a[1, :, 3:], b[1, :, 3:], atol=1e-5, rtol=0, what=f"weights layer {i}, real queries")
    for a, b in ((got.logits[0], want.logits[0]), (got.logits[1, 3:], want.logits[1, 3:])):
        assert_close(a, b, atol=1e-5, rtol=0, what="logits")


def test_a_weights_request_and_output_attentions_with_latent_attention():
    """The swapped layer answers as the attention function does (registry.WeightsAnswer): the requested
    heads recorded, every head returned when output_attentions asks, a bad request refused."""
    ref = _deepseek(2)
    ref.set_attn_implementation("eager")
    model = hf.use_latent_attention(copy.deepcopy(ref))
    ids, keep = _batch()
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=keep, output_attentions=True).attentions
    layer = hf.latent_attention_layers(model)[1]
    for output_attentions in (False, True):
        request = hf.WeightsRequest({layer: [0, 3]})
        out = request.run(model, input_ids=ids, attention_mask=keep, output_attentions=output_attentions)
        got = request.get(layer)
        assert got.shape == (2, 2, 8, 8)
        assert_close(got[0], want[1][0, [0, 3]], atol=1e-5, rtol=0, what="requested heads, unpadded row")
        assert_close(got[1, :, 3:], want[1][1, [0, 3], 3:], atol=1e-5, rtol=0, what="requested heads, real queries")
        if output_attentions:
            assert_close(out.attentions[1][0], want[1][0], atol=1e-5, rtol=0, what="every head to transformers")
        else:
            assert out.attentions is None
    with pytest.raises(TypeError, match="multihead_weights= takes a multihead.interop.hf.WeightsRequest; "
                                        "received str"):
        model(input_ids=ids, multihead_weights="heads")


def test_save_pretrained_writes_the_original_keys(tmp_path):
    ref = _deepseek(2, yarn=True)
    model = hf.use_latent_attention(copy.deepcopy(ref))
    assert sorted(model.state_dict()) == sorted(ref.state_dict())
    model.save_pretrained(tmp_path)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not hf.uses_latent_attention(plain)
    ids, keep = _batch()
    with torch.no_grad():
        a = plain(input_ids=ids, attention_mask=keep).logits
        b = ref(input_ids=ids, attention_mask=keep).logits
    assert torch.equal(a, b), f"reloaded plain model differs by {(a - b).abs().max():.2e}"


def test_parameters_are_shared_and_restore_attention_puts_the_layers_back():
    ref = _deepseek(2)
    model = copy.deepcopy(ref)
    originals = [layer.self_attn for layer in model.model.layers]
    n_params = sum(p.numel() for p in model.parameters())
    hf.use_latent_attention(model)
    hf.use_latent_attention(model)  # twice: a no-op
    assert sum(p.numel() for p in model.parameters()) == n_params
    layer = hf.latent_attention_layers(model)[0]
    assert layer.mla.kv_b_proj is originals[0].kv_b_proj  # shared, not copied
    with torch.no_grad():  # training the patched model trains the original weights
        layer.kv_b_proj.weight.mul_(1.5)
    hf.restore_attention(model)
    assert [layer.self_attn for layer in model.model.layers] == originals and not hf.uses_latent_attention(model)
    assert torch.equal(originals[0].kv_b_proj.weight, ref.model.layers[0].self_attn.kv_b_proj.weight * 1.5)


def test_from_deepseek_with_yarn_equals_the_transformers_layer():
    ref = _deepseek(2, yarn=True, q_rank=None)
    ref.set_attn_implementation("eager")
    layer = ref.model.layers[0].self_attn
    mla = hf.from_deepseek(layer)
    assert mla.rope.scaling.kind == "yarn" and abs(mla.scale - layer.scaling) < 1e-15
    T = 20  # past original_max_position_embeddings (16), where YaRN changes the angles
    x = torch.randn(2, T, 64)
    positions = torch.arange(T)[None].expand(2, T)
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want, _ = layer(x, attention_mask=causal, position_embeddings=ref.model.rotary_emb(x, positions))
        got = mla(x)
    assert_close(got, want, atol=1e-5, rtol=0, what="from_deepseek (YaRN) vs DeepseekV2Attention")


def test_use_latent_attention_refuses_models_without_mla():
    llama = transformers.LlamaModel(transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
                                                             num_hidden_layers=1, num_attention_heads=4, vocab_size=50))
    with pytest.raises(ValueError, match=r"LlamaModel has none\. To run any other model on multihead, use "
                                         r"model\.set_attn_implementation\('multihead'\)"):
        hf.use_latent_attention(llama)
    with pytest.raises(TypeError, match="received str"):
        hf.use_latent_attention("deepseek")
    with pytest.raises(TypeError, match="received int"):
        hf.restore_attention(3)


def test_inspect_captures_a_model_with_latent_attention():
    """multihead inspect reaches the swapped layers too (through the same WeightsRequest)."""
    from multihead.inspect import capture
    from multihead.interop.loaders import minilm_path

    tok = transformers.AutoTokenizer.from_pretrained(str(minilm_path()))
    t = transformers
    cfg = t.DeepseekV2Config(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=L,
                             num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=R, q_lora_rank=24,
                             qk_nope_head_dim=16, qk_rope_head_dim=ROPE, v_head_dim=12, n_routed_experts=4,
                             num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                             vocab_size=len(tok), max_position_embeddings=64, rope_parameters=dict(YARN))
    torch.manual_seed(0)
    ref = t.DeepseekV2Model(cfg).eval()
    ref.set_attn_implementation("eager")
    model = hf.use_latent_attention(copy.deepcopy(ref))
    cap = capture("The cat sat on the mat.", model=(model, tok), layers=[1], heads=[0, 3])
    with torch.no_grad():
        want = ref(torch.tensor([cap.token_ids]), output_attentions=True).attentions[1][0, [0, 3]]
    assert_close(cap.weights[0], want, atol=1e-5, rtol=0, what="patched DeepSeek capture vs eager")


@pytest.mark.slow
def test_decode_benchmark_runs(tmp_path):
    """benchmarks/hf_mla.py --quick: exits 0 only if every way gives transformers' tokens;
    its JSON has equal cache bytes for the three ways (transformers 5 caches the latent)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "hf_mla.json"
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "hf_mla.py"), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=root,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"transformers", "registry", "patched"} and all(r["tokens_equal"] for r in rows.values())
    assert len({r["cache_bytes"] for r in rows.values()}) == 1


@pytest.mark.parametrize("version", [2, 3])
def test_a_model_with_latent_attention_pickles_and_loads_back_equal(version, tmp_path):
    """torch.save of the whole swapped model (a class made at swap time) loads back swapped,
    with the same outputs, sharing parameters as before, and restores to the original."""
    ref = _deepseek(version, yarn=True)
    model = hf.use_latent_attention(copy.deepcopy(ref))
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert len(hf.latent_attention_layers(loaded)) == L
    layer = hf.latent_attention_layers(loaded)[0]
    assert layer.mla.kv_b_proj is layer.kv_b_proj  # still shared after the round trip
    assert type(layer) is type(hf.latent_attention_layers(model)[0])  # the same class, made once per process
    ids, keep = _batch()
    with torch.no_grad():
        a = loaded(input_ids=ids, attention_mask=keep).logits
        b = ref(input_ids=ids, attention_mask=keep).logits
    assert_close(a, b, atol=1e-5, rtol=0, what="reloaded patched model vs the plain one")
    hf.restore_attention(loaded)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids, attention_mask=keep).logits, b)
    copied = copy.deepcopy(model)  # deepcopy takes the same road
    assert hf.latent_attention_layers(copied)[0].mla.o_proj is hf.latent_attention_layers(copied)[0].o_proj
