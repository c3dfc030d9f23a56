"""The native band engine (`kernels.band`, the C kernel `band.c` that `kernels.native` builds
for the machine): attention under a relative mask, exact against the NumPy float64 reference
over sliding windows, causal with T != S, masks that leave rows empty, GQA/MQA/MHA, batches,
head widths and row counts around its blocks; the NaN rule through `attend` on it (a clean
output needs no sums); taken only where it may; timed against the fused tile engine once per
case, and fixed by the plan."""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from conftest import AtenOps, assert_close
from multihead import masks
from multihead import reference as R
from multihead.functional import attend
from multihead.kernels import MachinePlan, band, machine_plan, measured_choices, native, set_machine_plan
from multihead.masks import MaskMod

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no native kernel: {native.unavailable()}")


def _qkv(B=1, H=4, Hkv=2, T=200, S=None, D=32, seed=0):
    S = T if S is None else S
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, T, D), (B, Hkv, S, D), (B, Hkv, S, D))
    return tuple(torch.randn(*shape, generator=g, dtype=torch.float64).float() for shape in shapes)


def _reference(q, k, v, mask, scale):
    B, H, T, _ = q.shape
    dense = mask.to_dense(B, H, T, k.shape[2]).expand(B, H, T, k.shape[2]).numpy()
    return torch.from_numpy(R.attention(*(t.double().numpy() for t in (q, k, v)), mask=dense, scale=scale))


def _lag(n: int) -> MaskMod:
    """q - kv >= n: the first n rows (with T == S) attend no key."""
    return MaskMod(lambda b, h, q, kv: q - kv >= n, f"lag({n})", relative=True)


@pytest.fixture
def plan():
    """Fix the plan's band engine for the test; the plan (and what was timed) after."""
    before = machine_plan()
    yield lambda engine: set_machine_plan(before.with_choices(band_engine=engine))
    set_machine_plan(before)


@pytest.mark.parametrize("mask", [masks.sliding_window(16) & masks.causal(), masks.sliding_window(100),
                                  masks.causal(), _lag(3)], ids=["window16&causal", "window100", "causal", "lag3"])
@pytest.mark.parametrize("T, S", [(1, 1), (63, 63), (64, 64), (65, 65), (200, 200), (50, 300), (300, 50)])
def test_band_equals_the_reference(mask, T, S):
    q, k, v = _qkv(T=T, S=S, seed=T + S)
    result = band.band(q, k, v, mask, 0.3)
    assert result is not None
    out, bad = result
    want = _reference(q, k, v, mask, 0.3)
    empty = ~mask.to_dense(1, 4, T, S).expand(1, 4, T, S).any(-1)  # rows with no key: 0, and flagged
    assert bad == bool(empty.any())
    assert_close(out, torch.where(empty.unsqueeze(-1), 0.0, want), torch.float32, what=f"{mask} T={T} S={S}")


def test_a_top_left_relative_mask_is_read_as_flex_reads_it():
    """A flex-style callable declared relative (`top_left=True`: q_idx is the row) with T != S
    means other pairs than the same function bottom-right; both read as `to_dense` reads them."""
    fn = lambda b, h, q, kv: (q - kv >= 0) & (q - kv < 7)  # noqa: E731
    q, k, v = _qkv(T=80, S=200)
    for mask in (MaskMod(fn, "top-left", top_left=True, relative=True), MaskMod(fn, "bottom-right", relative=True)):
        out, bad = band.band(q, k, v, mask, 0.3)
        assert not bad
        assert_close(out, _reference(q, k, v, mask, 0.3), torch.float32, what=mask.name)


def test_a_mask_that_allows_nothing_gives_zeros_flagged():
    nothing = MaskMod(lambda b, h, q, kv: q - kv > 10 ** 6, "nothing", relative=True)
    q, k, v = _qkv(T=100)
    out, bad = band.band(q, k, v, nothing, 0.3)
    assert bad and bool((out == 0).all())
    got, _ = attend(q, k, v, mask=nothing)  # through attend: the rule's zeros, whichever engine
    assert bool((got == 0).all())


