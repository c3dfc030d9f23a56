"""The plain call's short way at every length: a causal prefill with as many keys as queries
(one call per layer of a model's prompt) runs `sdpa.plain` like a decode step, and the NaN
rule's check reads `out` alone (the sum of its rows, or of all of it and its rows' first
elements), never q, k and v, where no row is empty. Held against the general path (bit for
bit), the NumPy reference, the NaN rule with the kernel as it is and with one that zeroes
rows, and the ops a call runs. And the HF attention function's decode step: any keyword
that may ask for more sends the call down the general path, which gives the same answer."""

from __future__ import annotations

import pytest
import torch

import multihead.functional as functional
from conftest import AtenOps, assert_close
from multihead import reference as R
from multihead.functional import attend
from multihead.kernels import native
from multihead.kernels.sdpa import plain_applies

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _qkv(B=1, H=8, Hkv=2, T=24, S=None, D=16, dtype=torch.float32, seed=0, projected=True):
    """q as a model's projection hands it: `(B, T, H, D)` seen as `(B, H, T, D)` (not contiguous)."""
    g = torch.Generator().manual_seed(seed)
    S = T if S is None else S
    q = torch.randn(B, T, H, D, generator=g).to(dtype).transpose(1, 2) if projected \
        else torch.randn(B, H, T, D, generator=g).to(dtype)
    return q, torch.randn(B, Hkv, S, D, generator=g).to(dtype), torch.randn(B, Hkv, S, D, generator=g).to(dtype)


def _reference(q, k, v, causal=True):
    return torch.from_numpy(R.attention(*(t.detach().double().numpy() for t in (q, k, v)), causal=causal))


def _spy_plain(monkeypatch):
    """Count the calls that took the plain step (`kernels.decode.step`)."""
    calls = []
    # the step taken is reported nowhere public: a spy on the plain step's entry counts its calls
    real = functional._decode_step

    def spy(*a, **kw):
        calls.append(a[0].shape[2])
        return real(*a, **kw)

    monkeypatch.setattr(functional, "_decode_step", spy)  # counts the plain steps (see above)
    return calls


# ------------------------------------------------------------- where the plain step runs


_SHAPES = {"GQA": dict(), "MHA": dict(Hkv=8), "MQA": dict(Hkv=1), "batch 2": dict(B=2), "few rows": dict(H=2, Hkv=1)}


