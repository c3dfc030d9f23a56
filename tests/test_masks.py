"""Mask predicates: values against NumPy, tile classes against the dense mask, the kernel
over block-sparse tiles against the float64 reference, and flex callables against flex."""

import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import multihead as mh
from conftest import assert_close
from multihead import masks
from multihead import reference as R
from multihead.kernels import common, explicit_tiles, fused_tiles

BACKENDS = ["math", "chunked", "sdpa", "tiles"]


# ------------------------------------------------------------------ NumPy twins


def np_positions(T, S):
    """(T, 1) bottom-right query positions and (1, S) key positions."""
    return np.arange(T)[:, None] + (S - T), np.arange(S)[None, :]


def np_mask(kind, B, T, S, arg):
    """The dense (B, 1, T, S) mask of a predicate, written independently in NumPy."""
    qp, kv = np_positions(T, S)
    if kind == "causal":
        m = kv <= qp
    elif kind == "window":
        m = (kv <= qp) & (kv > qp - arg)
    elif kind == "chunked":
        m = (np.floor_divide(qp, arg) == kv // arg)
    elif kind == "document":
        ids = np.broadcast_to(arg, (B, S))
        q_ids = np.where(qp[None] >= 0, np.take_along_axis(ids, np.clip(qp.T, 0, S - 1).repeat(B, 0), 1)[:, :, None],
                         -1)
        return (q_ids == ids[:, None, :])[:, None]
    elif kind == "prefix":
        P = np.broadcast_to(np.asarray(arg), (B,))[:, None, None]
        return ((kv < P) | (kv <= qp))[:, None]
    elif kind == "padding":
        return (kv < np.asarray(arg)[:, None, None])[:, None]
    else:
        raise AssertionError(kind)
    return np.broadcast_to(m, (B, 1, T, S))


def make_mod(kind, arg):
    if kind == "causal":
        return masks.causal()
    if kind == "window":
        return masks.sliding_window(arg)
    if kind == "chunked":
        return masks.local_chunks(arg)
    if kind == "document":
        return masks.document(torch.as_tensor(arg))
    if kind == "prefix":
        return masks.prefix_lm(arg if isinstance(arg, int) else torch.as_tensor(arg))
    if kind == "padding":
        return masks.padding(torch.as_tensor(arg))
    raise AssertionError(kind)


@st.composite
def predicate_cases(draw):
    B = draw(st.integers(1, 3))
    T = draw(st.integers(1, 20))
    S = draw(st.integers(1, 24))
    kind = draw(st.sampled_from(["causal", "window", "chunked", "document", "prefix", "padding"]))
    if kind == "window":
        arg = draw(st.integers(1, 8))
    elif kind == "chunked":
        arg = draw(st.integers(1, 7))
    elif kind == "document":
        ids = np.sort(np.array(draw(st.lists(st.integers(0, 4), min_size=S, max_size=S))))
        arg = ids if draw(st.booleans()) else np.stack([np.sort(np.random.default_rng(b).integers(0, 4, S))
                                                        for b in range(B)])
    elif kind == "prefix":
        arg = draw(st.integers(0, S)) if draw(st.booleans()) else np.array(
            draw(st.lists(st.integers(0, S), min_size=B, max_size=B)))
    else:
        arg = np.array(draw(st.lists(st.integers(0, S), min_size=B, max_size=B)))
    combine = draw(st.sampled_from(["none", "and_causal", "or_window", "and_flex"]))
    return B, T, S, kind, arg, combine


def build(B, T, S, kind, arg, combine):
    mod, ref = make_mod(kind, arg), np_mask(kind, B, T, S, arg)
    if combine == "and_causal":
        mod, ref = mod & masks.causal(), ref & np_mask("causal", B, T, S, None)
    elif combine == "or_window":
        mod, ref = mod | masks.sliding_window(2), ref | np_mask("window", B, T, S, 2)
    elif combine == "and_flex":
        # a plain flex callable reads q_idx from the top-left: row i, not position i + S - T
        mod = mod & (lambda b, h, q, kv: (q + kv) % 3 != 1)
        ref = ref & ((np.arange(T)[:, None] + np.arange(S)[None, :]) % 3 != 1)
    return mod, np.broadcast_to(ref, (B, 1, T, S))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(predicate_cases(), st.sampled_from([(1, 1), (2, 3), (4, 4), (5, 2)]))
def test_predicates_and_tile_classes_equal_numpy(case, tile):
    B, T, S, kind, arg, combine = case
    mod, ref = build(*case)
    dense = masks.to_dense(mod, B, 2, T, S).expand(B, 2, T, S).numpy()
    assert (dense == np.broadcast_to(ref, dense.shape)).all(), f"{mod} values"
    bq, bk = tile
    classes = masks.tile_classes(mod, B, 2, T, S, bq, bk).expand(B, 2, -1, -1).numpy()
    nq, nk = -(-T // bq), -(-S // bk)
    assert classes.shape == (B, 2, nq, nk)
    for i in range(nq):
        for j in range(nk):
            block = dense[:, :, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
            truth = np.where(block.all((2, 3)), 1, np.where(block.any((2, 3)), 2, 0))
            got = classes[:, :, i, j]
            # never wrong: empty and full only when true; exact for single analytic predicates
            assert ((got == 0) <= (truth == 0)).all() and ((got == 1) <= (truth == 1)).all(), (mod, i, j, got, truth)
            if combine == "none":
                assert (got == truth).all(), (mod, i, j, got, truth)


def test_document_tiles_exact_for_sorted_ids():
    ids = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2])
    classes = masks.tile_classes(masks.document(ids), 1, 1, 8, 8, 2, 2)[0, 0]
    # tiles of 2: rows/keys {0,1} doc 0, {2,3} docs 0/1, {4,5} doc 1, {6,7} docs 1/2
    assert classes.tolist() == [[1, 2, 0, 0], [2, 2, 2, 2], [0, 2, 1, 2], [0, 2, 2, 2]]


# ---------------------------------------------------- the kernel over the tiles


@pytest.fixture
def tiny_tiles(monkeypatch):
    """Tiles of 3 x 3 so that small problems cross many tile edges."""
    monkeypatch.setattr(fused_tiles, "FUSED_TILE", 3)  # small tiles: many blocks at these test sizes
    monkeypatch.setattr(explicit_tiles, "EXPLICIT_TILE", 3)  # small tiles: many blocks at these test sizes


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(predicate_cases(), st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]), st.integers(0, 2**16),
       st.sampled_from([3, 4]))
