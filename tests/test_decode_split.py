"""The decode step split over the key axis (`kernels.decode`, flash-decoding): the parts'
log-sum-exp merge equals the float64 reference and the math backend (GQA, MQA, MHA; key
counts at the split's boundaries; bfloat16), `attend` takes it exactly where
`key_splits` says it pays, falls back everywhere else (gradients, one thread, a batch,
masks, causal blocks, few keys), and the NaN rule holds through it whatever the kernel
does with a NaN."""

from __future__ import annotations

import pytest
import torch

from conftest import AtenOps, assert_close
from multihead import reference as R
from multihead.functional import attend
from multihead.kernels import common, decode, machine_plan, native, set_machine_plan

pytestmark = pytest.mark.skipif(not common.HAS_CPU_FLASH, reason="this torch has no CPU flash kernel with its lse")


def _qkv(B=1, H=9, Hkv=3, T=1, S=40, D=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g).to(dtype) for shape in ((B, H, T, D), (B, Hkv, S, D), (B, Hkv, S, D)))


def _reference(q, k, v, scale=None, causal=False):
    return torch.from_numpy(R.attention(*(t.detach().double().numpy() for t in (q, k, v)), scale=scale,
                                        causal=causal))


@pytest.fixture
def two_threads(monkeypatch):
    """Two intra-op threads and a split threshold low enough for small test shapes: 8 keys of
    D = Dv = 16 in float32 (fewer do not split)."""
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(decode, "MIN_SPLIT_BYTES", 8 * 32 * 4)  # as the docstring says: small shapes split
    # torch's kernel for every step: the GEMM engine, timed where a step streams, would take some
    before = set_machine_plan(machine_plan().with_choices(decode_engine="flash"))
    yield
    set_machine_plan(before)
    torch.set_num_threads(n)


# ---------------------------------------------------------------- the merge itself


@pytest.mark.parametrize("H, Hkv", [(9, 3), (8, 2), (32, 8), (4, 1), (6, 6)])  # GQA, MQA, MHA
@pytest.mark.parametrize("S, parts", [(40, 2), (41, 2), (2, 2), (3, 2), (43, 4), (3, 3), (2048, 3), (16384 + 5, 2),
                                     (16384 + 5, 3)])
@pytest.mark.parametrize("T", [1, 3])
def test_split_equals_the_reference_and_the_math_backend(H, Hkv, S, parts, T):
    """2 parts: two runs of ceil(S / 2) keys, the key both hold masked out of the second for
    an odd S; more: equal runs of S // parts keys and the rest (S % parts) as one more call,
    whose output the NaN check reads too."""
    q, k, v = _qkv(H=H, Hkv=Hkv, T=T, S=S, D=16 if S < 10000 else 8)
    out, part_outs = decode.split_keys(q, k, v, 0.25, parts)
    assert out.shape == (1, H, T, 16 if S < 10000 else 8)
    assert part_outs.shape[0] == parts + (parts > 2 and S % parts > 0)
    want = _reference(q, k, v, scale=0.25)
    assert_close(out, want, atol=1e-6, rtol=1e-6, what=f"split {parts} of S={S}")
    math, _ = attend(q, k, v, scale=0.25, backend="math", return_weights=[0])
    assert_close(out, math, atol=1e-6, rtol=1e-6, what="split vs math")


def test_split_reads_a_cache_view():
    """K/V as a KV cache hands them: the first S slots of a longer buffer (strided, offset)."""
    q, k, v = _qkv(S=64)
    buf_k, buf_v = torch.randn(1, 3, 100, 16), torch.randn(1, 3, 100, 16)
    buf_k[:, :, 10:74], buf_v[:, :, 10:74] = k, v
    out, _ = decode.split_keys(q, buf_k[:, :, 10:74], buf_v[:, :, 10:74], 0.25, 3)
    assert_close(out, _reference(q, k, v, scale=0.25), atol=1e-6, rtol=1e-6, what="cache view")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("S", [300, 301])  # 301: the overlap mask in the dtype
