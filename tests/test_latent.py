"""LatentAttention (MLA): NumPy reference, absorbed == naive, latent cache == full forward,
transformers' DeepseekV2Attention, parameter and cache accounting, bad input."""


import math

import pytest
import torch

import multihead as mh
from conftest import assert_close
from multihead import masks
from multihead import reference as R

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# (d_model, n_heads, kv_rank, q_rank, head_dim, rope_dim, v_head_dim)
GEOMETRIES = [
    (32, 4, 16, None, None, 0, None),  # no decoupled RoPE, D == Dv
    (32, 4, 12, None, 6, 4, 10),  # RoPE, D != Dv, head_dim set freely
    (24, 3, 10, 14, None, 6, 5),  # low-rank query
]
GEOMETRY_IDS = ["plain", "rope", "q_rank"]


def from_deepseek(layer, **kw):
    """multihead.interop.hf.from_deepseek, imported on use (it registers with transformers)."""
    from multihead.interop.hf import from_deepseek as convert

    return convert(layer, **kw)


def make(geometry, *, causal=True, dtype=torch.float64, **kw):
    C, H, Rk, Rq, D, Dr, Dv = geometry
    m = mh.LatentAttention(C, H, Rk, q_rank=Rq, head_dim=D, rope_dim=Dr, v_head_dim=Dv, causal=causal, **kw)
    with torch.no_grad():  # norms away from 1 so that a missing norm shows
        for mod in m.modules():
            if isinstance(mod, torch.nn.RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return m.to(dtype).eval()


# ------------------------------------------------------------------ NumPy reference


def ref_mla(m: mh.LatentAttention, x, mask=None, softcap=None):
    """The module's weights through `reference.mla_forward` (NumPy float64)."""
    W = lambda lin: lin.weight.detach().double().numpy().T  # noqa: E731
    g = lambda norm: norm.weight.detach().double().numpy()  # noqa: E731
    q = dict(W_q=W(m.q_proj)) if m.q_rank is None else dict(W_q_a=W(m.q_a_proj), g_q_a=g(m.q_a_norm),
                                                              W_q_b=W(m.q_b_proj))
    return R.mla_forward(
        x.detach().double().numpy(), W(m.kv_a_proj), W(m.kv_b_proj), W(m.o_proj), m.n_heads, m.kv_rank,
        m.head_dim, m.rope_dim, **q, g_kv=g(m.kv_a_norm) if m.latent_norm else None, eps=m.kv_a_norm.eps
        if m.latent_norm else 1e-6, rope_base=m.rope.base if m.rope is not None else 10000.0, mask=mask,
        causal=m.causal, return_weights=True, softcap_cap=softcap,
    )


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=GEOMETRY_IDS)
@pytest.mark.parametrize("absorb", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_equals_numpy_reference(geometry, absorb, causal):
    m = make(geometry, causal=causal)
    x = torch.randn(2, 7, m.d_model, dtype=torch.float64)
    out, w = m(x, absorb=absorb, return_weights=True)
    ref, ref_w = ref_mla(m, x)
    # RoPE angles are computed in float32 (multihead.rope), hence the looser bound with rope_dim > 0.
    tol = 1e-10 if m.rope_dim == 0 else 1e-6
    assert_close(out, ref, atol=tol, rtol=tol, what=f"absorb={absorb}")
    assert_close(w, ref_w, atol=tol, rtol=tol, what="weights")


# ----------------------------------------------------------- absorbed == naive

MASKS = {
    "none": None,
    "bool per head": lambda B, H, T, S: torch.rand(B, H, T, S) > 0.3,
    "float": lambda B, H, T, S: torch.randn(1, 1, T, S),
    "padding": lambda B, H, T, S: masks.padding(lengths=torch.tensor([S, S - 3])),
}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=GEOMETRY_IDS)
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_absorbed_equals_naive(dtype, tol, geometry, mask_name):
    m = make(geometry, dtype=dtype)
    B, T = 2, 9
    x = torch.randn(B, T, m.d_model, dtype=dtype)
    make_mask = MASKS[mask_name]
    mask = None if make_mask is None else make_mask(B, m.n_heads, T, T)
    naive, w_naive = m(x, mask=mask, absorb=False, return_weights=True)
    absorbed, w_abs = m(x, mask=mask, absorb=True, return_weights=True)
    assert_close(absorbed, naive, atol=tol, rtol=tol, what=f"out, {mask_name}")
    assert_close(w_abs, w_naive, atol=tol, rtol=tol, what=f"weights, {mask_name}")