def test_kernel_with_predicates_equals_reference(tiny_tiles, case, heads, seed, Dv):
    """Dv == D runs the CPU engine that merges fused pieces by log-sum-exp, Dv != D the public one."""
    B, T, S, kind, arg, combine = case
    G, Hkv = heads
    H = G * Hkv
    mod, ref_mask = build(*case)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, 4, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, S, 4, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, S, Dv, generator=g, dtype=torch.float64)
    ref, ref_w = R.attention(q.numpy(), k.numpy(), v.numpy(), mask=ref_mask, return_weights=True)
    for backend in BACKENDS:
        out, w = mh.attend(q, k, v, mod, backend=backend, return_weights=[H - 1])
        assert_close(out, ref, what=f"{backend} {mod} {case}")
        assert_close(w, ref_w[:, [H - 1]], what=f"{backend} weights {mod}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["sdpa", "tiles"])
def test_predicates_low_precision(dtype, backend, tiny_tiles):
    B, H, Hkv, T, S = 2, 4, 2, 11, 13
    ids = torch.tensor([0] * 5 + [1] * 6 + [2] * 2)
    mod = masks.document(ids) & masks.causal() | masks.prefix_lm(torch.tensor([2, 0]))
    q, k, v = torch.randn(B, H, T, 8), torch.randn(B, Hkv, S, 8), torch.randn(B, Hkv, S, 8)
    dense = mod.to_dense(B, H, T, S)
    ref = R.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), mask=dense.numpy())
    out = mh.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), mod, backend=backend)
    assert out.dtype == dtype
    assert_close(out, ref, dtype, what=f"{backend} {dtype}")


def test_causal_flag_with_a_predicate_and_decode(tiny_tiles):
    # decoding 2 queries over 9 keys with a window: bottom-right positions 7 and 8
    q, k, v = torch.randn(1, 2, 2, 4, dtype=torch.float64), torch.randn(1, 2, 9, 4, dtype=torch.float64), \
        torch.randn(1, 2, 9, 4, dtype=torch.float64)
    qp, kv = np_positions(2, 9)
    ref = R.attention(q.numpy(), k.numpy(), v.numpy(), mask=(kv <= qp) & (kv > qp - 3))
    for backend in BACKENDS:
        out = mh.scaled_dot_product_attention(q, k, v, masks.local_chunks(100), causal=True, backend=backend)
        assert_close(out, R.attention(q.numpy(), k.numpy(), v.numpy(), causal=True), what=backend)
        out = mh.scaled_dot_product_attention(q, k, v, masks.sliding_window(3), backend=backend)
        assert_close(out, ref, what=backend)