def test_split_in_other_dtypes(dtype, S):
    q, k, v = _qkv(S=S, dtype=dtype)
    out, _ = decode.split_keys(q, k, v, 0.25, 2)
    assert out.dtype == dtype
    assert_close(out, _reference(q, k, v, scale=0.25), dtype, what=str(dtype))


# ------------------------------------------------------- where attend takes it


def _spy(monkeypatch):
    calls = []
    real = decode.split_keys

    def spy(*a, **kw):
        calls.append(a[4])
        return real(*a, **kw)

    monkeypatch.setattr(decode, "split_keys", spy)  # records the parts of each split: the tests check them
    return calls


@pytest.mark.parametrize("causal", [False, True])  # one query sees every key either way
@pytest.mark.parametrize("S", [50, 51])
def test_attend_splits_where_the_threads_would_idle(two_threads, monkeypatch, causal, S):
    calls = _spy(monkeypatch)
    q, k, v = _qkv(S=S)  # 3 K/V heads on 2 threads
    out, w = attend(q, k, v, causal=causal)
    assert calls == [2] and w is None
    assert_close(out, _reference(q, k, v, causal=causal), atol=1e-6, rtol=1e-6, what="attend, split")
    general, _ = attend(q, k, v, causal=causal, return_weights=[0])  # the general path: one kernel call
    assert_close(out, general, atol=1e-6, rtol=1e-6, what="split vs unsplit")


@pytest.mark.parametrize("case", ["requires grad", "one thread", "batch 2", "threads divide Hkv", "MQA", "MHA",
                                  "few keys", "causal block", "a mask", "backend math", "many queries"])
def test_attend_does_not_split(two_threads, monkeypatch, case):
    calls = _spy(monkeypatch)
    shape = {"batch 2": dict(B=2), "threads divide Hkv": dict(H=8, Hkv=2), "MQA": dict(Hkv=1),
             "MHA": dict(Hkv=9), "few keys": dict(S=7), "causal block": dict(T=4, S=50),
             "many queries": dict(T=11)}.get(case, {})
    q, k, v = _qkv(**({"S": 50} | shape))
    kw = {"causal block": dict(causal=True), "a mask": dict(mask=torch.ones(50, dtype=torch.bool)),
          "backend math": dict(backend="math")}.get(case, {})
    if case == "requires grad":
        q.requires_grad_()
    if case == "one thread":
        torch.set_num_threads(1)
    out, _ = attend(q, k, v, **kw)
    assert calls == []
    assert_close(out, _reference(q, k, v, causal=case == "causal block"), what=case)


def test_gradients_stay_exact(two_threads):
    """A step autograd records runs unsplit: the kernel's backward takes no gradient through
    the log-sum-exp the merge would need."""
    q, k, v = (t.requires_grad_() for t in _qkv(S=50))
    got = torch.autograd.grad(attend(q, k, v)[0].square().sum(), (q, k, v))
    want = torch.autograd.grad(attend(q, k, v, backend="math")[0].square().sum(), (q, k, v))
    for name, a, b in zip("qkv", got, want):
        assert_close(a, b, what=f"d{name}")


def test_key_splits_balances_the_threads(monkeypatch):
    monkeypatch.setattr(decode, "MIN_SPLIT_BYTES", 8)  # any size splits: the count depends on the threads only
    n = torch.get_num_threads()
    try:
        for threads, Hkv, want in ((2, 3, 2), (2, 5, 2), (2, 4, 1), (4, 3, 4), (4, 2, 2), (4, 6, 2), (3, 2, 3)):
            torch.set_num_threads(threads)
            if torch.get_num_threads() != threads:
                continue  # this torch caps the threads
            q, k, v = _qkv(H=2 * Hkv, Hkv=Hkv, S=50)
            assert decode.key_splits(q, k, v) == want, (threads, Hkv)
    finally:
        torch.set_num_threads(n)


