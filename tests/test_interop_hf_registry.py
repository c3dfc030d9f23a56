"""attn_implementation="multihead": transformers' attention registry on multihead's kernel.

Tiny random-weight models built from transformers' config classes (no downloads), one per
architecture family the registry reaches, and the real all-MiniLM-L6-v2 (bundled
offline). Like for like, in float32: "multihead" (backend auto: torch's fused kernel)
against transformers' "sdpa", and "multihead_math" (the explicit backend) against
"eager". Every comparison prints its max difference; a spy checks that multihead's
function really ran (so the test cannot compare transformers with itself).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import assert_close, attn_implementation  # noqa: E402
from multihead import functional  # noqa: E402
from multihead.interop import hf  # noqa: E402
from multihead.interop.hf import registry  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

hf.register("multihead_math", backend="math")

V = 101  # vocabulary of the tiny models
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=V, max_position_embeddings=64,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _config(name: str):
    """(config, base model class, causal-LM class or None) of a tiny model."""
    t = transformers
    if name == "bert":
        return (t.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                             vocab_size=V, max_position_embeddings=64), t.BertModel, None)
    if name == "gpt2":  # layer 1 scales its scores by 1 / (2 sqrt(D))
        return (t.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=V,
                             scale_attn_by_inverse_layer_idx=True, bos_token_id=1, eos_token_id=2, pad_token_id=0),
                t.GPT2Model, t.GPT2LMHeadModel)
    if name == "llama":  # GQA: 8 query heads on 2 K/V heads
        return t.LlamaConfig(num_attention_heads=8, num_key_value_heads=2, **COMMON), t.LlamaModel, t.LlamaForCausalLM
    if name == "mistral":  # MQA and a sliding window shorter than the input
        return (t.MistralConfig(num_attention_heads=4, num_key_value_heads=1, sliding_window=5, **COMMON),
                t.MistralModel, t.MistralForCausalLM)
    if name == "qwen2":  # q/k/v biases
        return t.Qwen2Config(num_attention_heads=4, num_key_value_heads=2, **COMMON), t.Qwen2Model, t.Qwen2ForCausalLM
    if name == "qwen3":  # q/k RMSNorm, head_dim set freely
        return (t.Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=32, **COMMON),
                t.Qwen3Model, t.Qwen3ForCausalLM)
    if name == "gemma2":  # softcap, alternating sliding/global layers, query_pre_attn_scalar
        return (t.Gemma2Config(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
                               attn_logit_softcapping=5.0, query_pre_attn_scalar=24, **COMMON),
                t.Gemma2Model, t.Gemma2ForCausalLM)
    if name == "phi3":  # fused qkv_proj
        return t.Phi3Config(num_attention_heads=4, num_key_value_heads=2, **COMMON), t.Phi3Model, t.Phi3ForCausalLM
    if name == "gpt_neox":  # partial rotary (a quarter of each head)
        return (t.GPTNeoXConfig(num_attention_heads=4, rotary_pct=0.25, **COMMON),
                t.GPTNeoXModel, t.GPTNeoXForCausalLM)
    if name == "bart":  # encoder, decoder and cross-attention
        return (t.BartConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                             decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=V,
                             max_position_embeddings=64), t.BartModel, None)
    if name == "t5":  # a learned relative position bias (position_bias) on the scores
        return (t.T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=V),
                t.T5Model, None)
    if name == "vit":
        return (t.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                            image_size=16, patch_size=4), t.ViTModel, None)
    if name == "deepseek_v2":  # MLA: q (D + rope_dim) and v (Dv) widths differ
        return (t.DeepseekV2Config(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                                   q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                                   n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                   first_k_dense_replace=1, vocab_size=V, max_position_embeddings=64,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2),
                t.DeepseekV2Model, t.DeepseekV2ForCausalLM)
    if name == "gpt_oss":  # attention sinks (s_aux), sliding layers
        return (t.GptOssConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                               num_experts_per_tok=2, sliding_window=5,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **COMMON),
                t.GptOssModel, t.GptOssForCausalLM)
    raise KeyError(name)


MODELS = ["bert", "gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "gpt_neox", "bart", "t5", "vit",
          "deepseek_v2", "gpt_oss"]
DECODERS = ["gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "gpt_neox", "deepseek_v2", "gpt_oss"]
NO_SDPA = {"gemma2", "gpt_oss"}  # transformers refuses sdpa for them (softcap, sinks): compare with eager only


def _sharpen(model, name: str) -> None:
    """Random biases everywhere (a dropped one shows), large Gemma-2 scores (the softcap
    bites), non-zero GPT-OSS sinks (they matter)."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias") and "norm" not in pname and "ln" not in pname and p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            if name == "gemma2" and pname.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(12.0)
            if pname.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))


