"""The fused tile engine's output memory: a call reuses the memory of the last output of its
shape only when nothing of the caller's refers to it any more (no tensor, view, storage or
NumPy array; nothing saved for a backward), never hands an inference tensor to a call outside
inference mode, and every call equals the NumPy float64 reference, at 1 and at 2 threads."""

import numpy as np
import pytest
import torch

import multihead as mh
from conftest import assert_close
from multihead import masks, reference
from multihead.kernels import common, fused_tiles

# without torch's storage use count the engine reuses no output (it cannot tell a held one): nothing to test
pytestmark = [pytest.mark.usefixtures("fused_band_engine"),  # this engine's calls, not the band kernel's
              pytest.mark.skipif(not common.HAS_CPU_FLASH or fused_tiles._STORAGE_USE_COUNT is None,
                                reason="needs torch's CPU flash kernel and its storage use count")]

WINDOW = 40


@pytest.fixture
def kept(monkeypatch):
    """Outputs of any size kept, in an empty store of their own."""
    # the engine's store of kept outputs is what these tests watch (no public view of it), and a fresh one
    # keeps other tests' outputs out of the counts; the size floor at 0 keeps these small test outputs
    monkeypatch.setattr(fused_tiles, "_KEPT_OUTPUTS", type(fused_tiles._KEPT_OUTPUTS)())
    monkeypatch.setattr(fused_tiles, "_KEPT_OUTPUT_MIN_BYTES", 0)  # small test outputs kept too
    return fused_tiles._KEPT_OUTPUTS  # the tests read the store: nothing public lists kept outputs


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request):
    n = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(n)