# ----------------------------------------------------------- the NaN rule, split


def _zero_nan_rows(kernel):
    """flash_lse that zeroes the rows of NaN queries and every row of a part whose keys all
    hold a NaN, with a finite lse: what a kernel may do, which a merged row would hide."""
    def wrapped(q, k, *a, **kw):
        out, lse = kernel(q, k, *a, **kw)
        bad = torch.isnan(q).any(-1) | torch.isnan(k).any(-1).all(-1)[..., None]  # (P, Hkv, G*T)
        return out.masked_fill(bad[..., None], 0.0), lse.masked_fill(bad, 0.0)
    return wrapped


@pytest.mark.parametrize("kernel", ["as this machine's", "zeroing"])
@pytest.mark.parametrize("where", ["query", "every key of one part", "one key", "one value",
                                   "the last key, S odd", "the last value, S odd", "the key both parts hold"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_rule_through_the_split(two_threads, monkeypatch, kernel, where, dtype):
    if kernel == "zeroing":
        # the other kernel behaviour, injected: this machine's torch has one of the two
        monkeypatch.setattr(decode, "flash_lse", _zero_nan_rows(decode.flash_lse))
    calls = _spy(monkeypatch)
    q, k, v = _qkv(S=50 if where in ("query", "every key of one part", "one key", "one value") else 51, dtype=dtype)
    if where == "the last key, S odd":
        k[0, 1, 50, 0] = float("nan")
    elif where == "the last value, S odd":
        v[0, 2, 50, 5] = float("nan")
    elif where == "the key both parts hold":  # key 25 of 51: masked out of the second part
        k[0, 0, 25, 1] = float("nan")
    elif where == "query":
        q[0, 4, 0, 1] = float("nan")
    elif where == "every key of one part":
        k[0, 1, :25, 3] = float("nan")  # the first of 2 parts of K/V head 1: query heads 3, 4, 5
    elif where == "one key":
        k[0, 2, 30, 0] = float("nan")
    else:
        v[0, 0, 7, 2] = float("nan")
    out, _ = attend(q, k, v)
    assert calls == [2]
    kv_nan = (torch.isnan(k).any(-1).any(-1) | torch.isnan(v).any(-1).any(-1)).repeat_interleave(3, dim=1)
    want = torch.isnan(q).any(-1) | kv_nan[..., None]  # (B, H, T)
    assert torch.equal(torch.isnan(out).any(-1), want), torch.isnan(out).any(-1).nonzero().tolist()
    assert torch.isnan(out[want]).all()
    clean = ~want[..., 0]
    assert_close(out[clean], _reference(q, k, v)[clean], dtype, what="rows without NaN")


# ------------------------------------------------------ where the split starts, what it runs


def test_the_split_starts_at_min_split_bytes_of_k_and_v_per_head(monkeypatch):
    """K and V bytes of one K/V head, S * (D + Dv) * element size, not keys: a head of 128
    reaches the threshold with half the keys of a head of 64, bfloat16 with twice the keys."""
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        if torch.get_num_threads() != 2:
            pytest.skip("this torch caps the threads below 2")
        monkeypatch.setattr(decode, "MIN_SPLIT_BYTES", 64 * 128 * 4)  # 64 keys of D = Dv = 64, float32
        for D, dtype, S_min in ((64, torch.float32, 64), (128, torch.float32, 32), (64, torch.bfloat16, 128)):
            for S, want in ((S_min - 1, 1), (S_min, 2), (S_min + 1, 2)):
                q, k, v = _qkv(S=S, D=D, dtype=dtype)
                assert decode.key_splits(q, k, v) == want, (D, dtype, S)
    finally:
        torch.set_num_threads(n)


_VIEWS = {"view", "reshape", "expand", "as_strided", "unsqueeze", "select", "slice", "detach", "alias",
          "_unsafe_view"}
_FLASH = "_scaled_dot_product_flash_attention_for_cpu"


@pytest.mark.parametrize("S, dtype", [(50, torch.float32), (51, torch.float32), (50, torch.bfloat16)])
def test_a_two_part_step_runs_one_kernel_call_a_three_op_merge_and_the_nan_check(two_threads, S, dtype):
    """Besides views, for an even or odd S: one kernel call over both parts, the merge's
    difference, sigmoid and lerp (for bfloat16 the casts to float32 and back), the NaN
    check's one sum (none for float32 where the native library reads the rows in C). No
    copy or read of K/V, no mask built, no softmax (it wakes the threads): inside a decode
    step each op costs tens of microseconds with the caches the K/V stream has just evicted
    (benchmarks/decode.py --profile)."""
    q, k, v = _qkv(S=S, dtype=dtype)
    attend(q, k, v)  # an odd S grows the overlap mask's buffer on its first step, once per process
    with torch.no_grad(), AtenOps() as seen:
        out, _ = attend(q, k, v)
    work = [op for op in seen.names if op not in _VIEWS]
    cast = ["_to_copy"] if dtype != torch.float32 else []
    check = [] if dtype == torch.float32 and native.library() is not None else ["sum"]
    assert work == [_FLASH, *cast, "sub", "sigmoid", "lerp", *cast, *check], seen.ops
    assert_close(out, _reference(q, k, v), dtype, what="split step")


def test_more_parts_run_no_softmax(monkeypatch):
    """4 threads over 3 K/V heads: 4 parts, the rest of S % 4 keys as one more call; the
    weights from exp(lse - max), never torch's softmax."""
    monkeypatch.setattr(decode, "MIN_SPLIT_BYTES", 8)  # any size splits: the count depends on the threads only
    n = torch.get_num_threads()
    torch.set_num_threads(4)
    before = set_machine_plan(machine_plan().with_choices(decode_engine="flash"))  # torch's kernel, split
    try:
        if torch.get_num_threads() != 4:
            pytest.skip("this torch caps the threads below 4")
        for S in (48, 50):
            q, k, v = _qkv(S=S)
            assert decode.key_splits(q, k, v) == 4
            with torch.no_grad(), AtenOps() as seen:
                out, _ = attend(q, k, v)
            work = [op for op in seen.names if op not in _VIEWS]
            assert work.count(_FLASH) == 1 + (S % 4 > 0) and "_softmax" not in work, seen.ops
            assert_close(out, _reference(q, k, v), atol=1e-6, rtol=1e-6, what=f"4 parts, S={S}")
    finally:
        set_machine_plan(before)
        torch.set_num_threads(n)


def test_the_overlap_mask_is_a_view_of_one_buffer_that_grows():
    # the buffer's reuse is the unit under test: no public call returns the mask
    overlap_mask = decode._overlap_mask
    small, big = overlap_mask(3, torch.float32), overlap_mask(5000, torch.float32)
    for c, m in ((3, small), (5000, big)):
        assert m.shape == (2, 1, 1, c)
        assert (m[0] == 0).all() and m[1, 0, 0, 0] == float("-inf") and (m[1, 0, 0, 1:] == 0).all()
    assert overlap_mask(7, torch.float32).untyped_storage().data_ptr() == big.untyped_storage().data_ptr()
    assert overlap_mask(7, torch.bfloat16).dtype == torch.bfloat16


def test_a_part_whose_every_key_scores_minus_inf_weighs_nothing(two_threads, monkeypatch):
    calls = _spy(monkeypatch)
    q, k, v = _qkv(S=50)
    q = q.abs()
    k[0, 1, :25, 0] = float("-inf")  # every score of the first part of K/V head 1 is -inf (q >= 0)
    out, _ = attend(q, k, v)
    assert calls == [2]
    general, _ = attend(q, k, v, return_weights=[0])
    assert_close(out, general, atol=1e-6, rtol=1e-6, what="split vs unsplit, -inf keys")
