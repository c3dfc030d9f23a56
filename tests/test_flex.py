"""The opt-in "flex" backend (torch.compile(flex_attention)) against the float64 NumPy reference,
torch's own (eager) flex_attention and the "math" backend.

torch compiles one kernel per (shape, mask, score mod), ~10 s each on a CPU, so the
tests share a few shapes (module-scoped inputs) and every test that compiles is marked
slow: CHUNK (a block of 40 queries over 100 keys, GQA, Dv != D), DECODE (one query) and
OVER (more queries than keys: bottom-right causal leaves rows with nothing to attend).
The tests that compile nothing (auto never compiles, errors) run in the fast suite.
"""

import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import multihead as mh
import multihead.functional as F
from conftest import assert_close
from multihead import masks, score_mods
from multihead import reference as R
from multihead.kernels import flex

B, H, HKV, D, DV = 2, 4, 2, 16, 8
CHUNK, DECODE, OVER = (40, 100), (1, 100), (48, 32)  # (T, S)
ATOL = 2e-6  # float32 flex against the float64 reference (measured max 7e-7 over these tests)
GRAD_ATOL = 2e-5  # float32 gradients (flex forward, tile-engine backward) against "math" in float32

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _qkv(T, S, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*s, generator=g).requires_grad_(grad)
                 for s in ((B, H, T, D), (B, HKV, S, D), (B, HKV, S, DV)))


@pytest.fixture(scope="module")
def chunk():
    return _qkv(*CHUNK)


def _reference(q, k, v, allowed=None, bias=None, **kw):
    """The float64 reference with multihead's rule for rows that may attend nothing: 0."""
    T, S = q.shape[2], k.shape[2]
    mask = None
    if allowed is not None:
        mask = allowed.expand(B, H, T, S).numpy()
    if bias is not None:
        mask = bias.double().expand(B, H, T, S).numpy()
        if allowed is not None:
            mask = np.where(allowed.expand(B, H, T, S).numpy(), mask, -np.inf)
    with np.errstate(invalid="ignore"):
        out = R.attention(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), mask=mask, **kw)
    if mask is not None:
        empty = ~np.isfinite(mask).any(-1) if mask.dtype != bool else ~mask.any(-1)
        out[empty] = 0.0
    return torch.from_numpy(out)


def _eager_flex(q, k, v, **kw):
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        return flex_attention(q, k, v, enable_gqa=True, **kw)


