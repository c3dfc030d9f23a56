"""Score mods (softcap, ALiBi, flex callables) against the float64 reference, BLOOM's
slopes and flex_attention; the tile engine's recomputing backward against the math path."""

import warnings

import numpy as np
import pytest
import torch

import multihead as mh
from conftest import assert_close
from multihead import masks, score_mods
from multihead import reference as R
from multihead.kernels import explicit_tiles, fused_tiles


@pytest.fixture
def tiny_tiles(monkeypatch):
    monkeypatch.setattr(fused_tiles, "FUSED_TILE", 3)  # small tiles: many blocks at these test sizes
    monkeypatch.setattr(explicit_tiles, "EXPLICIT_TILE", 3)  # small tiles: many blocks at these test sizes


def _qkv(B=2, H=4, Hkv=2, T=7, S=9, D=8, Dv=5, dtype=torch.float64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad)
                 for s in ((B, H, T, D), (B, Hkv, S, D), (B, Hkv, S, Dv)))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 8, 12, 16, 24, 40, 64, 112])
def test_alibi_slopes_equal_reference_and_bloom(n):
    ours = score_mods.alibi_slopes(n)
    assert ours.shape == (n,)
    assert_close(ours, R.alibi_slopes(n), torch.float32)
    if n in (8, 12):  # the documented values: 2^-1 ... 2^-8, and the 12-head interleave
        expect = {8: [2.0 ** -i for i in range(1, 9)],
                  12: [2.0 ** -i for i in range(1, 9)] + [2.0 ** -(i / 2) for i in (1, 3, 5, 7)]}[n]
        assert_close(ours, np.array(expect), torch.float32)
    try:
        from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    except ImportError:
        return
    # BLOOM's tensor is slope_h * j (key position); its slopes are the factor at j = 1
    bloom = build_alibi_tensor(torch.ones(1, 2), n, torch.float32).view(n, 2)[:, 1]
    assert_close(ours, bloom, torch.float32)


CASES = [("softcap", None, False), ("softcap", "window", True), ("alibi", None, True), ("alibi", "doc", False),
         ("both", "bool", True)]


def _mods(kind, H):
    if kind == "softcap":
        return score_mods.softcap(1.5), {"softcap_cap": 1.5}
    if kind == "alibi":
        return score_mods.alibi(H), {"alibi": R.alibi_slopes(H)}
    cap, al = score_mods.softcap(2.0), score_mods.alibi(H)
    both = score_mods.ScoreMod(lambda s, b, h, q, kv: al(cap(s, b, h, q, kv), b, h, q, kv), "softcap+alibi")
    return both, {"softcap_cap": 2.0, "alibi": R.alibi_slopes(H)}