def test_absorbed_gradients_equal_naive():
    m = make(GEOMETRIES[2])
    x = torch.randn(2, 6, m.d_model, dtype=torch.float64, requires_grad=True)
    grads = []
    for absorb in (False, True):
        m.zero_grad()
        x.grad = None
        m(x, absorb=absorb).square().sum().backward()
        grads.append([x.grad.clone()] + [p.grad.clone() for p in m.parameters()])
    for a, b in zip(*grads):
        assert_close(b, a, atol=1e-11, rtol=1e-10, what="gradient")


def test_weights_for_a_subset_of_heads():
    m = make(GEOMETRIES[1])
    x = torch.randn(2, 5, m.d_model, dtype=torch.float64)
    _, w_all = m(x, return_weights=True, absorb=True)
    for absorb in (False, True):
        _, w = m(x, return_weights=[2, 0], absorb=absorb)
        assert_close(w, w_all[:, [2, 0]], what=f"weights of heads 2, 0, absorb={absorb}")


# --------------------------------------------------------------- latent cache


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=GEOMETRY_IDS)
@pytest.mark.parametrize("absorb", [None, False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_incremental_decode_equals_full_forward(geometry, absorb, dtype, tol):
    m = make(geometry, dtype=dtype)
    B, T = 2, 10
    x = torch.randn(B, T, m.d_model, dtype=dtype)
    full = m(x, absorb=False)
    cache = m.new_cache(B, 16)
    parts = [m(x[:, :4], cache=cache, absorb=absorb)]  # a prefill, then one token at a time
    parts += [m(x[:, t : t + 1], cache=cache, absorb=absorb) for t in range(4, T)]
    assert cache.length == T
    assert_close(torch.cat(parts, dim=1), full, atol=tol, rtol=tol, what=f"cached decode, absorb={absorb}")


def test_cache_stores_the_latent_and_rotated_rope_key():
    m = make(GEOMETRIES[1])
    x = torch.randn(1, 5, m.d_model, dtype=torch.float64)
    cache = m.new_cache(1, 8)
    m(x, cache=cache)
    assert_close(cache.buf[:, :5], m.latents(x), what="cache contents")


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=GEOMETRY_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_nbytes_equals_formula(geometry, dtype):
    m = make(geometry, dtype=torch.float32)
    B, L = 3, 50
    cache = m.new_cache(B, L, dtype=dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    assert cache.nbytes == B * L * (m.kv_rank + m.rope_dim) * itemsize
    assert cache.dtype == dtype
    assert m.new_cache(B, L).dtype == torch.float32  # the module's dtype by default


def test_deepseek_v2_cache_is_a_fourteenth_of_mha():
    # 512 + 64 = 576 values per token against 2 * 32 * 128 = 8192 for MHA with the same heads.
    mla = mh.LatentAttention(64, 32, 512, head_dim=128, rope_dim=64).new_cache(1, 10)
    mha = mh.KVCache(1, 32, 10, 128, dtype=torch.float32)
    assert mha.nbytes / mla.nbytes == pytest.approx(8192 / 576)


# -------------------------------------------------------------- accounting


def expected_params(C, H, Rk, Rq, D, Dr, Dv):
    D = C // H if D is None else D
    Dv = D if Dv is None else Dv
    q = C * H * (D + Dr) if Rq is None else C * Rq + Rq + Rq * H * (D + Dr)
    return q + C * (Rk + Dr) + Rk + Rk * H * (D + Dv) + H * Dv * C


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=GEOMETRY_IDS)
def test_parameter_count_and_submodules(geometry):
    m = make(geometry)
    assert sum(p.numel() for p in m.parameters()) == expected_params(*geometry)
    names = {n for n, _ in m.named_children()}
    q = {"q_proj"} if m.q_rank is None else {"q_a_proj", "q_a_norm", "q_b_proj"}
    assert q | {"kv_a_proj", "kv_a_norm", "kv_b_proj", "o_proj"} <= names
    assert all(mod.bias is None for mod in m.modules() if isinstance(mod, torch.nn.Linear))


def test_absorb_choice_follows_the_cost(monkeypatch):
    m = mh.LatentAttention(64, 32, 512, head_dim=128, rope_dim=64)  # DeepSeek-V2 head geometry
    assert m.absorb_is_cheaper(1, 4096)  # decoding over a cache
    assert not m.absorb_is_cheaper(4096, 4096)  # long prefill
    small = make(GEOMETRIES[0])
    seen = []
    for name in ("attend_naive", "attend_absorbed"):
        method = getattr(small, name)
        # records which path each call took: the layer reports neither
        monkeypatch.setattr(small, name, lambda *a, _m=method, _n=name, **k: seen.append(_n) or _m(*a, **k))
    x = torch.randn(1, 8, small.d_model, dtype=torch.float64)
    cache = small.new_cache(1, 8)
    small(x[:, :7], cache=cache)  # prefill of 7: naive is cheaper at these sizes
    small(x[:, 7:], cache=cache)  # one token over the cache: absorbed
    assert seen == ["attend_naive", "attend_absorbed"]


# ---------------------------------------------------------- Hugging Face DeepSeek-V2


def _hf_layer(q_rank):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV2Config"):
        pytest.skip(f"transformers {transformers.__version__} has no DeepseekV2")
    cfg = transformers.DeepseekV2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=q_rank,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, first_k_dense_replace=1,
        n_routed_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )
    cfg._attn_implementation = "eager"
    model = transformers.DeepseekV2ForCausalLM(cfg).eval()
    hf = model.model.layers[0].self_attn
    with torch.no_grad():  # random weights well away from the init (norm weights included)
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    return model, hf


@pytest.mark.parametrize("q_rank", [None, 24])
def test_equals_hf_deepseek_v2_attention(q_rank):
    model, hf = _hf_layer(q_rank)
    m = from_deepseek(hf).eval()
    assert (m.q_rank, m.kv_rank, m.head_dim, m.rope_dim, m.v_head_dim) == (q_rank, 16, 8, 4, 6)
    B, T = 2, 9
    x = torch.randn(B, T, 32)
    positions = torch.arange(T)[None].expand(B, T)
    rope = model.model.rotary_emb(x, positions)
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None]  # (1, 1, T, T) additive
    with torch.no_grad():
        ref, ref_w = hf(x, attention_mask=causal, position_embeddings=rope)
        for absorb in (False, True):
            out, w = m(x, absorb=absorb, return_weights=True)
            assert_close(out, ref, what=f"output vs DeepseekV2Attention, absorb={absorb}")
            assert_close(w, ref_w, what=f"weights vs DeepseekV2Attention, absorb={absorb}")
        # and the latent cache, one token at a time, reproduces HF's full causal forward
        cache = m.new_cache(B, T)
        steps = torch.cat([m(x[:, t : t + 1], cache=cache) for t in range(T)], dim=1)
    assert_close(steps, ref, what="cached decode vs DeepseekV2Attention")