def _doc_ids(S):
    return torch.tensor([[0] * (S * 3 // 10) + [1] * (S - S * 3 // 10), [0] * (S * 6 // 10) + [1] * (S - S * 6 // 10)])


def _pred_cases():
    return {
        "window&causal": (CHUNK, lambda S: masks.sliding_window(24) & masks.causal(), False),
        "window, causal=True, decode": (DECODE, lambda S: masks.sliding_window(24), True),
        "document&causal": (CHUNK, lambda S: masks.document(_doc_ids(S)) & masks.causal(), False),
        "(prefix|chunked)&padding": (CHUNK, lambda S: (masks.prefix_lm(torch.tensor([10, 30])) | masks.local_chunks(16))
                                     & masks.padding(torch.tensor([S, 0])), False),  # batch 1: no key at all
        "causal, T > S": (OVER, lambda S: None, True),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_pred_cases()))
def test_predicates_equal_reference_and_math(name):
    (T, S), make, causal = _pred_cases()[name]
    q, k, v = _qkv(T, S, seed=1)
    pred = make(S)
    out = mh.scaled_dot_product_attention(q, k, v, pred, causal=causal, backend="flex")
    full = pred if not causal else (masks.causal() if pred is None else pred & masks.causal())
    allowed = masks.to_dense(full, B, H, T, S)
    assert_close(out, _reference(q, k, v, allowed), torch.float32, atol=ATOL, what=f"flex {name}")
    math = mh.scaled_dot_product_attention(q, k, v, pred, causal=causal, backend="math")
    assert_close(out, math, torch.float32, atol=ATOL, what=f"flex vs math {name}")
    empty = ~allowed.expand(B, H, T, S).any(-1)
    if empty.any():  # rows with nothing to attend are exactly 0, not NaN
        assert (out[empty] == 0).all()
    if name == "(prefix|chunked)&padding":
        assert empty[1].all() and not empty[0].any()


@pytest.mark.slow
def test_flex_callables_equal_torch_flex_attention(chunk):
    """A plain mask_mod and score_mod (top-left q_idx, as flex reads them), with causal=True
    (bottom-right) combined in: the same as torch's own flex_attention given the same callables."""
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v = chunk
    T, S = CHUNK

    def band_by_head(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= 3 * h + 5

    def tilt(score, b, h, q_idx, kv_idx):
        return score + 0.1 * (q_idx - kv_idx).to(score.dtype).abs().sqrt()

    out = mh.scaled_dot_product_attention(q, k, v, band_by_head, causal=True, score_mod=tilt, backend="flex")

    def band_and_bottom_right_causal(b, h, q_idx, kv_idx):
        return band_by_head(b, h, q_idx, kv_idx) & (kv_idx <= q_idx + S - T)

    torch_block_mask = create_block_mask(band_and_bottom_right_causal, B, H, T, S, device="cpu")
    ref = _eager_flex(q, k, v, score_mod=tilt, block_mask=torch_block_mask)
    assert_close(out, ref, torch.float32, atol=ATOL, what="flex vs torch flex_attention")
    math = mh.scaled_dot_product_attention(q, k, v, band_by_head, causal=True, score_mod=tilt, backend="math")
    assert_close(out, math, torch.float32, atol=ATOL, what="flex vs math")


@pytest.mark.slow
@pytest.mark.parametrize("mod", ["softcap", "alibi"])
def test_score_mods_equal_reference(chunk, mod):
    q, k, v = chunk
    T, S = CHUNK
    if mod == "softcap":  # Gemma-2: causal + softcap on the scaled scores
        out = mh.scaled_dot_product_attention(q, k, v, causal=True, score_mod=score_mods.softcap(2.0), backend="flex")
        ref = _reference(q, k, v, masks.to_dense(masks.causal(), B, H, T, S), softcap_cap=2.0)
    else:  # ALiBi (bottom-right distances) under a sliding window, scale given
        pred = masks.sliding_window(24)
        out = mh.scaled_dot_product_attention(q, k, v, pred, score_mod=score_mods.alibi(H), scale=0.3,
                                              backend="flex")
        ref = _reference(q, k, v, masks.to_dense(pred, B, H, T, S), alibi=R.alibi_slopes(H), scale=0.3)
    assert_close(out, ref, torch.float32, atol=ATOL, what=f"flex {mod}")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_dense_masks_equal_reference(chunk, kind):
    q, k, v = chunk
    T, S = CHUNK
    g = torch.Generator().manual_seed(3)
    if kind == "bool":
        mask = torch.rand(B, 1, T, S, generator=g) > 0.5  # (B, 1, T, S): broadcast over heads
        mask[:, :, 3] = False  # a row with nothing to attend
        out = mh.scaled_dot_product_attention(q, k, v, mask, backend="flex")
        ref = _reference(q, k, v, mask)
    else:
        mask = torch.randn(1, H, T, S, generator=g)  # (1, H, T, S): added to the scores
        mask[:, :, 5] = float("-inf")
        mask[:, :, 7, ::2] = float("-inf")
        out = mh.scaled_dot_product_attention(q, k, v, mask, causal=True, backend="flex")
        ref = _reference(q, k, v, masks.to_dense(masks.causal(), B, H, T, S), bias=mask)
    assert_close(out, ref, torch.float32, atol=ATOL, what=f"flex dense {kind} mask")
    assert (out[:, :, 3 if kind == "bool" else 5] == 0).all()
    # a new mask of the same shape (what a model builds every step) compiles nothing new
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    other = ~mask if kind == "bool" else mask.flip(-1)
    again = mh.scaled_dot_product_attention(q, k, v, other, causal=kind == "float", backend="flex")
    math = mh.scaled_dot_product_attention(q, k, v, other, causal=kind == "float", backend="math")
    assert_close(again, math, torch.float32, atol=ATOL, what=f"flex dense {kind}, second mask")
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow
@pytest.mark.parametrize("mod", [None, "softcap"])
def test_gradients_equal_math(mod):
    """CPU: flex's forward, the tile engine's recomputing backward; against autograd through "math"."""
    T, S = CHUNK
    pred = masks.sliding_window(24) & masks.causal() if mod is None else None
    score_mod = score_mods.softcap(2.0) if mod else None
    grads = {}
    for backend in ("flex", "math"):
        q, k, v = _qkv(T, S, grad=True)
        out = mh.scaled_dot_product_attention(q, k, v, pred, causal=mod is not None, score_mod=score_mod,
                                              backend=backend)
        (out * torch.linspace(-1, 1, DV)).sum().backward()
        grads[backend] = (out.detach(), q.grad, k.grad, v.grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), grads["flex"], grads["math"]):
        assert_close(a, b, torch.float32, atol=GRAD_ATOL, what=f"{name} ({mod})")


@pytest.mark.slow
def test_weights_gqa_and_block_mask_cache(chunk, monkeypatch):
    """Weights come from functional's memory-bounded pass; GQA K/V reach flex with Hkv heads;
    a fresh but equal predicate (the kernel builds and_masks(mask, causal()) anew every
    call) reuses the cached BlockMask, built once for all batches and heads, and compiles
    nothing new."""
    from torch._dynamo.utils import counters

    q, k, v = chunk
    mh.scaled_dot_product_attention(q, k, v, masks.sliding_window(24), causal=True, backend="flex")  # warm
    built = []
    # flex's loaded torch entry points are spied on: the test counts block masks built and flex calls made
    real = flex._flex["block_mask"]

    def spy(fn, Bm, Hm, T, S, **kw):
        built.append((Bm, Hm))
        return real(fn, Bm, Hm, T, S, **kw)

    monkeypatch.setitem(flex._flex, "block_mask", spy)  # counts the BlockMasks built (none on a cache hit)
    calls = []
    # and the K/V head count each flex call receives: GQA must reach flex unrepeated
    real_attention = flex._flex["attention"]

    def spy_attention(qq, kk, vv, **kw):
        calls.append((kk.shape[1], kw["enable_gqa"]))
        return real_attention(qq, kk, vv, **kw)

    monkeypatch.setitem(flex._flex, "attention", spy_attention)  # records the K/V heads of each call
    graphs = counters["stats"]["unique_graphs"]
    for _ in range(3):
        out, w = mh.attend(q, k, v, masks.sliding_window(24), causal=True,
                           return_weights=[0, 3], backend="flex")
    assert built == [] and counters["stats"]["unique_graphs"] == graphs
    assert calls == [(HKV, True)] * 3  # GQA through flex's enable_gqa: K/V never repeated per query head
    math_out, math_w = mh.attend(q, k, v, masks.sliding_window(24), causal=True,
                                 return_weights=[0, 3], backend="math")
    assert_close(out, math_out, torch.float32, atol=ATOL, what="out")
    assert_close(w, math_w, torch.float32, atol=ATOL, what="weights")
    flex.clear_cache()
    mh.scaled_dot_product_attention(q, k, v, masks.sliding_window(24), causal=True, backend="flex")
    assert built == [(None, None)]  # depends on neither b nor h: one block mask for all


@pytest.mark.slow
def test_module_with_flex_backend_equals_math():
    """Also S = 24: torch 2.13's CPU flex gives garbage (differently every run) for S % 16 == 8
    unless the keys are padded to whole blocks, as the backend does."""
    torch.manual_seed(0)
    kw = dict(d_model=32, n_heads=4, n_kv_heads=2, causal=True, sliding_window=8)
    attn = mh.Attention(**kw, backend="flex")
    ref = mh.Attention(**kw, backend="math")
    ref.load_state_dict(attn.state_dict())
    x = torch.randn(2, 24, 32)
    with torch.no_grad():
        assert_close(attn(x), ref(x), torch.float32, atol=ATOL, what="Attention(backend='flex')")


@pytest.mark.slow
def test_bfloat16_equals_float32_math_within_bfloat16_tolerance():
    q, k, v = (t.to(torch.bfloat16) for t in _qkv(*CHUNK))
    out = mh.scaled_dot_product_attention(q, k, v, masks.sliding_window(24), causal=True, backend="flex")
    assert out.dtype == torch.bfloat16
    ref = mh.scaled_dot_product_attention(q.float(), k.float(), v.float(), masks.sliding_window(24), causal=True,
                                          backend="math")
    assert_close(out, ref, torch.bfloat16, what="flex bfloat16")


# ------------------------------------------------------------ no compilation


def _refuse(*args, **kwargs):
    raise AssertionError("compiled or called flex without being asked")


def test_auto_never_picks_flex_nor_compiles(monkeypatch):
    import torch.nn.attention.flex_attention as torch_flex

    monkeypatch.setattr(torch, "compile", _refuse)
    # torch's own flex entry points: auto must reach neither
    monkeypatch.setattr(torch_flex, "flex_attention", _refuse)
    monkeypatch.setattr(torch_flex, "create_block_mask", _refuse)  # nor build a block mask
    monkeypatch.setattr(flex, "attention", _refuse)  # the backend's entry point: auto must never reach it
    T, S = 12, 20
    q, k, v = _qkv(T, S, grad=True)
    cases = [dict(mask=masks.sliding_window(4), causal=True), dict(mask=masks.document(_doc_ids(S)[0])),
             dict(causal=True, score_mod=score_mods.softcap(2.0)), dict(score_mod=score_mods.alibi(H)),
             dict(causal=True, return_weights=[1]), dict(causal=True, dropout_p=0.1)]
    for kw in cases:
        assert "flex" not in (F.resolve_backend(want_weights="return_weights" in kw, dropout_p=kw.get("dropout_p", 0),
                                                score_mod=kw.get("score_mod"), device="cpu"),)
        out, _ = F.attend(q, k, v, **kw)
        out.sum().backward()
    attn = mh.Attention(d_model=16, n_heads=4, causal=True, sliding_window=4, softcap=5.0)
    attn(torch.randn(1, 6, 16)).sum().backward()


def test_import_multihead_does_not_import_flex():
    code = ("import sys, torch, multihead as mh; mh.scaled_dot_product_attention(*[torch.randn(1, 1, 4, 8)] * 3); "
            "print('multihead.kernels.flex' in sys.modules, 'torch.nn.attention.flex_attention' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["False", "False"], res.stdout


def test_refusals_name_what_is_accepted(monkeypatch):
    monkeypatch.setitem(flex._flex, "attention", _refuse)  # none of these may reach the compiler
    monkeypatch.setitem(flex._flex, "block_mask", _refuse)  # nor build a block mask
    q, k, v = _qkv(8, 8)
    with pytest.raises(ValueError, match=r"'flex' cannot apply dropout.*'math'.*'tiles'"):
        mh.scaled_dot_product_attention(q, k, v, dropout_p=0.1, backend="flex")
    with pytest.raises(ValueError, match=r"'flex' cannot apply dropout.*'tiles', 'math'"):
        flex.attention(q, k, v, None, causal=False, scale=0.25, dropout_p=0.1, weight_heads=None)
    with pytest.raises(ValueError, match=r"float32, float16 or bfloat16.*torch.float64.*'tiles', 'math'"):
        mh.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), causal=True, backend="flex")
    with pytest.raises(TypeError, match="must return a bool tensor"):
        mh.scaled_dot_product_attention(q, k, v, lambda b, h, q_idx, kv_idx: kv_idx - q_idx, backend="flex")
    with pytest.raises(ValueError, match="changed the shape"):
        mh.scaled_dot_product_attention(q, k, v, backend="flex", score_mod=lambda s, b, h, q_idx, kv_idx: s.sum())
    learned = torch.zeros(H, requires_grad=True)
    with pytest.raises(ValueError, match=r"require grad.*'chunked', 'math'"):
        mh.scaled_dot_product_attention(q, k, v, backend="flex", score_mod=lambda s, b, h, qi, kv: s + learned[h])


def test_compiler_failures_become_clear_errors(monkeypatch):
    class InductorError(Exception):  # what torch raises, by name
        pass

    def fails(*args, **kwargs):
        raise InductorError("CppCompileError: C++ compile error\n<a long inductor traceback>")

    def limit(*args, **kwargs):
        raise torch._dynamo.exc.FailOnRecompileLimitHit("Hard failure due to fullgraph=True")

    # the compiler's failures are injected where flex calls torch: a real one cannot be provoked on demand
    monkeypatch.setitem(flex._flex, "block_mask", lambda *a, **k: None)
    q, k, v = _qkv(8, 8)
    monkeypatch.setitem(flex._flex, "attention", fails)  # an inductor failure, as above
    with pytest.raises(RuntimeError, match=r"torch.compile\(flex_attention\) failed.*InductorError.*'auto'"):
        mh.scaled_dot_product_attention(q, k, v, backend="flex")
    monkeypatch.setattr(flex.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler on PATH"):
        mh.scaled_dot_product_attention(q, k, v, backend="flex")
    monkeypatch.setitem(flex._flex, "attention", limit)  # the recompile limit, injected as above
    with pytest.raises(RuntimeError, match=r"more than 64 distinct.*decoding.*'auto'"):
        mh.scaled_dot_product_attention(q, k, v, backend="flex")

    class BackendCompilerFailed(Exception):  # dynamo's wrapper: a bare heading, inductor's error as its cause
        pass

    class CppCompileError(Exception):
        pass

    def wrapped(cause):
        def call(*args, **kwargs):
            raise BackendCompilerFailed("backend='inductor' raised:\n") from cause
        return call
    monkeypatch.setattr(flex.shutil, "which", lambda name: "/usr/bin/g++")
    # dynamo's wrapped failure, injected as above
    monkeypatch.setitem(flex._flex, "attention", wrapped(CppCompileError("g++: internal compiler error")))
    with pytest.raises(RuntimeError, match=r"failed on this machine: BackendCompilerFailed: backend='inductor' "
                                           r"raised: \(CppCompileError: g\+\+: internal compiler error\)"):
        mh.scaled_dot_product_attention(q, k, v, backend="flex")  # the machine's, read through the wrapper
    monkeypatch.setitem(flex._flex, "attention", wrapped(RuntimeError("")))  # a failure with no message
    with pytest.raises(ValueError, match=r"could not compile.*raised: \(RuntimeError: no message\)"):
        mh.scaled_dot_product_attention(q, k, v, backend="flex")


def test_untraceable_mods_raise_value_errors(monkeypatch):
    """A mask or score mod that runs eagerly but cannot be vmapped or compiled (a Python
    branch on a tensor value): a ValueError naming it and the backends that run it."""
    class LoweringException(Exception):  # what inductor raises for an op it cannot lower, by name
        pass

    def lowering_fails(*args, **kwargs):
        raise LoweringException("SubgraphLoweringException: Buffers cannot be created while lowering")

    def branchy(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx if (q_idx > 3).all() else kv_idx >= q_idx

    # load torch's flex, then inject inductor's lowering failure: a real one takes a compile to provoke
    flex._load()
    monkeypatch.setitem(flex._flex, "attention", lowering_fails)  # fails as inductor does on a branchy mod
    q, k, v = _qkv(8, 8)
    assert mh.scaled_dot_product_attention(q, k, v, branchy, backend="math").shape == (B, H, 8, DV)  # eager: fine
    with pytest.raises(ValueError, match=r"create_block_mask could not evaluate the mask branchy.*vmap.*'tiles'"):
        mh.scaled_dot_product_attention(q, k, v, branchy, backend="flex")
    with pytest.raises(ValueError, match=r"could not compile flex_attention with mask causal and score mod "
                                         r"softcap\(2\): LoweringException.*'auto'"):
        mh.scaled_dot_product_attention(q, k, v, causal=True, score_mod=score_mods.softcap(2.0), backend="flex")


_GLOBAL_IDS = None


def test_structural_cache_key_sees_through_fresh_objects():
    # the block-mask cache's key is the unit under test: checking it through cache hits would compile a kernel per case
    key = flex._key
    ids = torch.tensor([0, 0, 1, 1])
    a = masks.sliding_window(4) & masks.document(ids)
    assert key(a) == key(masks.sliding_window(4) & masks.document(ids))
    assert key(a) != key(masks.sliding_window(5) & masks.document(ids))
    assert key(a) != key(masks.sliding_window(4) & masks.document(ids.clone()))
    before = key(a)
    ids[0] = 1  # an in-place edit of captured ids is a different mask
    assert key(a) != before
    global _GLOBAL_IDS
    _GLOBAL_IDS = torch.tensor([0, 1, 1, 1])

    def reads_a_global(b, h, q_idx, kv_idx):
        return _GLOBAL_IDS[q_idx] == _GLOBAL_IDS[kv_idx]

    before = key(masks.from_flex(reads_a_global))
    _GLOBAL_IDS = torch.tensor([0, 0, 1, 1])  # rebinding the global is a different mask
    assert key(masks.from_flex(reads_a_global)) != before
    assert key(score_mods.softcap(50)) == key(score_mods.softcap(50.0))
    assert key(score_mods.softcap(50)) != key(score_mods.softcap(30))