@pytest.mark.parametrize("kind,mask_kind,causal", CASES)
@pytest.mark.parametrize("T,S,Dv", [(7, 9, 5), (9, 4, 8), (1, 9, 8)])
def test_score_mods_equal_reference(kind, mask_kind, causal, T, S, Dv, tiny_tiles):
    B, H = 2, 4
    q, k, v = _qkv(T=T, S=S, Dv=Dv)
    mod, ref_kw = _mods(kind, H)
    mask, ref_mask = None, None
    if mask_kind == "window":
        mask = masks.sliding_window(3)
        qp = np.arange(T)[:, None] + S - T
        ref_mask = (np.arange(S) <= qp) & (np.arange(S) > qp - 3)
    elif mask_kind == "doc":
        ids = torch.tensor([[0] * (S // 2) + [1] * (S - S // 2), [0] * S])
        mask = masks.document(ids)
        ref_mask = mask.to_dense(B, H, T, S).numpy()
    elif mask_kind == "bool":
        mask = torch.rand(B, 1, T, S) > 0.3
        ref_mask = mask.numpy()
    ref, ref_w = R.attention(q.numpy(), k.numpy(), v.numpy(), mask=ref_mask, causal=causal, return_weights=True,
                             **ref_kw)
    backends = ["math", "chunked", "tiles"] + (["sdpa"] if kind == "alibi" else [])
    for backend in backends + ["auto"]:
        out, w = mh.attend(q, k, v, mask, causal=causal, score_mod=mod, backend=backend,
                           return_weights=[0, 3])
        assert_close(out, ref, what=f"{backend} {mod}")
        assert_close(w, ref_w[:, [0, 3]], what=f"{backend} weights {mod}")


def test_softcap_bounds_and_low_precision(tiny_tiles):
    q, k, v = _qkv(T=6, S=6, dtype=torch.float32)
    q = q * 30  # large scores: the cap matters
    ref = R.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), causal=True, softcap_cap=5.0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = mh.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=True,
                                              score_mod=score_mods.softcap(5.0))
        assert out.dtype == dtype
        assert_close(out, ref, dtype, what=str(dtype))


def test_auto_picks_fused_for_alibi_and_tiles_for_softcap():
    assert mh.resolve_backend(want_weights=False, dropout_p=0.0, score_mod=score_mods.alibi(4)) == "sdpa"
    assert mh.resolve_backend(want_weights=False, dropout_p=0.0, score_mod=score_mods.softcap(3)) == "tiles"
    assert mh.resolve_backend(want_weights=True, dropout_p=0.1, score_mod=score_mods.softcap(3)) == "math"
    # decoding (a few queries): one block of scores on "chunked", not the tile loop; dropout keeps "tiles"
    for T, dropout, want in ((1, 0.0, "chunked"), (8, 0.0, "chunked"), (9, 0.0, "tiles"), (1, 0.1, "tiles")):
        got = mh.resolve_backend(want_weights=False, dropout_p=dropout, score_mod=score_mods.softcap(3), device="cpu",
                                 queries=T)
        assert got == want, (T, dropout, got)


# ----------------------------------------------------------- flex callables


def _flex(q, k, v, **kw):
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return flex_attention(q, k, v, **kw)


def test_flex_score_mods_equal_flex_attention(tiny_tiles):
    from torch.nn.attention.flex_attention import create_block_mask

    B, H, T, S = 2, 4, 10, 10
    bias = torch.randn(H, 2 * T)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + T]

    def tanh_cap(score, b, h, q_idx, kv_idx):
        return 20 * torch.tanh(score / 20)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    q, k, v = _qkv(B, H, H, T, S, 8, 8, torch.float32)
    q = q * 4
    bm = create_block_mask(causal, B, H, T, S, device="cpu")
    for fn in (rel_bias, tanh_cap):
        ref = _flex(q, k, v, score_mod=fn, block_mask=bm)
        for backend in ("math", "chunked", "tiles"):
            out = mh.scaled_dot_product_attention(q, k, v, causal, score_mod=fn, backend=backend)
            assert_close(out, ref, torch.float32, atol=2e-5, what=f"{backend} {fn.__name__}")


# ---------------------------------------------------------------- gradients


@pytest.mark.parametrize("kind,mask_kind,causal", CASES)
def test_tile_gradients_equal_math_float64(kind, mask_kind, causal, tiny_tiles):
    B, H, T, S = 2, 4, 7, 9
    q, k, v = _qkv(T=T, S=S, Dv=8, grad=True)
    mod, _ = _mods(kind, H)
    mask = {None: None, "window": masks.sliding_window(3), "bool": torch.rand(B, 1, T, S) > 0.3,
            "doc": masks.document(torch.tensor([0] * 4 + [1] * 5))}[mask_kind]
    grads = {}
    backends = ("math", "tiles", "sdpa") if kind == "alibi" else ("math", "tiles")
    for backend in backends:
        out = mh.scaled_dot_product_attention(q, k, v, mask, causal=causal, score_mod=mod, backend=backend)
        g_out = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)
        grads[backend] = torch.autograd.grad(out, (q, k, v), g_out)
    for backend in backends[1:]:
        for n, a, b in zip("qkv", grads["math"], grads[backend]):
            assert_close(b, a, what=f"d{n} {mod} {backend}")