def build(name: str, *, lm: bool = False):
    cfg, base, causal_lm = _config(name)
    torch.manual_seed(0)
    model = (causal_lm if lm else base)(cfg).eval()
    _sharpen(model, name)
    return model


def _inputs(name: str):
    g = torch.Generator().manual_seed(1)
    if name == "vit":
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=g)}, None
    ids = torch.randint(3, V, (2, 12), generator=g)
    keep = torch.ones(2, 12, dtype=torch.long)
    pad_left = name in DECODERS
    if pad_left:
        keep[1, :3] = 0  # left padding, as batched generation uses
    else:
        keep[1, 9:] = 0  # right padding
    inputs = {"input_ids": ids, "attention_mask": keep}
    if name in ("bart", "t5"):
        inputs["decoder_input_ids"] = ids[:, :7]  # T = 7 queries over S = 12 encoder keys
    return inputs, keep.bool()


def _real(t: torch.Tensor, keep) -> list[torch.Tensor]:
    """The rows of real (non-padded) tokens of each batch item of t `(B, T, ...)`."""
    if keep is None or t.shape[1] != keep.shape[1]:
        return [t[b] for b in range(t.shape[0])]
    return [t[b, keep[b]] for b in range(t.shape[0])]


def _attentions(out) -> list[torch.Tensor]:
    if hasattr(out, "attentions"):
        return list(out.attentions)
    return list(out.encoder_attentions) + list(out.decoder_attentions) + list(out.cross_attentions)


class Spy:
    """Counts the calls of multihead's attention function."""

    def __init__(self, monkeypatch):
        self.calls = 0
        # the registry counts nothing: spies on its three ways into the kernels count its calls
        real_kernel, real_explicit = registry.attend, registry._with_sinks

        def kernel(*args, **kwargs):
            self.calls += 1
            return real_kernel(*args, **kwargs)

        def explicit(*args, **kwargs):
            self.calls += 1
            return real_explicit(*args, **kwargs)

        real_step = functional.decode_step

        def step(*args, **kwargs):  # the decode step's entry: a call where it answers (None: attend follows)
            out = real_step(*args, **kwargs)
            self.calls += out is not None
            return out

        monkeypatch.setattr(registry, "attend", kernel)  # counts the calls of the kernel (see above)
        monkeypatch.setattr(registry, "_with_sinks", explicit)  # and of the sinks path
        monkeypatch.setattr(functional, "decode_step", step)  # and of the plain decode step's


def _run(model, impl: str, inputs, **kw):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(**inputs, **kw)


@pytest.mark.parametrize("name", MODELS)
def test_hidden_states_and_attentions_equal_transformers(name, monkeypatch):
    model = build(name)
    inputs, keep = _inputs(name)
    spy = Spy(monkeypatch)
    hidden = lambda o: o.last_hidden_state  # noqa: E731
    eager = _run(model, "eager", inputs, output_attentions=True)
    mine_math = _run(model, "multihead_math", inputs, output_attentions=True)
    n_att = len(_attentions(eager))
    assert n_att > 0 and spy.calls == n_att, f"multihead ran {spy.calls} times for {n_att} attention layers"
    worst = {"math~eager": 0.0, "weights": 0.0}
    for a, b in zip(_real(hidden(mine_math), keep), _real(hidden(eager), keep)):
        worst["math~eager"] = max(worst["math~eager"], assert_close(a, b, atol=1e-5, rtol=0, what=f"{name} hidden"))
    mine_weights = _attentions(mine_math)
    if name == "gpt2":  # GPT2Attention keeps output_attentions to itself: ask through a WeightsRequest
        assert mine_weights == []
        modules = [block.attn for block in model.h]
        request = hf.WeightsRequest(dict.fromkeys(modules))
        request.run(model, **inputs)
        mine_weights = [request.get(m) for m in modules]
    assert len(mine_weights) == n_att
    for i, (a, b) in enumerate(zip(mine_weights, _attentions(eager))):
        assert a.shape == b.shape, f"{name} attentions {i}: {a.shape} vs {b.shape}"
        q_keep = keep if keep is not None and a.shape[2] == keep.shape[1] else None
        for x, y in zip(_real(a.transpose(1, 2), q_keep), _real(b.transpose(1, 2), q_keep)):  # real query rows
            worst["weights"] = max(worst["weights"], assert_close(x, y, atol=1e-5, rtol=0, what=f"{name} weights {i}"))
    if name not in NO_SDPA:
        sdpa = _run(model, "sdpa", inputs)
        calls = spy.calls
        mine = _run(model, "multihead", inputs)
        assert spy.calls == calls + n_att
        worst["auto~sdpa"] = max(assert_close(a, b, atol=1e-5, rtol=0, what=f"{name} hidden vs sdpa")
                                 for a, b in zip(_real(hidden(mine), keep), _real(hidden(sdpa), keep)))
    print(name, ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))