@pytest.mark.parametrize("shape", list(_SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("projected", [True, False])
def test_causal_prefill_is_plain_and_equals_the_general_path(monkeypatch, shape, dtype, projected):
    calls = _spy_plain(monkeypatch)
    q, k, v = _qkv(**_SHAPES[shape], dtype=dtype, projected=projected)
    with torch.no_grad():
        quick, none = attend(q, k, v, causal=True)
        general, w = attend(q, k, v, causal=True, return_weights=[0])  # weights: the general path
    assert calls == [q.shape[2]] and none is None and w is not None
    assert torch.equal(quick, general), f"max |diff| {(quick.double() - general.double()).abs().max():.3e}"
    assert_close(quick, _reference(q, k, v), dtype, what=f"{shape} {dtype}")


@pytest.mark.parametrize("shape", ["GQA", "MHA", "MQA"])
def test_causal_prefill_under_autograd(monkeypatch, shape):
    """MHA takes the plain step with its gradients; GQA and MQA keep `sdpa`'s per-group calls
    (their backward's order); every gradient equals the math path's."""
    calls = _spy_plain(monkeypatch)
    q, k, v = (t.detach().double().requires_grad_() for t in _qkv(**_SHAPES[shape], T=9))
    out, _ = attend(q, k, v, causal=True)
    assert calls == ([9] if shape == "MHA" else [])
    got = torch.autograd.grad(out.square().sum(), (q, k, v))
    want = torch.autograd.grad(attend(q, k, v, causal=True, backend="math")[0].square().sum(), (q, k, v))
    for name, a, b in zip("qkv", got, want):
        assert_close(a, b, what=f"{shape} d{name}")


@pytest.mark.parametrize("case", ["more keys than queries", "a mask", "backend math", "dropout", "weights"])
def test_what_stays_on_the_general_path(monkeypatch, case):
    calls = _spy_plain(monkeypatch)
    q, k, v = _qkv(T=6, S=10 if case == "more keys than queries" else 6)
    kw = {"a mask": dict(mask=torch.ones(6, 6, dtype=torch.bool).tril()), "backend math": dict(backend="math"),
          "dropout": dict(dropout_p=0.5), "weights": dict(return_weights=True)}.get(case, {})
    out, _ = attend(q, k, v, causal=case != "a mask", **kw)
    assert calls == []
    if case != "dropout":
        assert_close(out, _reference(q, k, v), what=case)


def test_plain_applies():
    q, k, v = _qkv(T=5)
    assert plain_applies(q, k, v, causal=False) and plain_applies(q, k, v, causal=True)
    assert plain_applies(q[:, :, :1], k, v, causal=True)  # one query sees every key
    assert not plain_applies(q[:, :, :3], k, v, causal=True)  # bottom-right over more keys
    assert plain_applies(q[:, :, :3], k, v, causal=False)
    grad_q = q.detach().requires_grad_()
    assert not plain_applies(grad_q, k, v, causal=True)  # GQA under autograd: per-group calls
    with torch.no_grad():
        assert plain_applies(grad_q, k, v, causal=True)
    grad_mha = _qkv(Hkv=8, T=5)[0].requires_grad_()
    assert plain_applies(grad_mha, *_qkv(Hkv=8, T=5)[1:], causal=True)


# ----------------------------------------------------------- the NaN rule, plain prefill


def _want_nan(q, k, v):
    """Rows (b, h, t) the NaN rule makes NaN, causal with T == S: a NaN in the query, or in a
    key or value j <= t of the row's K/V head."""
    G = q.shape[1] // k.shape[1]
    kv = (torch.isnan(k).any(-1) | torch.isnan(v).any(-1)).repeat_interleave(G, dim=1)  # (B, H, S)
    seen = kv.cumsum(-1) > 0  # (B, H, T): some key j <= t holds a NaN
    return torch.isnan(q).any(-1) | seen


def _zeroing(kernel):
    """A fused kernel that zeroes the rows of NaN queries (torch's CPU kernel on some CPUs)."""
    def wrapped(q, *args, **kwargs):
        return kernel(q, *args, **kwargs).masked_fill(torch.isnan(q).any(-1, keepdim=True), 0.0)
    return wrapped


@pytest.mark.parametrize("rows", ["few rows (a list)", "many rows (the sum and the first elements)"])
@pytest.mark.parametrize("kernel", ["as this machine's", "zeroing"])
@pytest.mark.parametrize("where", ["query", "the first key of a head", "a key the first rows do not see",
                                   "a value the first rows do not see", "the last value"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_nan_rule(monkeypatch, rows, kernel, where, dtype):
    if kernel == "zeroing":
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                            _zeroing(torch.nn.functional.scaled_dot_product_attention))
    calls = _spy_plain(monkeypatch)
    shape = dict(H=2, Hkv=1, T=20) if rows.startswith("few") else dict(B=2, H=8, Hkv=2, T=24)
    q, k, v = _qkv(**shape, dtype=dtype)
    T = q.shape[2]
    if where == "query":
        q[0, 1, 7, 3] = float("nan")
    elif where == "the first key of a head":  # row 0 sees it alone: every score NaN
        k[-1, -1, 0, 2] = float("nan")
    elif where == "a key the first rows do not see":
        k[0, 0, 11, 0] = float("nan")
    elif where == "a value the first rows do not see":
        v[0, 0, 5, 1] = float("nan")
    else:
        v[-1, 0, T - 1, 4] = float("nan")
    out, _ = attend(q, k, v, causal=True)
    assert calls == [T]
    want = _want_nan(q, k, v)
    assert torch.equal(torch.isnan(out).any(-1), want), torch.isnan(out).any(-1).nonzero().tolist()
    assert torch.isnan(out[want]).all()
    clean = [torch.nan_to_num(t, nan=0.0) for t in (q, k, v)]  # (the reference's 0 * NaN would spread a hidden one)
    assert_close(out[~want], _reference(*clean)[~want], dtype, what="rows without NaN")


@pytest.mark.parametrize("rows", ["few rows (a list)", "many rows (the sum and the first elements)"])
def test_zero_rows_and_zero_first_elements_are_not_nan(rows):
    """A row that is exactly zero (zero values), or whose first element is zero, sends the
    check to its full form, which finds no NaN: the output is the attention, not NaN."""
    shape = dict(H=2, Hkv=1, T=20) if rows.startswith("few") else dict(B=2, H=8, Hkv=2, T=24)
    q, k, v = _qkv(**shape)
    v[0] = 0.0  # batch 0: every row of out is zero
    v[-1, :, :, 0] = 0.0  # the last batch: every row's first element is zero
    out, _ = attend(q, k, v, causal=True)
    assert not torch.isnan(out).any() and (out[0] == 0).all()
    assert_close(out, _reference(q, k, v), what="zero rows and first elements")


# ------------------------------------------------------------- what a prefill runs


_METADATA = ("aten.view", "aten.transpose", "aten._unsafe_view", "aten.reshape", "aten.expand", "aten.detach",
             "aten.alias", "aten.as_strided", "aten.select", "aten.slice", "aten._local_scalar_dense")


@pytest.mark.parametrize("check", ["in C (kernels.native)", "by tensor ops"])
def test_a_prefill_reads_out_once_and_never_q_k_v(monkeypatch, check):
    """Besides views and read-backs: torch's kernel, and the check of `out`'s rows: in C where
    the native library is built (no op at all), else one sum over `out` and one count of its
    rows' first elements; no copy of `out` into another layout, no sum of q, k or v (the
    four sums cost a tenth of a SmolLM2 prefill call inside `generate`)."""
    if check.startswith("in C") and native.library() is None:
        pytest.skip(f"no native library: {native.unavailable()}")
    if check == "by tensor ops":
        monkeypatch.setattr(functional._native, "library", lambda: None)
    q, k, v = _qkv(T=96)  # 768 rows
    with torch.no_grad(), AtenOps() as seen:
        out, _ = attend(q, k, v, causal=True)
    work = [op for op in seen.ops if not op.startswith(_METADATA)]
    assert "scaled_dot_product" in work[0], seen.ops
    if check == "by tensor ops":
        assert len(work) == 3, seen.ops
        assert work[1] == "aten.sum.default" and work[2].startswith("aten.count_nonzero"), seen.ops
    else:
        assert len(work) == 1, seen.ops
    assert_close(out, _reference(q, k, v), what="prefill")


def test_the_check_in_c_flags_the_rows_the_tensor_ops_flag(monkeypatch):
    """`_nan_or_zero_row` in C and by tensor ops on the same rows: a NaN, a zero row, a row
    whose first element alone is zero, an infinity. Both flag a NaN and a zero row and pass
    clean rows; beyond those, each form flags one more case, which costs only the sums after
    it: C an infinity (the sums then send it to the exact path, as `_not_finite` does any
    input holding one), the tensor ops' form for many rows a zero first element (the sums
    then find nothing)."""
    if native.library() is None:
        pytest.skip(f"no native library: {native.unavailable()}")
    lib = native.library()
    g = torch.Generator().manual_seed(3)
    for rows in (3, 64, 65, 700):
        base = torch.randn(rows, 20, generator=g)
        cases = {"clean": (base, False)}
        for what, r, col, value in (("nan", rows // 2, 7, float("nan")), ("inf", rows - 1, 0, float("inf"))):
            x = base.clone()
            x[r, col] = value
            cases[what] = (x, True)
        zero = base.clone()
        zero[rows // 3] = 0.0
        cases["zero row"] = (zero, True)
        first = base.clone()
        first[:, 0] = 0.0
        cases["zero first elements"] = (first, False)
        by_ops = {}
        with monkeypatch.context() as m:
            m.setattr(functional._native, "library", lambda: None)
            for what, (x, _) in cases.items():
                by_ops[what] = functional._nan_or_zero_row(x)
        for what, (x, want) in cases.items():
            assert bool(lib.mh_bad_rows(x.data_ptr(), rows, 20, 20)) is want, (rows, what)
            assert functional._nan_or_zero_row(x) is want, (rows, what)
            view = torch.cat((x, x), 1)[:, :20]  # rows 40 floats apart: the strided form
            assert bool(lib.mh_bad_rows(view.data_ptr(), rows, 20, 40)) is want, (rows, what, "strided")
            assert want or not by_ops[what] or (what == "zero first elements" and rows > 64), (rows, what)
        assert by_ops["nan"] and by_ops["zero row"] and not by_ops["clean"], (rows, by_ops)


# ------------------------------------------- the HF attention function's decode step


class _Layer(torch.nn.Module):
    is_causal = True

    def __init__(self, output_attentions=False):
        super().__init__()
        self.config = type("Config", (), {"output_attentions": output_attentions})()


def _registry():
    pytest.importorskip("transformers")
    from multihead.interop.hf import registry

    return registry


@pytest.mark.parametrize("keyword", ["multihead_weights", "multihead_heads", "multihead_observer",
                                     "output_attentions"])
def test_a_keyword_that_asks_nothing_gives_the_same_step(keyword):
    """A keyword that may ask for more, passed as None (or output_attentions=False), takes the
    general path: the same output, no weights."""
    hf = _registry()
    q, k, v = _qkv(B=2, T=1, S=9, projected=False)
    want, _ = hf.attention_forward(_Layer(), q, k, v, None, scaling=0.3)
    got, w = hf.attention_forward(_Layer(), q, k, v, None, scaling=0.3,
                                  **{keyword: False if keyword == "output_attentions" else None})
    assert w is None and torch.equal(got, want)


def test_a_decode_step_with_dropout_is_the_general_paths():
    """The step hands `dropout` to `attend`, which checks it: a bad one is named as the
    general path names it, a training-mode one drops out (rows differ from the plain step)."""
    hf = _registry()
    q, k, v = _qkv(T=1, S=9, projected=False)
    probe = hf.WeightsRequest(probe=True)  # any request sends the call down the general path
    for bad in (1.5, -0.1):
        with pytest.raises(ValueError) as general:
            hf.attention_forward(_Layer(), q, k, v, None, dropout=bad, scaling=0.3, multihead_weights=probe)
        with pytest.raises(ValueError, match="dropout_p") as quick:
            hf.attention_forward(_Layer(), q, k, v, None, dropout=bad, scaling=0.3)
        assert str(quick.value) == str(general.value)
    plain, _ = hf.attention_forward(_Layer(), q, k, v, None, scaling=0.3)
    torch.manual_seed(1)
    dropped, _ = hf.attention_forward(_Layer(), q, k, v, None, dropout=0.5, scaling=0.3)
    torch.manual_seed(1)
    general, _ = hf.attention_forward(_Layer(), q, k, v, None, dropout=0.5, scaling=0.3, multihead_weights=probe)
    assert torch.equal(dropped, general) and not torch.equal(dropped, plain)