@pytest.mark.parametrize("tile", [3, 256])
def test_tile_engine_float32_softcap_and_float_mask_gradients(tile, monkeypatch):
    """float32, scores up to ~+-80 against cap 50 (the fast sigmoid form of tanh), an additive
    float mask with -inf holes, GQA: output and gradients equal float64 math within float32
    tolerance; a non-linear plain callable (autograd per tile) against math too."""
    monkeypatch.setattr(explicit_tiles, "EXPLICIT_TILE", tile)  # small tiles: many blocks at these test sizes
    q, k, v = _qkv(B=2, H=4, Hkv=2, T=40, S=45, D=16, Dv=8, seed=3, grad=True)
    q = (q * 6).detach().requires_grad_()  # q.k * scale ~ N(0, 36)
    bias = torch.randn(2, 1, 40, 45, dtype=torch.float64)
    bias[bias > 1.5] = float("-inf")
    mods = {"softcap": score_mods.softcap(50.0),
            "callable": lambda s, b, h, qi, kv: torch.sin(s) + s}
    for name, mod in mods.items():
        want = mh.scaled_dot_product_attention(q, k, v, bias, score_mod=mod, backend="math")
        g_out = torch.linspace(-1, 1, want.numel(), dtype=torch.float64).view_as(want)
        want_g = torch.autograd.grad(want, (q, k, v), g_out)
        q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
        got = mh.scaled_dot_product_attention(q32, k32, v32, bias.float(), score_mod=mod, backend="tiles")
        got_g = torch.autograd.grad(got, (q32, k32, v32), g_out.float())
        assert_close(got, want, torch.float32, what=f"{name} out")
        for n, a, b in zip("qkv", got_g, want_g):
            assert_close(a, b, torch.float32, what=f"{name} d{n}")


def test_gradcheck_tiles_softcap_with_empty_rows(tiny_tiles):
    q, k, v = _qkv(B=1, H=2, Hkv=1, T=4, S=5, D=3, Dv=2, grad=True)
    mask = torch.rand(1, 1, 4, 5) > 0.3
    mask[..., 1, :] = False

    def f(q, k, v):
        return mh.scaled_dot_product_attention(q, k, v, mask, score_mod=score_mods.softcap(1.0), backend="tiles")

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_gradcheck_tiles_dropout(tiny_tiles):
    """With the RNG seeded per call the forward is a fixed function; the backward regenerates
    each tile's dropout keeps from its seed, so gradcheck holds it to the exact derivative."""
    q, k, v = _qkv(B=1, H=2, Hkv=2, T=5, S=6, D=3, Dv=2, grad=True)

    def f(q, k, v):
        torch.manual_seed(7)
        return mh.scaled_dot_product_attention(q, k, v, masks.causal(), dropout_p=0.3, backend="tiles",
                                               score_mod=score_mods.softcap(2.0))

    assert torch.autograd.gradcheck(f, (q, k, v))
    assert not torch.equal(f(q, k, v), mh.scaled_dot_product_attention(q, k, v, masks.causal(), backend="tiles",
                                                                       score_mod=score_mods.softcap(2.0)))


def test_tiles_dropout_is_unbiased():
    q, k, v = torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 3000, 4), torch.ones(1, 1, 3000, 4)
    out = mh.scaled_dot_product_attention(q, k, v, dropout_p=0.5, backend="tiles")
    assert 0.9 < out.mean().item() < 1.1 and out.std().item() < 0.2


def test_a_learned_bias_trains_under_auto_and_is_refused_by_the_tile_backends():
    """A score mod holding a tensor that requires grad: "auto" runs it where autograd trains
    it (gradients equal the math path's); the recomputing backends refuse it by name."""
    q, k, v = _qkv(T=6, S=6)
    table = torch.randn(4, 12, dtype=torch.float64, requires_grad=True)

    def rel(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 6]

    grads = {}
    for backend in ("math", "auto"):
        out = mh.scaled_dot_product_attention(q, k, v, causal=True, score_mod=rel, backend=backend)
        grads[backend] = torch.autograd.grad(out.square().sum(), table)[0]
    assert_close(grads["auto"], grads["math"], what="d table")
    for backend in ("tiles", "sdpa"):
        with pytest.raises(ValueError, match="require grad"):
            mh.scaled_dot_product_attention(q, k, v, causal=True, backend=backend,
                                            score_mod=score_mods.ScoreMod(rel, "rel", bias=lambda b, h, qi, kv: 0))
    with torch.no_grad():  # no training: the tile engine is fine
        out = mh.scaled_dot_product_attention(q, k, v, causal=True, score_mod=rel, backend="tiles")
        assert_close(out, mh.scaled_dot_product_attention(q, k, v, causal=True, score_mod=rel, backend="math"))