def _inputs(seed, T=600, H=4, Hkv=4, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, T, 16, generator=g, dtype=dtype)
    k, v = (torch.randn(1, Hkv, T, 16, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v


def _want(q, k, v):
    T = q.shape[2]
    allowed = masks.to_dense(masks.sliding_window(WINDOW), 1, 1, T, T)[0, 0].numpy()
    return torch.from_numpy(reference.attention(*(x.detach().double().numpy() for x in (q, k, v)), mask=allowed))


def _attend(q, k, v):
    return mh.scaled_dot_product_attention(q, k, v, masks.sliding_window(WINDOW) & masks.causal())


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_a_dropped_output_is_reused_and_every_call_equals_the_reference(kept, threads, heads):
    """Dropped results come back as the next call's memory; each call, fresh or reused, equals the
    reference (every element written: no value of the last call's survives)."""
    ptrs = []
    for seed in range(3):
        q, k, v = _inputs(seed, H=heads[0], Hkv=heads[1])
        with torch.no_grad():
            out = _attend(q, k, v)
        assert_close(out, _want(q, k, v), what=f"call {seed} heads={heads} threads={threads}")
        ptrs.append(out.data_ptr())
        del out
    assert ptrs[1] == ptrs[0] and ptrs[2] == ptrs[0], ptrs


@pytest.mark.parametrize("hold", ["tensor", "view", "storage", "numpy", "saved for backward"])
def test_an_output_still_held_is_never_overwritten(kept, threads, hold):
    """While the caller holds the result (itself, a view, its storage, a NumPy array, or autograd's
    saved tensors), the next call of the same shape writes elsewhere and the held values stay;
    an output autograd saved still gives the math path's gradients."""
    q, k, v = _inputs(0)
    q2, k2, v2 = _inputs(1)
    grad = hold == "saved for backward"
    xs = [x.clone().requires_grad_(grad) for x in (q, k, v)]
    with torch.set_grad_enabled(grad):
        out = _attend(*xs)
    before = out.detach().clone()
    ptr = out.data_ptr()
    held = {"tensor": lambda: out, "view": lambda: out.transpose(1, 2), "storage": lambda: out.untyped_storage(),
            "numpy": lambda: out.detach().numpy(), "saved for backward": lambda: out.sin()}[hold]()
    if hold != "tensor":
        loss_from = held if grad else None
        del out
    with torch.no_grad():
        other = _attend(q2, k2, v2)
    assert other.data_ptr() != ptr
    assert_close(other, _want(q2, k2, v2), what=f"second call, first held as {hold}")
    seen = {"tensor": lambda: held, "view": lambda: held.transpose(1, 2),
            "storage": lambda: torch.tensor([], dtype=q.dtype).set_(held, 0, before.shape),
            "numpy": lambda: torch.from_numpy(held), "saved for backward": lambda: held}[hold]()
    assert torch.equal(seen.detach(), before.sin() if grad else before), f"the held result changed ({hold})"
    if grad:  # the output saved (by sin and by the engine) is intact: gradients equal the math path's
        g_out = torch.linspace(-1, 1, before.numel(), dtype=torch.float64).view_as(before)
        grads = torch.autograd.grad(loss_from, xs, g_out)
        x64 = [x.clone().requires_grad_() for x in (q, k, v)]
        ref = mh.scaled_dot_product_attention(*x64, masks.sliding_window(WINDOW), backend="math").sin()
        for name, a, b in zip(["dq", "dk", "dv"], grads, torch.autograd.grad(ref, x64, g_out)):
            assert_close(a, b, what=f"{name} with the output saved, threads={threads}")


def test_a_storage_resized_before_it_was_dropped_is_not_reused(kept):
    """A caller that freed the memory of its result (storage resized to 0, as FSDP frees its own)
    and dropped it: the next call makes a new output of its own and equals the reference."""
    q, k, v = _inputs(6)
    with torch.no_grad():
        out = _attend(q, k, v)
        out.untyped_storage().resize_(0)
        del out
        again = _attend(q, k, v)
    assert again.untyped_storage().nbytes() == again.numel() * again.element_size()
    assert_close(again, _want(q, k, v), what="after a resized storage")


def test_an_output_moved_to_shared_memory_is_not_reused(kept):
    """A result moved to shared memory (sent to another process through torch.multiprocessing,
    which maps the same pages) and then dropped here: the next call writes elsewhere."""
    q, k, v = _inputs(7)
    with torch.no_grad():
        out = _attend(q, k, v)
        out.share_memory_()
        ptr = out.data_ptr()
        del out
        again = _attend(q, k, v)
    assert again.data_ptr() != ptr
    assert_close(again, _want(q, k, v), what="after a shared output")


def test_inference_outputs_stay_in_inference_mode(kept, threads):
    """Memory made under inference_mode is not handed to a call outside it (an inference tensor
    there cannot enter autograd), nor the reverse; both calls equal the reference."""
    q, k, v = _inputs(2)
    with torch.inference_mode():
        out = _attend(q, k, v)
    assert out.is_inference()
    assert_close(out, _want(q, k, v), what="inference_mode")
    del out
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    out = _attend(*xs)
    assert not out.is_inference()
    assert_close(out, _want(q, k, v), what="after inference_mode")
    out.sum().backward()
    assert all(x.grad is not None and bool(torch.isfinite(x.grad).all()) for x in xs)


def test_large_or_small_outputs_are_not_kept(kept, monkeypatch):
    """Below `_KEPT_OUTPUT_MIN_BYTES` (glibc reuses such memory itself) and above a slot's share of
    `_KEPT_OUTPUT_BYTES` nothing is kept; with KEEP_OUTPUT off neither; at most two slots."""
    q, k, v = _inputs(3, T=300, dtype=torch.float32)
    nbytes = q.numel() * 4
    # the size limits are the unit under test: set around this output's size, which the defaults dwarf
    monkeypatch.setattr(fused_tiles, "_KEPT_OUTPUT_MIN_BYTES", nbytes + 1)
    with torch.no_grad():
        _attend(q, k, v)
    assert not kept
    monkeypatch.setattr(fused_tiles, "_KEPT_OUTPUT_MIN_BYTES", 0)  # the floor off again
    monkeypatch.setattr(fused_tiles, "_KEPT_OUTPUT_BYTES", 2 * nbytes - 1)  # a slot's share is just too small
    with torch.no_grad():
        _attend(q, k, v)
    assert not kept
    monkeypatch.setattr(fused_tiles, "_KEPT_OUTPUT_BYTES", 1 << 30)  # room again: only the switch stops it
    monkeypatch.setattr(fused_tiles, "KEEP_OUTPUT", False)  # the public switch, off
    with torch.no_grad():
        _attend(q, k, v)
    assert not kept
    monkeypatch.setattr(fused_tiles, "KEEP_OUTPUT", True)  # and on: the slots fill, oldest out first
    with torch.no_grad():
        for T in (300, 310, 320):
            _attend(*_inputs(4, T=T, dtype=torch.float32))
    assert [key[0][2] for key in kept] == [310, 320]


def test_numpy_reference_is_independent():
    """The reference used above is NumPy's own softmax attention (a guard that it is not the engine)."""
    q, k, v = _inputs(5, T=50)
    want = _want(q, k, v).numpy()
    s = np.einsum("bhtd,bhsd->bhts", q.numpy(), k.numpy()) / 4.0
    allowed = masks.to_dense(masks.sliding_window(WINDOW), 1, 1, 50, 50)[0, 0].numpy()
    s = np.where(allowed, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(want, p @ v.numpy(), atol=1e-12)


def test_clear_caches_gives_back_dropped_outputs_and_plans_and_leaves_held_ones(kept, monkeypatch):
    """`multihead.clear_caches()` drops the kept plans and outputs: the bytes of a dropped output
    come back, a held one stays the caller's, unchanged by the calls after it; every call after
    it plans afresh and still equals the reference."""
    import sys

    from multihead.kernels import planner

    # fresh stores of plans and of their masks: clear_caches' counts are then this test's alone, and
    # what other tests planned stays theirs
    monkeypatch.setattr(planner, "_PLANS", type(planner._PLANS)())
    monkeypatch.setattr(fused_tiles, "_SHARED", type(fused_tiles._SHARED)())  # the plans' masks, likewise
    flex = sys.modules.get("multihead.kernels.flex")
    flex_loaded = flex is not None
    if flex_loaded:  # what other tests compiled stays theirs: this test clears stores of its own
        kept_masks = {"key": "a block mask"}
        # flex's stores, replaced as the plans' are above (one holding an entry for clear_caches to drop)
        monkeypatch.setattr(flex, "_block_masks", type(flex._block_masks)(kept_masks))
        monkeypatch.setattr(flex, "_score_fns", type(flex._score_fns)())  # flex's score functions, likewise
    q, k, v = _inputs(0)
    out = _attend(q, k, v)
    nbytes = out.untyped_storage().nbytes()
    del out  # dropped: the engine's alias is all that is left of it
    assert mh.clear_caches() == {"plans": 1, "outputs": 1, "output_bytes": nbytes}
    assert mh.clear_caches() == {"plans": 0, "outputs": 0, "output_bytes": 0}  # nothing kept is left
    assert not fused_tiles._SHARED  # the plans' masks too, which clear_caches does not count
    held = _attend(q, k, v)  # planned afresh
    assert_close(held, _want(q, k, v))
    snapshot = held.clone()
    assert mh.clear_caches() == {"plans": 1, "outputs": 1, "output_bytes": 0}  # held: nothing given back
    q2, k2, v2 = _inputs(1)
    assert_close(_attend(q2, k2, v2), _want(q2, k2, v2))
    assert torch.equal(held, snapshot)
    assert ("multihead.kernels.flex" in sys.modules) == flex_loaded  # clearing imports nothing
    if flex_loaded:
        assert not flex._block_masks  # flex's block masks dropped too
