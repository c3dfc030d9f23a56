"""convert.to_mla on transformers Llama-family models (Llama GQA, Mistral, Qwen2, Qwen3):
exact against the original model in the full configuration, a latent-shaped cache, the
per-layer report equal to a direct measurement, the rotary-pair choices, clear errors."""

from __future__ import annotations

import copy

import pytest
import torch

from multihead import convert
from multihead.interop.hf import latent_cache_bytes
from multihead.interop.hf.mla import LatentLlamaAttention, rope_pair_scores

transformers = pytest.importorskip("transformers")

VOCAB, C, H, HKV = 97, 64, 4, 2


def _model(kind: str, dtype=torch.float64, seed: int = 0, **kw):
    """A random small model of `kind` with non-trivial biases and norm gains."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=C, intermediate_size=96, num_hidden_layers=2, num_attention_heads=H,
                  num_key_value_heads=HKV, max_position_embeddings=128, attn_implementation="eager")
    common.update(kw)
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[kind]
    if kind == "mistral":
        common.setdefault("sliding_window", 6)
    if kind == "qwen3":
        common.setdefault("head_dim", 16)
    model = model_cls(cfg_cls(**common)).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


KINDS = ["llama", "mistral", "qwen2", "qwen3"]


def _full(model):
    attn = model.model.layers[0].self_attn
    return HKV * attn.head_dim, HKV * attn.head_dim  # kv_rank = Hkv * Dv, rope_dim = Hkv * D


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


# ------------------------------------------------------------ exact at full rank


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_full_configuration_equals_the_original(kind, dtype):
    model = _model(kind, dtype)
    kv_rank, rope_dim = _full(model)
    new, report = convert.to_mla(model, kv_rank, rope_dim=rope_dim, return_report=True)
    assert all(isinstance(layer.self_attn, LatentLlamaAttention) for layer in new.model.layers)
    ids = torch.randint(0, VOCAB, (2, 14), generator=torch.Generator().manual_seed(1))
    want, got = _logits(model, ids), _logits(new, ids)
    diff = (got - want).abs().max().item()
    assert diff < 1e-4, f"{kind} {dtype}: max |logit difference| {diff:.3g}"
    assert report.max_error < (1e-12 if dtype == torch.float64 else 1e-6), report
    # generate: the latent cache and the absorbed decode step give the original's greedy tokens
    prompt = ids[:1, :6]
    a = model.generate(prompt, max_new_tokens=10, do_sample=False)
    b = new.generate(prompt, max_new_tokens=10, do_sample=False)
    assert torch.equal(a, b), (kind, a.tolist(), b.tolist())


def test_full_configuration_attention_layer_is_exact_in_float64():
    # one layer alone, so RMSNorm's float32 rounding downstream does not blur the comparison; the reference
    # on sdpa (eager's softmax runs in float32)
    for kind in KINDS:
        model = _model(kind, attn_implementation="sdpa")
        kv_rank, rope_dim = _full(model)
        new = convert.to_mla(model, kv_rank, rope_dim=rope_dim)
        x = torch.randn(2, 9, C, dtype=torch.float64)
        pos = torch.arange(9)[None].expand(2, 9)
        pe = model.model.rotary_emb(x, pos)
        i, j = torch.arange(9)[:, None], torch.arange(9)[None]
        window = getattr(model.config, "sliding_window", None) or 9
        keep = (j <= i) & (j > i - window)  # what the model's own mask allows (Mistral: its window of 6)
        causal = torch.zeros(9, 9, dtype=torch.float64).masked_fill(~keep, float("-inf"))[None, None].expand(2, 1, 9, 9)
        want, _ = model.model.layers[1].self_attn(hidden_states=x, position_embeddings=pe, attention_mask=causal)
        got, _ = new.model.layers[1].self_attn(hidden_states=x, position_embeddings=pe, attention_mask=causal)
        diff = (got - want).abs().max().item()
        # Qwen3's q/k RMSNorm runs in float32 even in a float64 model: summed in another order, its rounding differs
        assert diff < (1e-7 if kind == "qwen3" else 1e-12), f"{kind}: {diff:.3g}"


def test_the_cache_holds_only_the_latent():
    for kind in ("llama", "qwen3"):
        model = _model(kind)
        kv_rank, rope_dim = _full(model)
        new = convert.to_mla(model, kv_rank, rope_dim=rope_dim)
        ids = torch.randint(0, VOCAB, (2, 11))
        with torch.no_grad():
            cache = new(ids, use_cache=True).past_key_values
            original = model(ids, use_cache=True).past_key_values
        for layer in cache.layers:
            assert tuple(layer.keys.shape) == (2, 1, 11, kv_rank + rope_dim) and layer.values.shape[-1] == 0
        per_token = latent_cache_bytes(cache) / (2 * 11)
        assert per_token == 2 * (kv_rank + rope_dim) * 8  # 2 layers, float64
        assert latent_cache_bytes(original) / (2 * 11) == 2 * 2 * HKV * model.model.layers[0].self_attn.head_dim * 8
        # reduced: the cache shrinks with the latent
        small = convert.to_mla(model, 10, rope_dim=4)
        with torch.no_grad():
            cache = small(ids, use_cache=True).past_key_values
        assert latent_cache_bytes(cache) / (2 * 11) == 2 * (10 + 4) * 8


# ------------------------------------------------------------ reduced ranks


def _stacked(attn, pairs, weighted: bool) -> torch.Tensor:
    """M = [W_k,nope ; W_v (| b_v)] of an original layer, built independently of the conversion."""
    D = attn.head_dim
    Hkv = attn.k_proj.out_features // D
    wk = attn.k_proj.weight.detach().double().view(Hkv, D, -1)
    if weighted:  # the k-normed keys: gains over each head's RMS under an isotropic input
        gain = attn.k_norm.weight.detach().double()
        wk = wk * gain[None, :, None] / (wk.square().sum((1, 2)) / D).sqrt()[:, None, None]
    keys = []
    for j in range(Hkv):
        rot = set(pairs[j].tolist()) | {f + D // 2 for f in pairs[j].tolist()}
        keys.append(wk[j, [i for i in range(D) if i not in rot]])
    m = torch.cat(keys + [attn.v_proj.weight.detach().double()])
    if attn.v_proj.bias is not None and not weighted:
        nk = sum(len(k) for k in keys)
        col = torch.cat([torch.zeros(nk, dtype=torch.float64), attn.v_proj.bias.detach().double()])
        m = torch.cat([m, col[:, None]], dim=1)
    return m


@pytest.mark.parametrize("kind", KINDS)
def test_reduced_ranks_are_finite_and_the_report_is_measured(kind):
    model = _model(kind)
    ids = torch.randint(0, VOCAB, (2, 10))
    for kv_rank, rope_dim, keep in ((6, 4, "norm"), (12, 8, "high"), (20, 0, "norm")):
        new, report = convert.to_mla(model, kv_rank, rope_dim=rope_dim, keep=keep, return_report=True)
        logits = _logits(new, ids)
        assert torch.isfinite(logits).all()
        for row, layer, orig in zip(report.layers, new.model.layers, model.model.layers):
            attn = layer.self_attn
            mla = attn.mla
            D, Dv = orig.self_attn.head_dim, orig.self_attn.v_proj.out_features // HKV
            G, Dn = H // HKV, mla.head_dim
            up = mla.kv_b_proj.weight.detach().view(H, Dn + Dv, kv_rank)[::G]  # one query head per KV head
            live = D - rope_dim // HKV
            up = torch.cat([up[:, :live].reshape(-1, kv_rank), up[:, Dn:].reshape(-1, kv_rank)])
            weighted = kind == "qwen3"
            m = _stacked(orig.self_attn, attn.rope_pairs, weighted)
            if weighted:
                recon = up @ attn.latent_proj.weight.detach() @ m
            else:
                down = mla.kv_a_proj.weight.detach()[:kv_rank]
                if m.shape[1] > C:
                    down = torch.cat([down, mla.kv_a_proj.bias.detach()[:kv_rank, None]], dim=1)
                recon = up @ down
            direct = ((recon - m).norm() / m.norm()).item()
            assert direct == pytest.approx(row.error, rel=1e-9, abs=1e-12), (kind, kv_rank, rope_dim, row)
        # the cached decode (absorbed, one token at a time) equals the full forward of the same model
        with torch.no_grad():
            out = new(ids[:, :6], use_cache=True)
            steps = [out.logits]
            cache = out.past_key_values
            for t in range(6, 10):
                out = new(ids[:, t:t + 1], cache=cache, use_cache=True)
                steps.append(out.logits)
        diff = (torch.cat(steps, dim=1) - logits).abs().max().item()
        assert diff < 1e-9, f"{kind} R={kv_rank} r={rope_dim}: cached decode vs full forward {diff:.3g}"


def test_error_falls_to_zero_as_the_rank_grows():
    model = _model("llama")
    errors = []
    for r in (2, 8, 16, 24, 28):  # rows of [W_k,nope ; W_v] at rope_dim 4: 2 x (16 - 2 + 16) = 60, C + 1 = 65
        _, report = convert.to_mla(model, r, rope_dim=4, return_report=True)
        errors.append(report.max_error)
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    _, report = convert.to_mla(model, 60, rope_dim=4, return_report=True)
    assert report.max_error < 1e-12


# ------------------------------------------------------------ which pairs stay rotary


def test_high_keeps_the_fastest_pairs_and_norm_the_strongest():
    model = _model("llama")
    D = model.model.layers[0].self_attn.head_dim
    with torch.no_grad():  # make pair 5 of key head 1 in layer 0 dominate its scores
        attn = model.model.layers[0].self_attn
        attn.k_proj.weight.view(HKV, D, C)[1, [5, 5 + D // 2]] *= 50
    high = convert.to_mla(model, 8, rope_dim=4, keep="high")
    norm = convert.to_mla(model, 8, rope_dim=4, keep="norm")
    assert high.model.layers[0].self_attn.rope_pairs.tolist() == [[0], [0]]
    scores = rope_pair_scores(model)["model.layers.0.self_attn"]
    assert norm.model.layers[0].self_attn.rope_pairs.tolist() == [[int(scores[0].argmax())], [5]]
    # from the layer inputs on real tokens: E||q^(f)|| E||k^(f)||, computed here by hand for layer 0
    ids = torch.randint(0, VOCAB, (2, 12))
    cal = rope_pair_scores(model, calibration=ids)["model.layers.0.self_attn"]
    with torch.no_grad():
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
        q = attn.q_proj(x).view(2, 12, H, D)
        k = attn.k_proj(x).view(2, 12, HKV, D)
    pn = lambda t: (t[..., :D // 2] ** 2 + t[..., D // 2:] ** 2).sqrt().mean((0, 1))  # noqa: E731
    want = pn(q).view(HKV, H // HKV, D // 2).sum(1) * pn(k)
    torch.testing.assert_close(cal, want, rtol=1e-9, atol=0)
    with_cal = convert.to_mla(model, 8, rope_dim=4, keep="norm", calibration=ids)
    assert with_cal.model.layers[0].self_attn.rope_pairs.tolist() == want.argmax(1)[:, None].tolist()


def test_partial_rope_keeps_the_chosen_pairs_exactly_rotary():
    # a model whose keys live only on the kept pairs (the rest of k_proj zero) converts exactly at full
    # kv_rank: the dropped rotation then touches nothing
    model = _model("llama")
    D = model.model.layers[0].self_attn.head_dim
    keep = [1, 4]
    with torch.no_grad():
        for layer in model.model.layers:
            w = layer.self_attn.k_proj.weight.view(HKV, D, C)
            drop = [i for i in range(D) if i % (D // 2) not in keep]
            w[:, drop] = 0
    new, report = convert.to_mla(model, 56, rope_dim=2 * len(keep) * HKV, keep="norm", return_report=True)
    assert new.model.layers[0].self_attn.rope_pairs.tolist() == [keep, keep]
    ids = torch.randint(0, VOCAB, (2, 12))
    diff = (_logits(new, ids) - _logits(model, ids)).abs().max().item()
    assert diff < 1e-6 and report.max_error < 1e-12, diff


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_the_activations_basis_keeps_most_of_the_features_on_its_tokens(kind):
    model = _model(kind)
    cal = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(5))
    kv_rank, rope_dim = _full(model)
    new, report = convert.to_mla(model, kv_rank, rope_dim=rope_dim, basis="activations", calibration=cal,
                                 return_report=True)
    ids = torch.randint(0, VOCAB, (2, 10))
    assert (_logits(new, ids) - _logits(model, ids)).abs().max().item() < 1e-4  # full rank: exact either way
    assert max(row.data_error for row in report.layers) < 1e-12
    # each layer's features on the calibration tokens, from the original modules (independently of to_mla)
    inputs = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda mod, args, kw, i=i: inputs.__setitem__(i, kw["hidden_states"].reshape(-1, C)), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(cal)
    for h in hooks:
        h.remove()
    for r in (6, 14):
        # the same kept pairs (keep="norm" on the same tokens) under both bases
        pca, rep_pca = convert.to_mla(model, r, rope_dim=4, keep="norm", basis="activations", calibration=cal,
                                      return_report=True)
        _, rep_svd_cal = convert.to_mla(model, r, rope_dim=4, keep="norm", calibration=cal, return_report=True)
        svd, rep_svd = convert.to_mla(model, r, rope_dim=4, keep="high", return_report=True)
        for i, (orig, conv) in enumerate(zip(model.model.layers, pca.model.layers)):
            attn, D = orig.self_attn, orig.self_attn.head_dim
            x = inputs[i]
            with torch.no_grad():
                k = attn.k_proj(x).view(len(x), HKV, D)
                if kind == "qwen3":
                    k = attn.k_norm(k)
                elif attn.k_proj.bias is not None:
                    k = k - attn.k_proj.bias.view(HKV, D)  # the nope key bias is a shift softmax ignores: not kept
                nope = [[f for f in range(D) if f % (D // 2) not in set(p.tolist())] for p in conv.self_attn.rope_pairs]
                f = torch.cat([torch.cat([k[:, j, nope[j]] for j in range(HKV)], dim=1), attn.v_proj(x)], dim=1)
            mla = conv.self_attn.mla
            G, Dn, Dv = H // HKV, mla.head_dim, mla.v_head_dim
            up = mla.kv_b_proj.weight.detach().view(H, Dn + Dv, r)[::G]
            up = torch.cat([up[:, :Dn].reshape(-1, r), up[:, Dn:].reshape(-1, r)])  # orthonormal columns
            direct = ((f - f @ up @ up.T).norm() / f.norm()).item()
            assert direct == pytest.approx(rep_pca.layers[i].data_error, rel=1e-6), (kind, r, i)
            # the principal directions lose no more of the features than the weights' SVD does
            assert rep_pca.layers[i].data_error <= rep_svd_cal.layers[i].data_error + 1e-12
        assert torch.isfinite(_logits(pca, ids)).all() and torch.isfinite(_logits(svd, ids)).all()
        assert all(row.data_error is None for row in rep_svd.layers)
        assert "on calibration tokens" in str(rep_pca)


# ------------------------------------------------------------ what stays as it was


def test_the_source_model_is_untouched():
    model = _model("qwen3")
    before = copy.deepcopy(model.state_dict())
    convert.to_mla(model, 8, rope_dim=4, keep="norm", calibration=torch.randint(0, VOCAB, (1, 8)))
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not any(isinstance(m, LatentLlamaAttention) for m in model.modules())


def test_bad_arguments_give_clear_errors():
    model = _model("llama")
    cases = [
        (dict(kv_rank=8, rope_dim=None), ValueError, r"rope_dim .* must be given; received None; valid: a multiple "
                                                     r"of 4 in 0..32 \(exact: rope_dim=32, kv_rank=32\)"),
        (dict(kv_rank=8, rope_dim=6), ValueError, r"rope_dim must be a multiple of 2 \* Hkv = 4 in 0..32 .*"
                                                  r"received 6; valid: 0, 4, 8"),
        (dict(kv_rank=8, rope_dim=36), ValueError, r"received 36"),
        (dict(kv_rank=8, rope_dim=4.0), ValueError, r"received 4.0"),
        (dict(kv_rank=0, rope_dim=4), ValueError, r"kv_rank must be an int in 1..60, .*received 0; exact: "
                                                  r"rope_dim=32, kv_rank=32"),
        (dict(kv_rank=61, rope_dim=4), ValueError, r"received 61"),
        (dict(kv_rank=33, rope_dim=32), ValueError, r"kv_rank must be an int in 1..32, .*received 33$"),
        (dict(kv_rank=8, rope_dim=4, keep="low"), ValueError,
         r"keep must be one of rotation, norm, high; received 'low'"),
        (dict(kv_rank=8, rope_dim=4, keep="high", basis="weights", calibration=torch.zeros(3, dtype=torch.long)),
         ValueError, r"calibration= feeds the data-aware choices; received it with keep='high', basis='weights'"),
        (dict(kv_rank=8, rope_dim=4, basis="pca"), ValueError, r"basis must be one of output, weights, activations; "
                                                                r"received 'pca'"),
        (dict(kv_rank=8, rope_dim=4, basis="activations"), ValueError, r"received calibration=None"),
        (dict(kv_rank=8, rope_dim=4, keep="norm", calibration=[1, 2]), TypeError,
         r"calibration must be a non-empty LongTensor .*received list"),
        (dict(kv_rank=8, rope_dim=4, keep="norm", calibration=torch.zeros(3)), TypeError,
         r"received a torch.float32 tensor"),
    ]
    for kw, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            convert.to_mla(model, **kw)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=11))
    with pytest.raises(TypeError, match=r"GPT2LMHeadModel has no LlamaAttention, MistralAttention, Qwen2Attention"):
        convert.to_mla(gpt2, 4, rope_dim=0)
    import multihead as mh

    with pytest.raises(ValueError, match=r"keep='norm', basis=None and calibration= are for transformers models"):
        convert.to_mla(mh.Attention(16, 4, rope=True), 4, rope_dim=2, keep="norm")


# ------------------------------------------------------------ the real model


def _smollm2():
    from multihead.interop.loaders import load_model

    return copy.deepcopy(load_model("smollm2").model)  # the loader's model is cached: never changed here


@pytest.mark.slow
def test_smollm2_full_configuration_is_exact():
    """In float64, where exactness is the claim. Layer by layer on the same input: the full-rank
    latent is a reparametrisation, equal to rounding (1e-10 of the output's scale). The logits
    of the whole model: SmolLM2 amplifies float64 rounding to ~1e-5 over 30 layers on these
    ids (eager against multihead's kernel, two exact computations, differ that much), so the
    bound is that same model's own distance between two kernels, measured in this run."""
    model = _smollm2().double().eval()
    new, report = convert.to_mla(model, 192, rope_dim=192, return_report=True)
    assert report.max_error < 1e-10 and len(report.layers) == 30
    ids = torch.randint(0, model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    seen = []

    def grab(module, args, kwargs):
        seen.append((args, {**kwargs, "past_key_values": None}))

    hooks = [layer.self_attn.register_forward_pre_hook(grab, with_kwargs=True) for layer in model.model.layers]
    try:
        with torch.no_grad():
            base = model(ids, use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        for i, (args, kwargs) in enumerate(seen):
            want = model.model.layers[i].self_attn(*args, **kwargs)[0]
            got = new.model.layers[i].self_attn(*args, **kwargs)[0]
            assert (got - want).abs().max() <= 1e-10 * want.abs().max(), i
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    noise = (_logits(eager, ids) - base).abs().max().item()
    diff = (_logits(new, ids) - base).abs().max().item()
    assert diff <= 10 * noise + 1e-9, (diff, noise)
    a = model.generate(ids[:, :8], max_new_tokens=12, do_sample=False)
    b = new.generate(ids[:, :8], max_new_tokens=12, do_sample=False)
    assert torch.equal(a, b)


# ------------------------------------------------------------ DeepSeek-V2 export


def test_export_to_deepseek_v2_loads_in_stock_transformers(tmp_path):
    from multihead.interop.hf.deepseek_export import latent_norm_fit, to_deepseek_v2

    model = _model("llama", attn_implementation="sdpa")
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    cal = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    for kv_rank, rope_dim, ballast in ((32, 32, True), (20, 8, True), (20, 8, False)):
        mla = convert.to_mla(model, kv_rank, rope_dim=rope_dim, keep="high")
        folder = tmp_path / f"ds-{kv_rank}-{rope_dim}-{ballast}"
        to_deepseek_v2(mla, calibration=cal, ballast=ballast).save_pretrained(folder)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64,
                                                                   attn_implementation="sdpa").eval()
        assert type(loaded).__name__ == "DeepseekV2ForCausalLM"
        assert all(type(layer.mlp).__name__ == "DeepseekV2MLP" for layer in loaded.model.layers)
        width = kv_rank + ballast + (kv_rank + ballast) % 2  # the RoPE key starts at an even offset
        assert loaded.config.kv_lora_rank == width
        with torch.no_grad():
            cache = loaded(ids, use_cache=True).past_key_values
        assert latent_cache_bytes(cache) // (2 * 12) == 2 * (width + rope_dim) * 8  # 2 layers, float64
        for layer, (gain, rows) in zip(loaded.model.layers, latent_norm_fit(mla, cal, ballast=ballast)):
            torch.testing.assert_close(layer.self_attn.kv_a_layernorm.weight,
                                       torch.full((width,), gain, dtype=torch.float64))
            assert rows.shape == (width - kv_rank, C) and bool(rows[:1].any()) == ballast
            torch.testing.assert_close(layer.self_attn.kv_a_proj_with_mqa.weight[kv_rank:width], rows)
            assert not layer.self_attn.kv_b_proj.weight[:, kv_rank:].any()  # read by no head
        # what the export changes is the latent norm: without it, DeepSeek computes the converted model
        cost = (_logits(loaded, ids) - _logits(mla, ids)).abs().max().item()
        assert 0 < cost < 10, cost
        for layer in loaded.model.layers:
            layer.self_attn.kv_a_layernorm = torch.nn.Identity()
        diff = (_logits(loaded, ids) - _logits(mla, ids)).abs().max().item()
        assert diff < 1e-5, f"R={kv_rank} r={rope_dim}: DeepSeek without its latent norm vs the MLA model {diff:.3g}"
        if (kv_rank, rope_dim) == (32, 32):  # and then the original model too
            assert (_logits(loaded, ids) - _logits(model, ids)).abs().max().item() < 1e-5
    # float32, as a checkpoint is usually loaded: DeepSeek's complex view of q_pe needs an even nope width
    model32 = _model("llama", torch.float32, attn_implementation="sdpa")
    mla = convert.to_mla(model32, 32, rope_dim=32)
    to_deepseek_v2(mla, calibration=cal).save_pretrained(tmp_path / "ds32")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ds32", dtype=torch.float32).eval()
    assert loaded.config.qk_nope_head_dim == 2
    for layer in loaded.model.layers:
        layer.self_attn.kv_a_layernorm = torch.nn.Identity()
    assert (_logits(loaded, ids) - _logits(model32, ids)).abs().max().item() < 1e-4


def test_export_with_different_pairs_per_layer_widens_the_rope_key_and_keeps_the_logits(tmp_path):
    """The calibrated conversion keeps different rotary pairs in each layer; DeepSeek-V2 has
    one RoPE for all layers. widen_rope=True gives the exported key every layer's
    frequencies (each as often as the layer that keeps it most often), with zero weights
    where a layer keeps no pair: the loaded checkpoint computes the converted model."""
    from collections import Counter

    from multihead.interop.hf.deepseek_export import to_deepseek_v2

    llama = _model("llama", attn_implementation="sdpa")
    with torch.no_grad():  # different strongest pairs in the two layers (head_dim 16: 8 pairs)
        llama.model.layers[0].self_attn.k_proj.weight.view(HKV, 16, C)[:, [3, 11]] *= 30
        llama.model.layers[1].self_attn.k_proj.weight.view(HKV, 16, C)[:, [5, 13]] *= 30
        llama.model.layers[1].self_attn.k_proj.weight.view(HKV, 16, C)[1, [1, 9]] *= 60
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    cal = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    mla = convert.to_mla(llama, 8, rope_dim=8, keep="norm")
    kept = [Counter(p.reshape(-1).tolist()) for p in (m.rope_pairs for m in mla.modules() if hasattr(m, "rope_pairs"))]
    assert kept[0] != kept[1]  # the setup: the layers keep different frequencies
    union = sum(max(k[f] for k in kept) for f in set().union(*kept))
    assert union > 4
    to_deepseek_v2(mla, calibration=cal, widen_rope=True).save_pretrained(tmp_path / "wide")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "wide", dtype=torch.float64,
                                                               attn_implementation="sdpa").eval()
    assert loaded.config.qk_rope_head_dim == 2 * union
    with torch.no_grad():
        cache = loaded(ids, use_cache=True).past_key_values
    width = loaded.config.kv_lora_rank
    assert latent_cache_bytes(cache) // (2 * 12) == 2 * (width + 2 * union) * 8  # 2 layers, float64
    for layer in loaded.model.layers:  # the latent norm is the export's one approximation (test above)
        layer.self_attn.kv_a_layernorm = torch.nn.Identity()
    diff = (_logits(loaded, ids) - _logits(mla, ids)).abs().max().item()
    assert diff < 1e-5, diff
    a = mla.generate(ids[:, :6], max_new_tokens=6, do_sample=False)
    b = loaded.generate(ids[:, :6], max_new_tokens=6, do_sample=False)
    assert torch.equal(a, b)
    # pairs equal in every layer (in any order) need no wider key
    same = convert.to_mla(_model("llama"), 8, rope_dim=8, keep="high")
    assert to_deepseek_v2(same, calibration=cal, widen_rope=True).config.qk_rope_head_dim == 8


def test_save_pretrained_of_a_converted_model_refuses_and_names_the_export(tmp_path):
    """A converted model saved as its original class reloads in stock transformers with its
    attention re-initialised (logits off by whole units): saving refuses before writing, and
    names the DeepSeek-V2 export, which reloads as the converted model (test above)."""
    model = _model("llama")
    mla = convert.to_mla(model, 8, rope_dim=4)
    for m in (mla, copy.deepcopy(mla)):
        with pytest.raises(ValueError, match=r"LatentLlamaAttention .*to_deepseek_v2\(model, calibration=ids\)"):
            m.save_pretrained(tmp_path / "llama")
        assert not (tmp_path / "llama").exists()
    model.save_pretrained(tmp_path / "original")  # the source model is untouched and saves as before
    ids = torch.randint(0, VOCAB, (1, 9))
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "original", dtype=torch.float64,
                                                              attn_implementation="eager").eval()
    torch.testing.assert_close(_logits(again, ids), _logits(model, ids), rtol=0, atol=1e-12)  # float64 rounding


def test_export_refuses_what_deepseek_v2_cannot_hold():
    from multihead.interop.hf.deepseek_export import to_deepseek_v2

    cal = torch.randint(0, VOCAB, (1, 8))
    cases = [
        (convert.to_mla(_model("qwen2"), 8, rope_dim=4), ValueError, r"query bias \(Qwen2\)"),
        (convert.to_mla(_model("qwen3"), 8, rope_dim=4), ValueError, r"per-head key norm \(Qwen3\)"),
        (convert.to_mla(_model("mistral"), 8, rope_dim=4), ValueError, r"sliding window of 6"),
        (convert.to_mla(_model("llama"), 8, rope_dim=0), ValueError, r"rope_dim=0 leaves DeepSeek-V2 no rotary key"),
        (_model("llama"), TypeError, r"received LlamaForCausalLM, which has no converted layer"),
    ]
    for model, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            to_deepseek_v2(model, calibration=cal)
    llama = _model("llama")
    with torch.no_grad():  # different strongest pairs in the two layers: DeepSeek has one RoPE for all
        llama.model.layers[0].self_attn.k_proj.weight.view(HKV, 16, C)[:, [3, 11]] *= 30
        llama.model.layers[1].self_attn.k_proj.weight.view(HKV, 16, C)[:, [5, 13]] *= 30
    with pytest.raises(ValueError, match=r"the layers keep different rotary frequencies .*valid: widen_rope=True, "
                                         r"which exports the same model with a RoPE key of 8 dims instead of 4"):
        to_deepseek_v2(convert.to_mla(llama, 8, rope_dim=4, keep="norm"), calibration=cal)
    with pytest.raises(TypeError, match=r"widen_rope must be a bool; received str"):
        to_deepseek_v2(convert.to_mla(_model("llama"), 8, rope_dim=4), calibration=cal, widen_rope="yes")
    with pytest.raises(TypeError, match=r"calibration must be a non-empty LongTensor .*received list"):
        to_deepseek_v2(convert.to_mla(_model("llama"), 8, rope_dim=4), calibration=[1, 2])