def test_empty_rows_and_empty_blocks_are_zero_with_zero_gradients(tiny_tiles):
    # padding to 0 keys for batch 1: every row of it is empty; so is every block of it
    mod = masks.padding(torch.tensor([7, 0])) & masks.causal()
    for backend in BACKENDS:
        q, k, v = (torch.randn(2, 2, 7, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
        out = mh.scaled_dot_product_attention(q, k, v, mod, backend=backend)
        assert (out[1] == 0).all(), backend
        out.square().sum().backward()
        assert (q.grad[1] == 0).all() and torch.isfinite(q.grad).all(), backend
        assert_close(out[0:1], R.attention(q[0:1].detach().numpy(), k[0:1].detach().numpy(),
                                           v[0:1].detach().numpy(), causal=True), what=backend)


@pytest.mark.parametrize("Dv", [5, 8])
@pytest.mark.parametrize("Hkv", [1, 2])
@pytest.mark.parametrize("backend", ["sdpa", "tiles", "chunked"])
def test_gradients_with_predicates_equal_math(backend, Hkv, Dv, tiny_tiles):
    B, H, T, S = 2, 4, 10, 12
    mod = masks.document(torch.tensor([[0] * 6 + [1] * 6, [0] * 3 + [1] * 9])) & masks.causal()
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
               for s in ((B, H, T, 8), (B, Hkv, S, 8), (B, Hkv, S, Dv)))
    grads = {}
    for name in ("math", backend):
        out = mh.scaled_dot_product_attention(q, k, v, mod, backend=name)
        g_out = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)
        grads[name] = torch.autograd.grad(out, (q, k, v), g_out)
    for n, a, b in zip("qkv", grads["math"], grads[backend]):
        assert_close(b, a, what=f"d{n} {backend}")


def _spy_fused_calls(monkeypatch):
    """Record (key length, mask shape) of every fused kernel call, whichever engine runs."""
    seen = []
    if common.HAS_CPU_FLASH:
        real_op = fused_tiles.flash_lse

        def spy_op(q, k, v, *, mask=None, **kwargs):
            seen.append((k.shape[2], None if mask is None else tuple(mask.shape)))
            return real_op(q, k, v, mask=mask, **kwargs)

        monkeypatch.setattr(fused_tiles, "flash_lse", spy_op)  # records each kernel call: how the engine cut the work
    real = fused_tiles.F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append((k.shape[2], None if attn_mask is None else tuple(attn_mask.shape)))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(fused_tiles.F, "scaled_dot_product_attention", spy)  # records how the work was cut
    return seen


@pytest.mark.usefixtures("fused_band_engine")
def test_sdpa_runs_only_the_kept_key_range(monkeypatch):
    """sliding_window(4) & causal at T = S = 64, tiles of 8: each fused call sees at most
    2 key tiles and never a (T, S) mask: block 0 alone, blocks 1..7 (alike under q - kv) as one
    band call."""
    monkeypatch.setattr(fused_tiles, "FUSED_TILE", 8)  # small tiles: many blocks at these test sizes
    seen = _spy_fused_calls(monkeypatch)
    q, k, v = torch.randn(1, 2, 64, 4), torch.randn(1, 2, 64, 4), torch.randn(1, 2, 64, 4)
    out = mh.scaled_dot_product_attention(q, k, v, masks.sliding_window(4) & masks.causal())
    assert len(seen) == 2 and all(s <= 16 for s, _ in seen), seen
    assert all(m is None or m[2] * m[3] <= 8 * 16 for _, m in seen), seen
    qp, kv = np_positions(64, 64)
    ref = R.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), mask=(kv <= qp) & (kv > qp - 4))
    assert_close(out, ref, torch.float32)


@pytest.mark.skipif(not common.HAS_CPU_FLASH, reason="needs torch's CPU flash kernel (log-sum-exp pieces)")
@pytest.mark.usefixtures("fused_band_engine")
def test_causal_runs_full_tiles_without_a_mask(monkeypatch):
    """Causal at T = S = 32 with tiles of 8: one call of torch's causal kernel (a causal square).
    The same triangle behind a generic predicate (not analysed for squares) runs as pieces: full
    tiles in one unmasked call per query block, the diagonal tile through torch's causal kernel;
    each lower-triangle tile once. (Short key ranges would run as one masked call: turned off
    here to see the pieces.)"""
    monkeypatch.setattr(fused_tiles, "FUSED_TILE", 8)  # small tiles: many blocks at these test sizes
    monkeypatch.setattr(fused_tiles, "_ONE_CALL_SPAN", 0)  # forces bands of several pieces at these sizes
    seen = _spy_fused_calls(monkeypatch)
    q, k, v = torch.randn(1, 2, 32, 4), torch.randn(1, 2, 32, 4), torch.randn(1, 2, 32, 4)
    want = R.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), causal=True)
    assert_close(mh.scaled_dot_product_attention(q, k, v, masks.causal()), want, torch.float32)
    assert seen == [(32, None)], seen
    seen.clear()
    everything = masks.from_flex(lambda b, h, q_idx, kv_idx: kv_idx >= 0)
    assert_close(mh.scaled_dot_product_attention(q, k, v, masks.causal() & everything), want, torch.float32)
    assert seen == [(8, None), (8, None), (8, None), (16, None), (8, None), (24, None), (8, None)], seen