# --------------------------------------------------------------------- bad input

BAD_CONSTRUCTION = [
    (dict(kv_rank=0), ValueError, "kv_rank must be an int >= 1; received 0"),
    (dict(kv_rank=-4), ValueError, "received -4"),
    (dict(kv_rank=8.0), TypeError, "received 8.0 (float)"),
    (dict(rope_dim=3), ValueError, "rope_dim must be even"),
    (dict(rope_dim=-2), ValueError, "rope_dim must be an int >= 0; received -2"),
    (dict(n_heads=5), ValueError, "d_model (32) must be divisible by n_heads (5); valid: 1, 2, 4, 8, 16, 32; "
                                  "or pass head_dim explicitly"),
    (dict(n_heads=0), ValueError, "n_heads must be an int >= 1; received 0"),
    (dict(q_rank=0), ValueError, "q_rank must be an int >= 1; received 0"),
    (dict(head_dim=0), ValueError, "head_dim must be an int >= 1; received 0"),
    (dict(v_head_dim=True), TypeError, "v_head_dim must be an int >= 1; received True (bool)"),
    (dict(rope_base=1.0, rope_dim=4), ValueError, "rope_base must be a number > 1; received 1.0"),
    (dict(backend="flash"), ValueError, "unknown attention backend 'flash'; valid: 'auto'"),
    (dict(sliding_window=4), ValueError, "sliding_window=4 is a causal window"),
    (dict(sliding_window=0, causal=True), ValueError, "sliding_window must be an int >= 1; received 0"),
    (dict(softcap=0.0), ValueError, "softcap must be a positive finite number or None; received 0.0"),
]


