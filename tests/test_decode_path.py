"""The decode step's quick path: one query, no mask, no score mod, no weights, no dropout
(every layer, every token of `generate`). `attend` accepts such a call with two folded
checks (`validation.plain_shape`, `plain_scale`), the HF attention function without its
per-keyword work, and the NaN rule's decode check is one reduction read back as a list.
Held against the general path (bit for bit), the NumPy reference, the general path's
errors, the NaN rule, and the op count the benchmark's microseconds come from."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from conftest import AtenOps, assert_close
from multihead import reference as R
from multihead.functional import attend
from multihead.kernels import native
from multihead.kernels.machine import machine_plan, set_machine_plan
from multihead.kernels.validation import check_inputs, check_scale, plain_scale, plain_shape

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _qkv(B=2, H=8, Hkv=2, T=1, S=9, D=8, Dv=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, D, generator=g).to(dtype), torch.randn(B, Hkv, S, D, generator=g).to(dtype),
            torch.randn(B, Hkv, S, D if Dv is None else Dv, generator=g).to(dtype))


def _reference(q, k, v, causal=False, scale=None):
    """NumPy float64 (K/V heads repeated there for GQA), as a tensor."""
    return torch.from_numpy(R.attention(*(t.detach().double().numpy() for t in (q, k, v)), causal=causal,
                                        scale=scale))


# ------------------------------------------------------------ the folded checks


def _valid():
    q, k, v = _qkv()
    return {
        "GQA decode": (q, k, v),
        "MQA": _qkv(Hkv=1),
        "MHA, T > 1": _qkv(Hkv=8, T=5, S=5),
        "Dv != D": _qkv(Dv=3),
        "float16": _qkv(dtype=torch.float16),
        "bfloat16": _qkv(dtype=torch.bfloat16),
        "float64": _qkv(dtype=torch.float64),
        "B = 0": _qkv(B=0),
        "S = 0": _qkv(S=0),
        "a Parameter": (torch.nn.Parameter(q), k, v),
    }


def _invalid():
    q, k, v = _qkv()
    return {
        "q 3-D": (q[0], k, v),
        "k 5-D": (q, k[None], v),
        "v a list": (q, k, v.tolist()),
        "int q": (q.long(), k.long(), v.long()),
        "complex": (q.to(torch.complex64), k.to(torch.complex64), v.to(torch.complex64)),
        "dtypes differ": (q, k.double(), v),
        "H not a multiple of Hkv": (q[:, :7], k, v),
        "Hkv = 0": (q, k[:, :0], v[:, :0]),
        "batch differs": (q, k[:1], v[:1]),
        "k, v heads differ": (q, k, v[:, :1]),
        "k, v lengths differ": (q, k, v[:, :, :4]),
        "head dims differ": (q, k[..., :4], v),
        "devices differ": (q, k.to("meta"), v),
    }


def _check_error(q, k, v):
    try:
        check_inputs(q, k, v, None, None, 0.0)
    except (TypeError, ValueError) as err:
        return err
    return None


@pytest.mark.parametrize("case", list(_valid()))
def test_plain_shape_accepts_what_check_inputs_accepts(case):
    q, k, v = _valid()[case]
    assert _check_error(q, k, v) is None
    assert plain_shape(q, k, v) == (*q.shape[:3], k.shape[2])


@pytest.mark.parametrize("case", list(_invalid()))
def test_plain_shape_refuses_what_check_inputs_refuses_and_attend_says_the_same(case):
    q, k, v = _invalid()[case]
    err = _check_error(q, k, v)
    assert err is not None and plain_shape(q, k, v) is None
    with pytest.raises(type(err), match=re.escape(str(err))):
        attend(q, k, v)


@pytest.mark.parametrize("scale", [None, 0.125, 1e-30, 3.0])
def test_plain_scale_accepts(scale):
    assert plain_scale(scale) and check_scale(scale) == scale


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), True, 1, np.float64(0.3),
                                   torch.tensor(0.3), "0.3"])
def test_plain_scale_leaves_the_rest_to_check_scale(scale):
    """Anything but None or a positive finite float goes through `check_scale`: the same value
    (an int, a NumPy or tensor scalar) or the same error as before."""
    assert not plain_scale(scale)
    q, k, v = _qkv()
    try:
        want = check_scale(scale)
    except (TypeError, ValueError) as err:
        with pytest.raises(type(err), match=re.escape(str(err))):
            attend(q, k, v, scale=scale)
        return
    assert torch.equal(attend(q, k, v, scale=scale)[0], attend(q, k, v, scale=want)[0])


# ------------------------------------------------- the quick path's results


@pytest.mark.parametrize("shape", [dict(), dict(Hkv=1), dict(Hkv=8), dict(T=4, S=11), dict(T=6, S=6, Dv=5),
                                   dict(B=1, H=32, Hkv=4, S=40)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ["auto", "sdpa", "math", "chunked", "tiles"])
def test_quick_path_equals_the_general_path_and_the_reference(shape, causal, backend):
    """Asking for one head's weights sends the same call down the general path: the output
    must be the same bits."""
    q, k, v = _qkv(**shape)
    quick, none = attend(q, k, v, causal=causal, backend=backend)
    general, w = attend(q, k, v, causal=causal, backend=backend, return_weights=[0])
    assert none is None and w is not None
    assert torch.equal(quick, general), f"{backend}: max |diff| {(quick - general).abs().max():.3e}"
    assert_close(quick, _reference(q, k, v, causal), what=f"{backend} {shape} causal={causal}")


def test_quick_path_keeps_the_gradients():
    q, k, v = (t.requires_grad_() for t in _qkv(T=1, S=7))
    out, _ = attend(q, k, v)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    want = torch.autograd.grad(attend(q, k, v, backend="math", return_weights=True)[0].square().sum(), (q, k, v))
    for name, a, b in zip("qkv", grads, want):
        assert_close(a, b, what=f"d{name}")


def test_quick_path_empty_problems_are_zero():
    for shape in (dict(B=0), dict(S=0), dict(T=0)):
        q, k, v = _qkv(**shape)
        out, w = attend(q, k, v)
        assert w is None and out.shape == (*q.shape[:3], v.shape[-1]) and not out.any()


# ------------------------------------------------ the NaN rule's decode check


def _want_nan(q, k, v):
    """Rows (b, h, t) the NaN rule makes NaN with no mask and no causality: a NaN in the query
    or in any key or value of the row's K/V head."""
    G = q.shape[1] // k.shape[1]
    kv = (torch.isnan(k).any(-1).any(-1) | torch.isnan(v).any(-1).any(-1)).repeat_interleave(G, dim=1)
    return torch.isnan(q).any(-1) | kv[..., None]


