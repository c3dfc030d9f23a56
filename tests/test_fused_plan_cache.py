"""Kept plans of the fused tile engine: a relative predicate's plan is keyed by the values it
allows (`planner.plan_key`), shared by masks built apart, and a call on a kept plan (its
blocks, runs and masks reused, its forward keeping no log-sum-exp without a backward) equals
the NumPy float64 reference, at 1 and at 2 threads."""

import pytest
import torch

import multihead as mh
from conftest import assert_close
from multihead import masks, reference
from multihead.kernels import common, fused_tiles, planner

pytestmark = pytest.mark.usefixtures("fused_band_engine")  # this engine's plans, not the band kernel's


@pytest.fixture
def stores(monkeypatch):
    """Empty stores of plans and of the plans' blocks, runs and masks, this test's own, returned for the
    tests to read (nothing public lists what a plan keeps)."""
    # fresh stores: other tests' plans neither count here nor get dropped
    monkeypatch.setattr(planner, "_PLANS", type(planner._PLANS)())
    monkeypatch.setattr(fused_tiles, "_SHARED", type(fused_tiles._SHARED)())  # what each plan keeps, likewise
    return fused_tiles._SHARED  # read by the tests: the kept blocks, runs and masks are what they check


def _key(pred, T=1024, S=1024, **kw):
    args = {"B": 1, "H": 8, "G": 1, "tile": None, "device": "cpu", "squares": True, "bands": True} | kw
    return planner.plan_key(pred, args["B"], args["H"], T, S, args["G"], args["tile"], args["device"],
                            args["squares"], args["bands"])


def test_plan_key_is_the_allowed_values():
    """Masks built apart that allow the same pairs share a key (a window is causal already);
    another window, length, tile or thread count does not; predicates that are not relative,
    or that differ by head, have none."""
    w = _key(masks.sliding_window(256) & masks.causal())
    assert w is not None
    assert _key(masks.sliding_window(256) & masks.causal()) == w
    assert _key(masks.sliding_window(256)) == w
    assert _key(masks.causal() & masks.sliding_window(256) & masks.causal()) == w
    assert _key(masks.sliding_window(255) & masks.causal()) != w
    assert _key(masks.causal()) not in (None, w)
    assert _key(masks.sliding_window(256), T=1000) != w
    assert _key(masks.sliding_window(256), S=2048) != w
    assert _key(masks.sliding_window(256), tile=64) != w
    assert _key(masks.sliding_window(256), bands=False) != w
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if n > 1 else 2)
        assert _key(masks.sliding_window(256)) != w  # the cost model divides by the threads
    finally:
        torch.set_num_threads(n)
    assert _key(masks.document(torch.arange(1024) // 128) & masks.causal()) is None
    assert _key(masks.MaskMod(lambda b, h, q, kv: kv <= q, "flex-like", top_left=True)) is None
    per_head = masks.MaskMod(lambda b, h, q, kv: (kv <= q) & (q - kv < 4 + h), "per-head window",
                             tiles=lambda q_lo, q_hi, k_lo, k_hi, *_: (k_lo <= q_hi, k_hi <= q_lo), relative=True)
    assert _key(per_head) is None


def test_kept_plan_equals_a_fresh_plan(stores, monkeypatch):
    """choose_tile returns the plan it made for the key, the same object, equal to one made afresh."""
    pred = masks.sliding_window(100) & masks.causal()
    first = planner.choose_tile(pred, 1, 4, 2048, 2048, 1, None, "cpu", bands=True)
    again = planner.choose_tile(masks.sliding_window(100), 1, 4, 2048, 2048, 1, None, "cpu", bands=True)
    assert again is first
    assert planner.clear_plans() == 1
    fresh = planner.choose_tile(pred, 1, 4, 2048, 2048, 1, None, "cpu", bands=True)
    assert fresh is not first
    assert first[:2] == fresh[:2] and first[4] == fresh[4]
    assert torch.equal(first[2], fresh[2]) and torch.equal(first[3], fresh[3])
    monkeypatch.setattr(planner, "_PLANS_KEPT", 0)  # the store's size is the unit here: none kept, none keyed
    assert _key(pred) is None
    assert planner.choose_tile(pred, 1, 4, 2048, 2048, 1, None, "cpu", bands=True) is not first


@pytest.mark.skipif(not common.HAS_CPU_FLASH, reason="needs torch's CPU flash kernel (log-sum-exp pieces)")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
def test_calls_on_a_kept_plan_equal_the_reference(threads, heads, stores):
    """Three calls with masks built apart (one plan, kept): a band forward without grad, the same
    in float32 (the plan's masks are kept per dtype), and one with a backward (the forward keeps
    its log-sum-exp); outputs and gradients against the NumPy float64 reference."""
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        H, Hkv = heads
        T, window = 1040, 100  # T not a multiple of the tiles: a short last block
        g = torch.Generator().manual_seed(7)
        q = torch.randn(2, H, T, 16, generator=g, dtype=torch.float64)
        k, v = (torch.randn(2, Hkv, T, 16, generator=g, dtype=torch.float64) for _ in range(2))
        allowed = masks.to_dense(masks.sliding_window(window), 1, 1, T, T)[0, 0].numpy()
        want = reference.attention(q.numpy(), k.numpy(), v.numpy(), mask=allowed)

        with torch.no_grad():
            got = mh.scaled_dot_product_attention(q, k, v, masks.sliding_window(window) & masks.causal())
        assert len(stores) == 1
        shared = next(iter(stores.values()))
        assert any(run[0] == "band" for key, runs in shared.items() if key[0] == "runs" for run in runs)
        assert_close(got, torch.from_numpy(want), what=f"float64 heads={heads} threads={threads}")

        got32 = mh.scaled_dot_product_attention(*(x.float() for x in (q, k, v)), masks.sliding_window(window))
        assert len(stores) == 1  # the same plan
        assert {key[1] for key in shared if key[0] == "masks"} == {torch.float64, torch.float32}
        assert_close(got32, torch.from_numpy(want), torch.float32, what=f"float32 heads={heads} threads={threads}")

        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = mh.scaled_dot_product_attention(*xs, masks.sliding_window(window) & masks.causal())
        g_out = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)
        grads = torch.autograd.grad(out, xs, g_out)
        assert_close(out, torch.from_numpy(want), what="out with grad")
        x64 = [x.clone().requires_grad_() for x in (q, k, v)]
        ref = mh.scaled_dot_product_attention(*x64, masks.sliding_window(window), backend="math")
        assert_close(ref, torch.from_numpy(want), what="math path")
        for name, a, b in zip(["dq", "dk", "dv"], grads, torch.autograd.grad(ref, x64, g_out)):
            assert_close(a, b, what=f"{name} heads={heads} threads={threads}")
    finally:
        torch.set_num_threads(n)


@pytest.mark.skipif(not common.HAS_CPU_FLASH, reason="needs torch's CPU flash kernel (log-sum-exp pieces)")
def test_masks_over_the_byte_bound_are_built_per_call(stores, monkeypatch):
    """With no mask small enough to keep, block-by-block GQA pieces (folded masks) are built each
    call, none kept with the plan, and the outputs still equal the reference."""
    monkeypatch.setattr(fused_tiles, "BANDS", False)  # block-by-block pieces, whose GQA masks are folded
    g = torch.Generator().manual_seed(8)
    T = 1000
    q = torch.randn(1, 4, T, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, T, 8, generator=g, dtype=torch.float64) for _ in range(2))
    allowed = masks.to_dense(masks.sliding_window(40), 1, 1, T, T)[0, 0].numpy()
    want = torch.from_numpy(reference.attention(q.numpy(), k.numpy(), v.numpy(), mask=allowed))
    got = mh.scaled_dot_product_attention(q, k, v, masks.sliding_window(40))
    kept = [m for key, ms in next(iter(stores.values())).items() if key[0] == "masks" for m in ms.values()]
    # the byte bound is the unit under test: masks under it kept, and with it at 0 none
    assert kept and all(m[0] is None or m[0].numel() * 8 <= fused_tiles._KEPT_MASK_BYTES for m in kept)
    assert_close(got, want, what="masks kept")
    monkeypatch.setattr(fused_tiles, "_KEPT_MASK_BYTES", 0)  # the bound at 0: no mask may be kept
    stores.clear()
    for _ in range(2):
        assert_close(mh.scaled_dot_product_attention(q, k, v, masks.sliding_window(40)), want, what="none kept")
    assert not any(ms for key, ms in next(iter(stores.values())).items() if key[0] == "masks")