def test_bidirectional_documents_merge_full_blocks_into_one_call(monkeypatch):
    monkeypatch.setattr(fused_tiles, "FUSED_TILE", 4)  # small tiles: many blocks at these test sizes
    seen = _spy_fused_calls(monkeypatch)
    ids = torch.tensor([0] * 16 + [1] * 16)
    q, k, v = torch.randn(1, 1, 32, 4), torch.randn(1, 1, 32, 4), torch.randn(1, 1, 32, 4)
    mh.scaled_dot_product_attention(q, k, v, masks.document(ids))
    assert seen == [(16, None), (16, None)]  # one unmasked call per document


# ------------------------------------------------------------- flex callables


def _flex(q, k, v, **kw):
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        return flex_attention(q, k, v, **kw)


@pytest.mark.parametrize("T,S", [(12, 12), (5, 12), (12, 7)])
def test_flex_mask_mods_equal_flex_attention(T, S, tiny_tiles):
    from torch.nn.attention.flex_attention import create_block_mask

    B, H = 2, 4
    doc = torch.tensor([[0] * 4 + [1] * 8, [0] * 9 + [1] * 3])

    def doc_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc[b, q_idx] == doc[b, kv_idx])

    def window_by_head(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= h + 1

    q, k, v = torch.randn(B, H, T, 8), torch.randn(B, H, S, 8), torch.randn(B, H, S, 8)
    for fn in ([doc_causal] if T <= S and S == 12 else []) + [window_by_head]:
        block_mask = create_block_mask(fn, B, H, T, S, device="cpu")
        ref = _flex(q, k, v, block_mask=block_mask)
        empty = ~masks.to_dense(fn, B, H, T, S).expand(B, H, T, S).any(-1)
        ref = ref.masked_fill(empty[..., None], 0.0)  # flex gives such rows zeros too; guard anyway
        for backend in BACKENDS:
            out = mh.scaled_dot_product_attention(q, k, v, fn, backend=backend)
            assert_close(out, ref, torch.float32, atol=2e-5, what=f"{backend} {fn.__name__} T={T} S={S}")


def test_predicate_evaluation_counts_stay_tile_sized(monkeypatch):
    """A generic predicate is evaluated strip by strip (never the whole (T, S) at once)."""
    monkeypatch.setattr(masks, "_STRIP_ELEMENTS", 64)  # small strips: several at these test sizes
    monkeypatch.setattr(fused_tiles, "FUSED_TILE", 4)  # small tiles: many blocks at these test sizes
    sizes = []

    def fn(b, h, q, kv):
        sizes.append(torch.broadcast_shapes(q.shape, kv.shape)[2:])
        return (q - kv).abs() < 3

    q, k, v = torch.randn(1, 1, 32, 4), torch.randn(1, 1, 32, 4), torch.randn(1, 1, 32, 4)
    mh.scaled_dot_product_attention(q, k, v, fn)
    assert max(a * b for a, b in sizes) <= 4 * 32, sizes


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_block_sparse_gradients_in_low_precision(dtype, tol, monkeypatch):
    monkeypatch.setattr(fused_tiles, "FUSED_TILE", 8)  # small tiles: many blocks at these test sizes
    mod = masks.document(torch.tensor([0] * 20 + [1] * 28)) & masks.causal()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 48, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ref = torch.autograd.grad(mh.scaled_dot_product_attention(q, k, v, mod, backend="math").square().sum(), (q, k, v))
    low = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = mh.scaled_dot_product_attention(*low, mod)
    grads = torch.autograd.grad(out.float().square().sum(), low)
    for name, a, b in zip("qkv", grads, ref):
        rel = ((a.double() - b).abs().max() / b.abs().max()).item()
        assert rel < tol, f"d{name} {dtype}: max |diff| / max |ref| = {rel:.2e} > {tol:g}"