def _zeroing(kernel):
    """A fused kernel that zeroes the rows of NaN queries (torch's CPU kernel on some CPUs)."""
    def wrapped(q, *args, **kwargs):
        return kernel(q, *args, **kwargs).masked_fill(torch.isnan(q).any(-1, keepdim=True), 0.0)
    return wrapped


@pytest.mark.parametrize("rows", ["a list (few rows)", "the sum and the first elements (many rows)"])
@pytest.mark.parametrize("kernel", ["as this machine's", "zeroing"])
@pytest.mark.parametrize("where", ["query", "every key of a head", "one value"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_nan_rule(rows, kernel, where, dtype, monkeypatch):
    """Both branches of the decode check (up to 64 rows of `out` read back as a list; more,
    the sum of all and a count of the rows' nonzero first elements) find a NaN row and a row
    the kernel zeroed."""
    if kernel == "zeroing":
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                            _zeroing(torch.nn.functional.scaled_dot_product_attention))
    shape = dict(B=1, H=8, Hkv=2) if rows.startswith("a list") else dict(B=3, H=32, Hkv=8)
    q, k, v = _qkv(**shape, dtype=dtype)
    if where == "query":
        q[0, 1, 0, 3] = float("nan")
    elif where == "every key of a head":
        k[-1, 1, :, 2] = float("nan")
    else:
        v[0, 0, 4, 1] = float("nan")
    out, _ = attend(q, k, v)
    want = _want_nan(q, k, v)
    assert torch.equal(torch.isnan(out).any(-1), want), torch.isnan(out).any(-1).nonzero().tolist()
    assert torch.isnan(out[want]).all()
    clean = ~want[..., 0]  # (B, H)
    assert_close(out[clean], _reference(q, k, v)[clean], dtype, what="rows without NaN")


def test_decode_rows_that_are_zero_or_sum_to_zero_are_not_nan():
    """A row of `out` that is exactly zero (all-zero values) or whose values cancel sends the
    check to its full form, which finds no NaN: the output is the attention, not NaN."""
    q, k, v = _qkv(Dv=4)
    v[0] = 0.0  # batch 0: every row of out is zero
    v[1, :, :, 2:] = -v[1, :, :, :2]  # batch 1: out = (a, b, -a, -b), each row sums to zero
    out, _ = attend(q, k, v)
    assert not torch.isnan(out).any()
    assert (out[0] == 0).all()
    assert_close(out, _reference(q, k, v), what="zero and cancelling rows")


# ----------------------------------------------------- what a decode step runs


_METADATA = ("aten.view", "aten.transpose", "aten._unsafe_view", "aten.reshape", "aten.expand", "aten.detach",
             "aten.alias", "aten.as_strided")


@pytest.fixture
def engine():
    """Fix the plan's decode engine for the test (`MachinePlan.decode_engine`); the plan after."""
    before = machine_plan()
    yield lambda name: set_machine_plan(before.with_choices(decode_engine=name))
    set_machine_plan(before)


@pytest.mark.parametrize("name", ["flash", "native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_step_runs_the_kernel_and_one_reduction(dtype, name, engine):
    """Besides views, one decode step through the HF attention function runs torch's kernel
    and the NaN check's one sum over the rows of `out` (no copy of K/V, no read of them,
    no second reduction): every such op costs 5-20 us per layer per token inside
    `generate` (benchmarks/hf_generate.py). float32 rows where the native library is built
    are checked in C: the kernel alone. On the native engine (float32) the step is one op,
    its output's allocation: the kernel looks at the rows itself."""
    pytest.importorskip("transformers")
    from multihead.interop.hf import attention_forward

    class Layer(torch.nn.Module):
        is_causal = True

    engine(name)
    built = native.library() is not None
    q, k, v = _qkv(B=1, S=30, D=32, dtype=dtype)
    with torch.no_grad(), AtenOps() as seen:
        out, w = attention_forward(Layer(), q, k, v, None, scaling=32 ** -0.5)
    work = [op for op in seen.ops if not op.startswith(_METADATA)]
    if dtype == torch.float32 and built and name == "native":
        assert work == ["aten.new_empty.default"], seen.ops
    elif dtype == torch.float32 and built:
        assert len(work) == 1 and "scaled_dot_product" in work[0], seen.ops
    else:
        assert len(work) == 2 and "scaled_dot_product" in work[0] and work[1].startswith("aten.sum"), seen.ops
    assert w is None
    assert_close(out.transpose(1, 2), _reference(q, k, v, scale=32 ** -0.5), dtype, what="decode step")


def test_the_decode_check_handles_an_empty_value_dim():
    q, k, v = _qkv(Dv=0)
    out, _ = attend(q, k, v)
    assert out.shape == (2, 8, 1, 0)


# ------------------------------------------- the HF attention function at T = 1


class _Layer(torch.nn.Module):
    is_causal = True

    def __init__(self, output_attentions=False):
        super().__init__()
        self.config = type("Config", (), {"output_attentions": output_attentions})()


def _hf():
    """multihead.interop.hf.registry (attention_forward, WeightsRequest, the keywords)."""
    pytest.importorskip("transformers")
    from multihead.interop.hf import registry

    return registry


def test_hf_decode_step_equals_attend_and_the_general_path():
    hf = _hf()
    q, k, v = _qkv()
    out, w = hf.attention_forward(_Layer(), q, k, v, None, scaling=0.3)
    assert w is None and out.shape == (2, 1, 8, 8) and out.is_contiguous()
    assert torch.equal(out, attend(q, k, v, scale=0.3)[0].transpose(1, 2))
    probe = hf.WeightsRequest(probe=True)  # any request sends the call down the general path
    general, _ = hf.attention_forward(_Layer(), q, k, v, None, scaling=0.3, multihead_weights=probe)
    assert torch.equal(out, general)
    assert [(c.H, c.Hkv, c.T, c.S, c.D) for c in probe.calls] == [(8, 2, 1, 9, 8)]
    tensor_scale, _ = hf.attention_forward(_Layer(), q, k, v, None, scaling=torch.tensor(0.3))
    assert torch.equal(out, tensor_scale)


@pytest.mark.parametrize("scaling, error", [(-1.0, ValueError), (0.0, ValueError), (float("nan"), ValueError),
                                            ("0.3", TypeError)])
def test_hf_decode_step_bad_scaling_names_scaling(scaling, error):
    hf = _hf()
    q, k, v = _qkv()
    with pytest.raises(error, match="scaling must be a positive finite number"):
        hf.attention_forward(_Layer(), q, k, v, None, scaling=scaling)


def test_hf_decode_step_weights_when_asked():
    """output_attentions, as a keyword or from the module's config, still returns the weights."""
    hf = _hf()
    q, k, v = _qkv()
    want = torch.softmax((q @ k.repeat_interleave(4, dim=1).transpose(-2, -1)) * 0.3, dim=-1)
    for layer, kw in ((_Layer(), {"output_attentions": True}), (_Layer(output_attentions=True), {})):
        out, w = hf.attention_forward(layer, q, k, v, None, scaling=0.3, **kw)
        assert_close(w, want, atol=1e-6, rtol=0, what="weights")
    _, w = hf.attention_forward(_Layer(output_attentions=True), q, k, v, None, scaling=0.3, output_attentions=False)
    assert w is None  # the keyword wins over the config, as in the general path


def test_hf_decode_step_runs_an_intervention():
    hf = _hf()
    q, k, v = _qkv()
    seen = []

    class ZeroHead:
        def inputs(self, module, q, k, v):
            seen.append("inputs")
            return q, k, v

        def output(self, module, out, v):
            seen.append("output")
            return out.index_fill(1, torch.tensor([3]), 0.0)

    out, _ = hf.attention_forward(_Layer(), q, k, v, None, scaling=0.3, **{hf.INTERVENTION_KEYWORD: ZeroHead()})
    assert seen == ["inputs", "output"]
    assert (out[:, :, 3] == 0).all() and out[:, :, 2].abs().sum() > 0