@pytest.mark.parametrize("H, Hkv", [(8, 2), (6, 6), (4, 1)])  # GQA, MHA, MQA
@pytest.mark.parametrize("D", [4, 20, 32, 64, 128, 256])
@pytest.mark.parametrize("B", [1, 2])
def test_band_over_geometries(H, Hkv, D, B):
    q, k, v = _qkv(B=B, H=H, Hkv=Hkv, T=150, D=D, seed=D)
    q = q * 2  # sharper softmax: the running max moves from tile to tile
    mask = masks.sliding_window(70) & masks.causal()
    out, bad = band.band(q, k, v, mask, D ** -0.5)
    assert not bad
    assert_close(out, _reference(q, k, v, mask, D ** -0.5), torch.float32, what=f"B={B} H={H} Hkv={Hkv} D={D}")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_any_thread_count_gives_the_same_answer(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k, v = _qkv(T=700, D=64)
        mask = masks.sliding_window(256) & masks.causal()
        assert_close(band.band(q, k, v, mask, 0.125)[0], _reference(q, k, v, mask, 0.125), torch.float32,
                     what=f"{threads} threads")
    finally:
        torch.set_num_threads(before)


def test_views_are_read_where_they_lie():
    """q as a model hands it, a transposed view `(B, T, H, D) -> (B, H, T, D)`, and K/V views of
    a longer cache."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 90, 4, 32, generator=g).transpose(1, 2)
    cache = torch.randn(2, 2, 2, 400, 32, generator=g)
    k, v = cache[0, :, :, :120], cache[1, :, :, :120]
    mask = masks.sliding_window(40) & masks.causal()
    assert not q.is_contiguous() and band.applies(q, k, v, mask, None, 0.0)
    assert_close(band.band(q, k, v, mask, 0.2)[0], _reference(q, k, v, mask, 0.2), torch.float32, what="views")


def test_a_mask_that_differs_by_head_is_left_to_the_fused_engine():
    by_head = MaskMod(lambda b, h, q, kv: (q - kv >= 0) & (q - kv < 8 * (h + 1)), "by head", relative=True)
    q, k, v = _qkv()
    assert band.applies(q, k, v, by_head, None, 0.0) and band.band(q, k, v, by_head, 0.3) is None
    out, _ = attend(q, k, v, mask=by_head, scale=0.3)  # the fused engine answers
    assert_close(out, _reference(q, k, v, by_head, 0.3), torch.float32, what="a mask by head")


def test_applies_only_where_it_may():
    q, k, v = _qkv()
    win = masks.sliding_window(8) & masks.causal()
    assert band.applies(q, k, v, win, None, 0.0)
    assert not band.applies(*(t.double() for t in (q, k, v)), win, None, 0.0)  # float32 only
    assert not band.applies(q, k, v, win, None, 0.1)  # dropout
    assert not band.applies(q, k, v, win, mh.score_mods.alibi(torch.ones(4)), 0.0)  # a score mod
    assert not band.applies(q, k, v, masks.document(torch.arange(200) // 50), None, 0.0)  # not relative
    assert not band.applies(q, k, v, None, None, 0.0)
    assert not band.applies(q.requires_grad_(), k, v, win, None, 0.0)  # a graph: the fused engine's backward
    q = q.detach()
    with torch.no_grad():
        assert band.applies(q.requires_grad_(), k, v, win, None, 0.0)
    q = q.detach()
    assert not band.applies(*_qkv(D=6), win, None, 0.0)  # D not a multiple of 4
    assert not band.applies(*_qkv(D=260), win, None, 0.0)  # over 256
    assert not band.applies(q, k, torch.randn(1, 2, 200, 16), win, None, 0.0)  # Dv != D
    assert not band.applies(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v, win, None, 0.0)


@pytest.mark.parametrize("where", ["q", "attended key", "attended value", "hidden value in a read tile",
                                   "hidden key and value in a skipped tile"])
def test_the_nan_rule_holds_through_it(where, plan):
    """The same answer as the math backend, which applies the rule row by row."""
    plan("native")
    q, k, v = _qkv(T=300, D=32)
    mask = masks.sliding_window(20) & masks.causal()
    if where == "q":
        q[0, 1, 150, 3] = float("nan")
    elif where == "attended key":
        k[0, 0, 140, 0] = float("nan")  # rows 140-159 attend it
    elif where == "attended value":
        v[0, 1, 200, 5] = float("nan")
    elif where == "hidden value in a read tile":
        v[0, 0, 160, 2] = float("nan")  # row 159's tile holds key 160, which it may not attend
    else:
        k[0, 0, 10, :] = v[0, 0, 10, :] = float("nan")  # only rows 10-29 see it
    out, _ = attend(q, k, v, mask=mask)
    want, _ = attend(q, k, v, mask=mask, backend="math")
    assert torch.equal(out.isnan(), want.isnan()), where
    assert_close(out.nan_to_num(), want.nan_to_num(), torch.float32, what=where)


def test_a_clean_output_needs_no_sums(plan, monkeypatch):
    """attend skips the sums over q, k, v and out where the kernel looked at every row; a row
    it flags (one with no key) sends attend to them, which find the inputs finite."""
    import multihead.functional as functional

    plan("native")
    calls = []
    inner = functional._not_finite
    monkeypatch.setattr(functional, "_not_finite", lambda *a: calls.append(1) or inner(*a))
    q, k, v = _qkv(T=100)
    with torch.no_grad(), AtenOps() as seen:
        out, _ = attend(q, k, v, mask=masks.sliding_window(10) & masks.causal())
    assert calls == [] and not any("sum" in op for op in seen.ops), seen.ops
    out, _ = attend(q, k, v, mask=_lag(2))
    assert calls == [1] and bool((out[:, :, :2] == 0).all())


def test_the_engine_is_timed_once_per_case_and_the_plan_fixes_it(plan, monkeypatch):
    set_machine_plan(MachinePlan(machine_plan().l2_bytes, machine_plan().l3_bytes, "set"))  # nothing fixed
    calls = []
    inner = band._kernel
    monkeypatch.setattr(band, "_kernel", lambda *a: calls.append(a[0].shape[2]) or inner(*a))
    q, k, v = _qkv(T=1500, D=64)
    win = masks.sliding_window(64) & masks.causal()
    out, _ = attend(q, k, v, mask=win)
    won = measured_choices()["band_engine"][f"float32, {torch.get_num_threads()} threads, D 64, G 2, 64 keys"]
    assert won in ("native", "fused")
    assert calls[:3] == [1024] * 3  # the probe, the call's last 1024 rows, once each round
    assert (calls[3:] == [1500]) == (won == "native")
    calls.clear()
    attend(q, k, v, mask=win)
    assert calls == ([1500] if won == "native" else [])  # kept: not timed again
    attend(q, k, v, mask=masks.sliding_window(300) & masks.causal())  # another band width: timed anew
    assert len(measured_choices()["band_engine"]) == 2
    plan("fused")
    calls.clear()
    fused, _ = attend(q, k, v, mask=win)
    assert calls == []
    plan("native")
    native_out, _ = attend(q, k, v, mask=win)
    assert calls == [1500]
    assert_close(native_out, fused, torch.float32, what="the two engines")
    with pytest.raises(ValueError, match=r"^MachinePlan.band_engine must be one of None, 'fused', 'native'; "
                                         r"received 'flash'"):
        MachinePlan(band_engine="flash")


def test_fewer_rows_than_a_block_stay_on_the_fused_engine(plan):
    """A decode step under a window would compute a whole block of padded rows for its one."""
    plan("native")
    rows = native.band_rows()
    assert rows in (32, 64)
    q, k, v = _qkv(T=rows - 1, S=500)
    win = masks.sliding_window(100) & masks.causal()
    assert not band.applies(q, k, v, win, None, 0.0)
    assert band.applies(*_qkv(T=rows, S=500), win, None, 0.0)
    out, _ = attend(q, k, v, mask=win)
    assert_close(out, _reference(q, k, v, win, 32 ** -0.5), torch.float32, what="a short call on the fused engine")


def test_the_public_call_takes_it_with_the_plan(plan):
    plan("native")
    q, k, v = _qkv(T=500, D=64)
    win = masks.sliding_window(128) & masks.causal()
    assert_close(mh.scaled_dot_product_attention(q, k, v, win), _reference(q, k, v, win, 0.125), torch.float32,
                 what="the public call")