@pytest.mark.skipif(not common.HAS_CPU_FLASH, reason="needs torch's CPU flash kernel (log-sum-exp pieces)")
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
@pytest.mark.parametrize("pieces", ["one call", "pieces"])
def test_a_band_in_chunks_equals_the_reference(heads, pieces, monkeypatch):
    """A band whose output reaches `_BAND_CHUNK_BYTES` runs as several equal calls of whole blocks,
    each below the bound, one or several pieces each, merged; outputs and gradients against the
    NumPy reference and the math path in float64."""
    monkeypatch.setattr(fused_tiles, "FUSED_TILE", 8)  # small tiles: a band of several blocks at T = 100
    if pieces == "pieces":
        monkeypatch.setattr(fused_tiles, "_ONE_CALL_SPAN", 0)  # forces the several-pieces path at this size
    H, Hkv = heads
    B, T, D, window = 2, 100, 16, 21
    # below 4 blocks of 8 rows per call (per GQA group position): a band of 9 blocks in calls of 3, 3, 3
    monkeypatch.setattr(fused_tiles, "_BAND_CHUNK_BYTES", 4 * B * (H // (H // Hkv)) * 8 * D * 8)
    calls = []
    real = fused_tiles.flash_lse

    def spy(q, *args, **kw):
        if q.stride(1) == 8 * D:  # a band's view: its blocks are the kernel's heads, 8 rows apart
            calls.append(q.shape[1])
        return real(q, *args, **kw)

    monkeypatch.setattr(fused_tiles, "flash_lse", spy)  # counts the kernel calls a band is cut into
    g = torch.Generator().manual_seed(9)
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, Hkv, T, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    got = mh.scaled_dot_product_attention(q, k, v, masks.sliding_window(window))
    assert max(calls) == 3 and calls.count(3) >= 3 and set(calls) <= {2, 3}, calls  # below 4 blocks, equal
    allowed = masks.to_dense(masks.sliding_window(window), 1, 1, T, T)[0, 0].numpy()
    want = reference.attention(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), mask=allowed)
    assert_close(got, torch.from_numpy(want), what=f"out heads={heads} {pieces}")
    g_out = torch.linspace(-1, 1, got.numel(), dtype=torch.float64).view_as(got)
    grads = torch.autograd.grad(got, (q, k, v), g_out)
    ref = mh.scaled_dot_product_attention(q, k, v, masks.sliding_window(window), backend="math")
    for name, a, b in zip(["dq", "dk", "dv"], grads, torch.autograd.grad(ref, (q, k, v), g_out)):
        assert_close(a, b, what=f"{name} heads={heads} {pieces}")