def test_the_softcap_and_the_sinks_matter():
    """The Gemma-2 and GPT-OSS comparisons above would be empty if their softcap and sinks
    changed nothing: without them the outputs move by far more than the tolerance."""
    for name, attr in (("gemma2", "attn_logit_softcapping"), ("gpt_oss", None)):
        model = build(name)
        inputs, _ = _inputs(name)
        ref = _run(model, "multihead", inputs).last_hidden_state
        if attr:
            setattr(model.config, attr, None)
            for layer in model.layers:
                layer.self_attn.attn_logit_softcapping = None
        else:
            with torch.no_grad():
                for layer in model.layers:
                    layer.self_attn.sinks.fill_(-1e9)
        changed = _run(model, "multihead", inputs).last_hidden_state
        assert (changed - ref).abs().max() > 1e-2, name


@pytest.mark.parametrize("name", DECODERS)
def test_greedy_generate_equal_left_padding(name):
    model = build(name, lm=True)
    inputs, _ = _inputs(name)
    ref_impl = "eager" if name in NO_SDPA else "sdpa"
    kw = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True,
              pad_token_id=0)
    results = {}
    for impl in (ref_impl, "multihead"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            results[impl] = model.generate(**inputs, **kw)
    ref, got = results[ref_impl], results["multihead"]
    assert torch.equal(got.sequences, ref.sequences), f"{name}: {got.sequences} vs {ref.sequences}"
    d = assert_close(torch.stack(got.scores), torch.stack(ref.scores), atol=1e-4, rtol=0, what=f"{name} logits")
    print(f"{name}: generate equal, max |diff| logits {d:.1e}")


def test_static_cache_generate_equal():
    """A static cache hands the prefill more key slots than queries, with no mask."""
    model = build("llama", lm=True)
    inputs, _ = _inputs("llama")
    inputs = {"input_ids": inputs["input_ids"][:1]}  # no padding: the mask is left to causality
    out = {}
    for impl in ("sdpa", "multihead"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            out[impl] = model.generate(**inputs, max_new_tokens=5, do_sample=False, cache_implementation="static",
                                       output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    assert torch.equal(out["multihead"].sequences, out["sdpa"].sequences)
    assert_close(torch.stack(out["multihead"].scores), torch.stack(out["sdpa"].scores), atol=1e-4, rtol=0,
                 what="static cache logits")


def test_from_pretrained_with_multihead(tmp_path):
    model = build("llama")
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModel.from_pretrained(tmp_path, attn_implementation="multihead").eval()
    assert attn_implementation(loaded.config) == "multihead"
    inputs, keep = _inputs("llama")
    ref = _run(model, "sdpa", inputs).last_hidden_state
    with torch.no_grad():
        got = loaded(**inputs).last_hidden_state
    for a, b in zip(_real(got, keep), _real(ref, keep)):
        assert_close(a, b, atol=1e-5, rtol=0, what="from_pretrained(attn_implementation='multihead')")


def test_output_attentions_keeps_the_fused_kernel(monkeypatch):
    """Asking for weights does not move the output onto an explicit path: with those
    backends made to fail, output_attentions=True still runs."""
    import dataclasses

    from multihead.kernels.registry import BACKENDS

    def refuse(*args, **kwargs):
        raise AssertionError("the explicit path ran")

    for name in ("math", "chunked"):
        monkeypatch.setitem(BACKENDS, name, dataclasses.replace(BACKENDS[name], fn=refuse))  # must not run
    model = build("llama")
    inputs, _ = _inputs("llama")
    out = _run(model, "multihead", inputs, output_attentions=True)
    assert len(out.attentions) == 2
    monkeypatch.undo()
    eager = _run(model, "eager", inputs, output_attentions=True)
    assert_close(out.attentions[1][0], eager.attentions[1][0], atol=1e-5, rtol=0, what="weights beside sdpa")


def test_weights_request_chosen_heads_only(monkeypatch):
    from multihead.kernels import math as explicit_math

    model = build("llama")
    inputs, _ = _inputs("llama")
    eager = _run(model, "eager", inputs, output_attentions=True)
    model.set_attn_implementation("multihead")
    asked = []
    real = explicit_math.weights_pass

    def spy(q, k, mask, causal, scale, heads, **kw):
        asked.append(tuple(heads))
        return real(q, k, mask, causal, scale, heads, **kw)

    monkeypatch.setattr(explicit_math, "weights_pass", spy)  # records the heads each weights pass computes
    layers = [layer.self_attn for layer in model.layers]
    request = hf.WeightsRequest({layers[0]: [5, 1]}, stop=True)
    assert request.run(model, **inputs) is None  # stopped after layer 0
    assert asked == [(5, 1)]
    keep = inputs["attention_mask"].bool()
    for got, ref in zip(_real(request.get(layers[0]).transpose(1, 2), keep),
                        _real(eager.attentions[0][:, [5, 1]].transpose(1, 2), keep)):  # real query rows
        assert_close(got, ref, atol=1e-5, rtol=0, what="heads 5, 1")
    assert request.get(layers[1]) is None


def test_minilm_equals_sdpa_and_eager():
    from multihead.interop.loaders import minilm_path

    path = str(minilm_path())
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="sdpa").eval()
    batch = tok(["The cat sat on the mat.", "A much longer sentence, with more tokens in it, to pad the first."],
                padding=True, return_tensors="pt")
    keep = batch["attention_mask"].bool()
    assert not keep.all(), "the batch must be padded"
    ref = _run(model, "sdpa", batch).last_hidden_state
    got = _run(model, "multihead", batch).last_hidden_state
    d = max(assert_close(a, b, atol=1e-5, rtol=0, what="MiniLM vs sdpa") for a, b in zip(_real(got, keep),
                                                                                          _real(ref, keep)))
    eager = _run(model, "eager", batch, output_attentions=True)
    mine = _run(model, "multihead", batch, output_attentions=True)
    dw = max(assert_close(a, b, atol=1e-5, rtol=0, what=f"MiniLM weights {i}")
             for i, (a, b) in enumerate(zip(mine.attentions, eager.attentions)))
    print(f"MiniLM: hidden vs sdpa {d:.1e}, weights vs eager {dw:.1e}")


# ------------------------------------------------------------- the function itself


def _qkv(B=2, H=4, Hkv=2, T=6, S=6, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, D, generator=g), torch.randn(B, Hkv, S, D, generator=g),
            torch.randn(B, Hkv, S, D, generator=g))


class _Module(torch.nn.Module):
    is_causal = True


def test_sliding_window_without_a_mask_is_applied():
    q, k, v = _qkv(T=8, S=8)
    out, _ = hf.attention_forward(_Module(), q, k, v, None, sliding_window=3)
    i = torch.arange(8)
    allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 3)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    ref = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=allowed)
    assert_close(out.transpose(1, 2), ref, atol=1e-6, rtol=0, what="window without mask")