@pytest.mark.parametrize("kwargs,exc,message", BAD_CONSTRUCTION, ids=[str(c[0]) for c in BAD_CONSTRUCTION])
def test_bad_construction(kwargs, exc, message):
    args = dict(d_model=32, n_heads=4, kv_rank=8) | kwargs
    with pytest.raises(exc) as err:
        mh.LatentAttention(args.pop("d_model"), args.pop("n_heads"), args.pop("kv_rank"), **args)
    assert message in str(err.value)


def _bad_calls():
    m = mh.LatentAttention(32, 4, 8, rope_dim=4, causal=True)
    x = torch.randn(2, 3, 32)
    other = mh.LatentAttention(32, 4, 6, rope_dim=4)
    full = m.new_cache(2, 3)
    m(x, cache=full)
    return [
        ("x not a tensor", lambda: m(x.tolist()), TypeError, "x must be a tensor (B, T, 32); received list"),
        ("x 2-D", lambda: m(x[0]), ValueError, "x must be 3-D (B, T, 32), batch first; received shape (3, 32)"),
        ("x width", lambda: m(torch.randn(2, 3, 30)), ValueError, "x has width 30; this module expects d_model = 32"),
        ("KVCache", lambda: m(x, cache=mh.KVCache(2, 4, 8, 8)), TypeError,
         "cache must be a LatentCache from new_cache(); received KVCache"),
        ("cache rank", lambda: m(x, cache=other.new_cache(2, 8)), ValueError,
         "cache holds kv_rank=6, rope_dim=4; this module needs kv_rank=8, rope_dim=4"),
        ("cache batch", lambda: m(x, cache=m.new_cache(3, 8)), ValueError, "made for batch size 3"),
        ("cache overflow", lambda: m(x[:, :1], cache=full), ValueError, "cache overflow: 3 tokens cached + 1 new"),
        ("cache dtype", lambda: m(x, cache=m.new_cache(2, 8, dtype=torch.float64)), TypeError,
         "cache holds torch.float64; received latent in torch.float32"),
        ("absorb", lambda: m(x, absorb="yes"), TypeError, "absorb must be True, False or None; received 'yes'"),
        ("weights head", lambda: m(x, return_weights=[4]), ValueError, "weight head index 4 out of range"),
        ("mask shape", lambda: m(x, mask=torch.ones(2, 5, 3, 3, dtype=torch.bool)), ValueError,
         "mask of shape (2, 5, 3, 3) is not broadcastable"),
        ("int mask", lambda: m(x, mask=torch.ones(3, 3, dtype=torch.int64)), TypeError, "received dtype torch.int64"),
        ("from_hf", lambda: from_deepseek(torch.nn.Linear(2, 2)), TypeError,
         "takes a transformers DeepseekV2Attention / DeepseekV3Attention; received Linear"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_calls(case):
    _, call, exc, message = _bad_calls()[case]
    with pytest.raises(exc) as err:
        call()
    assert message in str(err.value)


def test_from_hf_reads_yarn_rope_scaling():
    """DeepSeek-V2's published YaRN: frequencies scaled, and mscale^2 on the softmax scale
    (the full numeric comparison with transformers is in test_interop_hf_latent_attention.py)."""
    _, hf = _hf_layer(None)
    cfg = hf.config
    cfg.rope_parameters = dict(cfg.rope_parameters, rope_type="yarn", factor=4.0, original_max_position_embeddings=16,
                               mscale=0.707, mscale_all_dim=0.707)
    yarn_layer = type(hf)(cfg, layer_idx=0)
    m = from_deepseek(yarn_layer)
    assert m.rope.scaling.kind == "yarn" and m.rope.scaling.factor == 4.0
    assert math.isclose(m.scale, yarn_layer.scaling, rel_tol=1e-12) and m.scale > 1.2 / math.sqrt(12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_decode_paths_agree(dtype, monkeypatch):
    # One new token, no mask, no weights: backend "auto" takes the written-out `_one_token`;
    # "sdpa" folds H query heads over the one latent head (at B = 1 split over the threads,
    # multihead.kernels.common.mqa_splits); "math" is the explicit kernel. All equal the naive path.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        mods = {b: make(GEOMETRIES[1], dtype=dtype, backend=b) for b in ("auto", "sdpa", "math")}
        for m in mods.values():
            m.load_state_dict(mods["auto"].state_dict())
        calls = []
        # the one-token fast path is reported nowhere public: a spy on it counts its calls
        one_token = mods["auto"]._one_token
        monkeypatch.setattr(mods["auto"], "_one_token", lambda *a: calls.append(1) or one_token(*a))  # counts calls
        x = torch.randn(1, 6, mods["auto"].d_model, dtype=dtype)
        caches = {b: m.new_cache(1, 6) for b, m in mods.items()}
        naive = mods["math"](x, absorb=False)
        for t in range(6):
            outs = {b: m(x[:, t : t + 1], cache=caches[b], absorb=True) for b, m in mods.items()}
            for b, out in outs.items():
                assert_close(out, naive[:, t : t + 1], dtype, what=f"decode step {t}, backend {b} vs naive")
        assert len(calls) == 6
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=GEOMETRY_IDS)
@pytest.mark.parametrize("absorb", [False, True])
def test_window_and_softcap_equal_numpy_reference(geometry, absorb):
    """LatentAttention(sliding_window=, softcap=) on both paths against the float64 reference."""
    m = make(geometry, sliding_window=3, softcap=1.5)
    x = 3 * torch.randn(2, 9, m.d_model, dtype=torch.float64)
    out, w = m(x, absorb=absorb, return_weights=True)
    allowed = masks.sliding_window(3).to_dense(1, 1, 9, 9)[0, 0].numpy()
    ref, ref_w = ref_mla(m, x, mask=allowed, softcap=1.5)
    assert_close(out, ref, what="out")
    assert_close(w, ref_w, what="weights")
    assert "sliding_window=3, softcap=1.5" in repr(m)


@pytest.mark.parametrize("absorb", [None, False, True])
def test_window_and_softcap_decode_equals_full_forward(absorb):
    """Cached decoding (absorb=None: the written-out one-token step over the last W latents)."""
    m = make(GEOMETRIES[1], sliding_window=3, softcap=1.5)
    x = 3 * torch.randn(2, 10, m.d_model, dtype=torch.float64)
    cache = m.new_cache(2, 10)
    steps = [m(x[:, :4], cache=cache, absorb=absorb)] + [m(x[:, t:t + 1], cache=cache, absorb=absorb)
                                                          for t in range(4, 10)]
    assert_close(torch.cat(steps, 1), m(x), what=f"decode absorb={absorb}")


@pytest.mark.parametrize("absorb", [None, False, True])
def test_a_callers_store_and_angles_equal_the_latent_cache(absorb):
    """forward(store=, rotary=) is what the Hugging Face patch calls: a caller-owned cache
    (a list here) and angles at the caller's positions give the full forward's outputs."""
    m = make(GEOMETRIES[1])
    B, T = 2, 9
    x = torch.randn(B, T, m.d_model, dtype=torch.float64)
    full = m(x, absorb=False)
    held: list[torch.Tensor] = []

    def store(latent):  # (B, t, R + rope_dim) -> every latent so far (B, S, R + rope_dim)
        held.append(latent)
        return torch.cat(held, dim=1)

    parts = []
    for start, stop in ((0, 4), *((t, t + 1) for t in range(4, T))):
        rotary = m.rope.cos_sin(torch.arange(start, stop))  # (t, rope_dim/2) each
        parts.append(m(x[:, start:stop], rotary=rotary, store=store, absorb=absorb))
    assert_close(torch.cat(parts, dim=1), full, atol=1e-12, rtol=1e-12, what=f"store decode, absorb={absorb}")
    assert sum(h.shape[1] for h in held) == T


def test_store_and_rotary_bad_calls():
    m, flat = make(GEOMETRIES[1]), make(GEOMETRIES[0])
    x = torch.randn(2, 3, m.d_model, dtype=torch.float64)
    angles = m.rope.cos_sin(torch.arange(3))
    cases = [
        (lambda: m(x, store=lambda t: t, rotary=angles, cache=m.new_cache(2, 8)), ValueError,
         "pass cache= (a LatentCache) or store= (a caller's cache), not both"),
        (lambda: m(x, store="cache", rotary=angles), TypeError, "store must be callable"),
        (lambda: m(x, store=lambda t: t), ValueError, "pass rotary=(cos, sin) for this call's tokens"),
        (lambda: flat(x, rotary=angles), ValueError, "this module has no rotary part (rope_dim=0)"),
    ]
    for call, exc, message in cases:
        with pytest.raises(exc) as err:
            call()
        assert message in str(err.value)