def test_static_prefill_slots_are_cut():
    """No mask, T = 4 queries and S = 10 key slots (a static cache's prefill): causal top-left."""
    q, k, v = _qkv(T=4, S=10)
    out, _ = hf.attention_forward(_Module(), q, k, v, None)
    ref, _ = hf.attention_forward(_Module(), q, k[:, :, :4], v[:, :, :4], None)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("bad, err, match", [
    (dict(attention_mask=object()), TypeError, "attention mask of type object"),
    (dict(attention_mask=torch.ones(2, 6, 6, dtype=torch.bool)), ValueError, "4-D"),
    (dict(softcap=-1.0), ValueError, "softcap must be a positive finite number"),
    (dict(softcap="50"), TypeError, "softcap must be a positive finite number"),
    (dict(s_aux=torch.zeros(3)), ValueError, r"sinks must have shape \(H,\) = \(4,\)"),
    (dict(multihead_weights=[0]), TypeError, "takes a multihead.interop.hf.WeightsRequest"),
])
def test_attention_function_bad_input(bad, err, match):
    q, k, v = _qkv()
    kwargs = {"attention_mask": None, **bad}
    with pytest.raises(err, match=match):
        hf.attention_forward(_Module(), q, k, v, **kwargs)


def test_register_errors():
    with pytest.raises(ValueError, match="one of transformers' own"):
        hf.register("sdpa")
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        hf.register("multihead_fast", backend="fast")
    with pytest.raises(ValueError, match="non-empty string"):
        hf.register("")
    assert hf.registered()["multihead"] == "auto"
    assert hf.registered()["multihead_math"] == "math"


def test_sliding_window_layers_get_a_predicate(monkeypatch):
    """Mistral's window reaches the kernel as transformers' own mask function (padding
    included), not as a dense mask, so the kernel can skip the tiles outside it; the
    outputs equal transformers' sdpa (left padding, T = 12 > window 5)."""
    from multihead.masks import MaskMod

    model = build("mistral")
    inputs, keep = _inputs("mistral")
    ref = _run(model, "sdpa", inputs).last_hidden_state
    masks = []
    real = registry.attend
    # records the mask each layer hands the kernel: the registry reports none
    monkeypatch.setattr(registry, "attend", lambda q, k, v, mask, **kw: masks.append(mask) or real(q, k, v, mask, **kw))
    got = _run(model, "multihead", inputs).last_hidden_state
    assert len(masks) == 2 and all(isinstance(m, MaskMod) for m in masks)
    dense = masks[0].to_dense(2, 1, 12, 12)
    i = torch.arange(12)
    window = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 5)
    assert torch.equal(dense, window[None, None] & keep.bool()[:, None, None, :])
    for a, b in zip(_real(got, keep), _real(ref, keep)):
        assert_close(a, b, atol=1e-5, rtol=0, what="mistral with the window as a predicate")


@pytest.mark.parametrize("engine", ["fused", "native"])
def test_a_window_without_padding_is_multiheads_own(monkeypatch, engine):
    """Without padding, Mistral's window reaches the kernel as `masks.sliding_window(5)`, a
    function of q - kv (its plan kept, the native band kernel may run it, at 64 rows or more),
    with the outputs of transformers' sdpa, on either engine the plan fixes."""
    from multihead.kernels import machine_plan, set_machine_plan

    model = build("mistral")
    ids = torch.randint(3, V, (2, 70), generator=torch.Generator().manual_seed(2))
    ref = _run(model, "sdpa", {"input_ids": ids}).last_hidden_state
    seen = []
    real = registry.attend
    monkeypatch.setattr(registry, "attend", lambda q, k, v, mask, **kw: seen.append(mask) or real(q, k, v, mask, **kw))
    before = set_machine_plan(machine_plan().with_choices(band_engine=engine))
    try:
        got = _run(model, "multihead", {"input_ids": ids}).last_hidden_state
    finally:
        set_machine_plan(before)
    assert len(seen) == 2 and all(m.relative and m.name == "sliding_window(5)" for m in seen), seen
    assert_close(got, ref, atol=1e-5, rtol=0, what=f"mistral's window as multihead's own, {engine} engine")


def test_only_transformers_plain_window_is_read_as_one():
    """`_sliding_window` reads W from transformers' sliding_window_causal_mask_function(W) alone:
    a window with another mask and-ed or or-ed in, causality alone, a chunked mask and a
    function of the user's own keep their predicates."""
    import transformers.masking_utils as mu

    assert registry._sliding_window(mu.sliding_window_causal_mask_function(512)) == 512
    assert registry._sliding_window(mu.causal_mask_function) is None
    assert registry._sliding_window(mu.and_masks(mu.sliding_window_overlay(4), mu.causal_mask_function,
                                                 mu.causal_mask_function)) is None
    assert registry._sliding_window(mu.or_masks(mu.sliding_window_overlay(4), mu.causal_mask_function)) is None
    assert registry._sliding_window(mu.and_masks(mu.causal_mask_function, mu.sliding_window_overlay(4))) is None
    assert registry._sliding_window(lambda b, h, q, kv: kv <= q) is None
