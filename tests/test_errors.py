"""Bad input: every case raises ValueError/TypeError naming what was received and what is valid."""

import numpy as np
import pytest
import torch
from torch import nn

import multihead as mh
from multihead import masks
from multihead.interop.torch import from_torch, to_torch
from multihead.score_mods import alibi as mh_alibi
from multihead.score_mods import softcap as mh_softcap

q = torch.randn(2, 8, 5, 4)
k = torch.randn(2, 2, 7, 4)
v = torch.randn(2, 2, 7, 3)
sdpa = mh.scaled_dot_product_attention


def _attn(**kw):
    return mh.Attention(16, 4, **kw)


def _full_cache():
    cache = mh.Attention(16, 4, causal=True).new_cache(1, 2)
    cache.update(torch.zeros(1, 4, 2, 4), torch.zeros(1, 4, 2, 4))
    return cache


def _learned_mod():
    w = torch.ones(8, requires_grad=True)
    return lambda s, b, h, qi, kv: s * w[h]


def _unprobeable_mod(s, b, h, qi, kv):
    if s.shape[-1] < 7:
        raise RuntimeError("wants all 7 keys at once")
    return s


def _double_backward(**kw):
    qq = q.clone().requires_grad_()
    return torch.autograd.grad(sdpa(qq, k, v, **kw).sum(), qq, create_graph=True)


CASES = [
    # (id, callable, exception, substrings the message must contain)
    ("q rank 3", lambda: sdpa(q[0], k, v), ValueError, ["q must be 4-D", "(8, 5, 4)"]),
    ("k rank 5", lambda: sdpa(q, k[None], v), ValueError, ["k must be 4-D", "(1, 2, 2, 7, 4)"]),
    ("q not a tensor", lambda: sdpa(q.numpy(), k, v), TypeError, ["q must be a torch.Tensor", "ndarray"]),
    ("integer q", lambda: sdpa(q.long(), k.long(), v.long()), TypeError, ["floating-point", "torch.int64"]),
    ("H not multiple of Hkv", lambda: sdpa(q[:, :6], k[:, :1].expand(2, 4, 7, 4), v[:, :1].expand(2, 4, 7, 3)),
     ValueError, ["H (6)", "Hkv (4)", "divisible", "valid: 1, 2, 3, 6"]),
    ("batch mismatch", lambda: sdpa(q, k[:1], v[:1]), ValueError, ["batch sizes differ", "(2, 8, 5, 4)"]),
    ("head dim mismatch", lambda: sdpa(q, torch.randn(2, 2, 7, 5), v), ValueError, ["same head dim", "(2, 2, 7, 5)"]),
    ("k/v length mismatch", lambda: sdpa(q, k, v[:, :, :6]), ValueError, ["same key length", "(2, 2, 6, 3)"]),
    ("dtype mismatch", lambda: sdpa(q, k.double(), v), TypeError, ["share a dtype", "torch.float64"]),
    ("mask not broadcastable", lambda: sdpa(q, k, v, torch.ones(2, 8, 5, 6, dtype=torch.bool)), ValueError,
     ["(2, 8, 5, 6)", "not broadcastable", "(2, 8, 5, 7)"]),
    ("integer mask", lambda: sdpa(q, k, v, torch.ones(5, 7, dtype=torch.long)), TypeError,
     ["torch.int64", "bool", "mask.bool()"]),
    ("3-D mask ambiguous", lambda: sdpa(q, k, v, torch.ones(2, 5, 7, dtype=torch.bool)), ValueError,
     ["3-D mask (2, 5, 7)", "ambiguous", "mask[:, None]"]),
    ("2-D mask ambiguous when B == T", lambda: sdpa(q[:, :, :2], k, v, torch.ones(2, 7, dtype=torch.bool)),
     ValueError, ["ambiguous", "B == T", "masks.padding"]),
    ("key padding given as 2-D mask", lambda: sdpa(q, k, v, torch.ones(2, 7, dtype=torch.bool)), ValueError,
     ["(2, 7)", "not broadcastable", "masks.padding"]),
    ("mask is a list", lambda: sdpa(q, k, v, [[True]]), TypeError, ["mask must be", "list"]),
    ("dropout 1.0", lambda: sdpa(q, k, v, dropout_p=1.0), ValueError, ["dropout_p", "[0, 1)", "1.0"]),
    ("dropout negative", lambda: sdpa(q, k, v, dropout_p=-0.1), ValueError, ["[0, 1)", "-0.1"]),
    ("scale zero", lambda: sdpa(q, k, v, scale=0.0), ValueError, ["scale", "positive", "0.0"]),
    ("weight head out of range", lambda: mh.attend(q, k, v, return_weights=[8]), ValueError,
     ["weight head index 8", "valid: 0..7"]),
    ("weight head not int", lambda: mh.attend(q, k, v, return_weights=[1.5]), TypeError, ["ints", "1.5"]),
    ("unknown backend", lambda: sdpa(q, k, v, backend="flash3"), ValueError,
     ["'flash3'", "'math'", "'sdpa'", "'chunked'"]),
    ("backend cannot dropout", lambda: sdpa(q, k, v, dropout_p=0.1, backend="chunked"), ValueError,
     ["'chunked' cannot apply dropout", "'math'"]),
    ("backend cannot weights+dropout", lambda: mh.attend(q, k, v, dropout_p=0.1, backend="sdpa", return_weights=True),
     ValueError, ["'sdpa' cannot return weights together with dropout", "'math'"]),
    ("n_heads not divisible by n_kv_heads", lambda: mh.Attention(48, 12, 5), ValueError,
     ["n_heads (12)", "n_kv_heads (5)", "valid: 1, 2, 3, 4, 6, 12"]),
    ("d_model not divisible by n_heads", lambda: mh.Attention(50, 12), ValueError,
     ["d_model (50)", "n_heads (12)", "head_dim"]),
    ("n_heads zero", lambda: mh.Attention(16, 0), ValueError, ["n_heads must be an int >= 1", "0"]),
    ("module dropout 1", lambda: _attn(dropout=1.0), ValueError, ["dropout", "[0, 1)", "1.0"]),
    ("module unknown backend", lambda: _attn(backend="xformers"), ValueError, ["'xformers'", "'sdpa'"]),
    ("rope wrong type", lambda: _attn(rope="yes"), TypeError, ["rope must be", "str"]),
    ("rope dim over head dim", lambda: _attn(rope=mh.RotaryEmbedding(8)), ValueError,
     ["rotary dim (8)", "head_dim (4)"]),
    ("x width mismatch", lambda: _attn()(torch.randn(2, 3, 12)), ValueError, ["width 12", "expects 16"]),
    ("x rank 2", lambda: _attn()(torch.randn(3, 16)), ValueError, ["3-D (B, T, 16)", "(3, 16)"]),
    ("context width mismatch", lambda: _attn(context_dim=10)(torch.randn(2, 3, 16), torch.randn(2, 4, 12)),
     ValueError, ["context has width 12", "expects 10"]),
    ("context batch mismatch", lambda: _attn()(torch.randn(2, 3, 16), torch.randn(3, 4, 16)), ValueError,
     ["context batch size (3)", "x's (2)"]),
    ("cache overflow", lambda: _full_cache().update(torch.zeros(1, 4, 1, 4), torch.zeros(1, 4, 1, 4)), ValueError,
     ["cache overflow", "2 tokens cached + 1 new = 3", "max_len 2"]),
    ("cache batch mismatch", lambda: _attn(causal=True)(torch.randn(3, 1, 16), cache=_attn().new_cache(2, 8)),
     ValueError, ["batch size 2", "batch size 3"]),
    ("cache dtype mismatch", lambda: _attn()(torch.randn(2, 1, 16), cache=_attn().new_cache(2, 8, dtype=torch.float64)),
     TypeError, ["torch.float64", "torch.float32"]),
    ("cache wrong heads", lambda: mh.KVCache(2, 2, 8, 4).update(torch.zeros(2, 4, 1, 4), torch.zeros(2, 4, 1, 4)),
     ValueError, ["(2, 4, 1, 4)", "does not fit"]),
    ("cache not a KVCache", lambda: _attn()(torch.randn(2, 1, 16), cache={}), TypeError, ["KVCache", "dict"]),
    ("cache max_len zero", lambda: mh.KVCache(1, 1, 0, 4), ValueError, ["max_len must be an int >= 1", "0"]),
    ("cache integer dtype", lambda: mh.KVCache(1, 1, 4, 4, dtype=torch.int8), TypeError, ["floating", "torch.int8"]),
    ("sliding window zero", lambda: masks.sliding_window(0), ValueError, ["window must be an int >= 1", "0"]),
    ("padding both args", lambda: masks.padding(torch.tensor([1]), keep=torch.ones(1, 2, dtype=torch.bool)),
     ValueError, ["exactly one", "lengths=set", "keep=set"]),
    ("padding float lengths", lambda: masks.padding(torch.tensor([1.5])), TypeError,
     ["lengths must be an integer tensor (B,)", "torch.float32"]),
    ("rope odd dim", lambda: mh.RotaryEmbedding(7), ValueError, ["even", "7"]),
    ("from_torch add_zero_attn", lambda: from_torch(nn.MultiheadAttention(16, 4, add_zero_attn=True)),
     ValueError, ["add_zero_attn", "no equivalent"]),
    ("from_torch bias_kv", lambda: from_torch(nn.MultiheadAttention(16, 4, add_bias_kv=True)),
     ValueError, ["add_bias_kv", "no equivalent"]),
    ("from_torch kdim != vdim", lambda: from_torch(nn.MultiheadAttention(16, 4, kdim=8, vdim=6)),
     ValueError, ["kdim (8) != vdim (6)", "valid: kdim == vdim"]),
    ("to_torch GQA", lambda: to_torch(mh.Attention(16, 4, 2)), ValueError, ["n_kv_heads (2) != n_heads (4)"]),
    ("rope with cross-attention", lambda: _attn(rope=True)(torch.randn(1, 2, 16), torch.randn(1, 3, 16)),
     ValueError, ["rotary", "cross-attention"]),
    # kernel: predicates, score mods, scalars
    ("predicate returns float", lambda: sdpa(q, k, v, lambda b, h, qi, kv: (qi - kv).float()), TypeError,
     ["must return a bool tensor", "torch.float32"]),
    ("predicate returns python bool", lambda: sdpa(q, k, v, lambda b, h, qi, kv: True), TypeError,
     ["must return a bool tensor", "bool True"]),
    ("predicate wrong shape", lambda: sdpa(q, k, v, lambda b, h, qi, kv: torch.ones(3, 3, dtype=torch.bool)),
     ValueError, ["returned shape (3, 3)", "not broadcastable"]),
    ("score mod changes shape", lambda: sdpa(q, k, v, score_mod=lambda s, b, h, qi, kv: s.sum(-1)), ValueError,
     ["changed the shape", "(2, 8, 5, 7)", "(2, 8, 5)"]),
    ("score mod returns bool", lambda: sdpa(q, k, v, score_mod=lambda s, b, h, qi, kv: s > 0), TypeError,
     ["floating-point scores", "torch.bool"]),
    ("score mod not callable", lambda: sdpa(q, k, v, score_mod=3), TypeError, ["score_mod must be callable", "int"]),
    ("sdpa cannot softcap", lambda: sdpa(q, k, v, score_mod=mh_softcap(5.0), backend="sdpa"), ValueError,
     ["'sdpa' cannot apply the score mod softcap(5)", "'tiles'", "'math'"]),
    ("doc ids wrong length", lambda: sdpa(q, k, v, masks.document(torch.zeros(6, dtype=torch.long))), ValueError,
     ["doc_ids has 6 positions", "S = 7"]),
    ("doc ids wrong batch", lambda: sdpa(q, k, v, masks.document(torch.zeros(3, 7, dtype=torch.long))), ValueError,
     ["batch size 3", "valid: 1 or 2"]),
    ("doc ids float", lambda: masks.document(torch.zeros(7)), TypeError, ["integer tensor", "torch.float32"]),
    ("padding more lengths than batch", lambda: sdpa(q, k, v, masks.padding(torch.tensor([7, 7, 7]))), ValueError,
     ["3 entries", "B = 2"]),
    ("padding fewer lengths than batch", lambda: sdpa(q, k, v, masks.padding(torch.tensor([7]))), ValueError,
     ["1 entries", "B = 2"]),
    ("prefix_lm per-batch wrong size", lambda: sdpa(q, k, v, masks.prefix_lm(torch.tensor([1, 2, 3]))), ValueError,
     ["prefix_len has 3 entries", "B = 2"]),
    ("prefix_lm negative", lambda: masks.prefix_lm(-1), ValueError, ["prefix_len", ">= 0", "-1"]),
    ("chunked zero", lambda: masks.local_chunks(0), ValueError, ["chunk size must be an int >= 1", "0"]),
    ("window float", lambda: masks.sliding_window(2.5), TypeError, ["window must be an int >= 1", "2.5", "float"]),
    ("softcap zero", lambda: mh_softcap(0.0), ValueError, ["softcap cap", "positive", "0.0"]),
    ("alibi slopes per head", lambda: sdpa(q, k, v, score_mod=mh_alibi(4)), ValueError,
     ["alibi has 4 slopes", "H = 8"]),
    ("scale numpy negative", lambda: sdpa(q, k, v, scale=np.float64(-0.5)), ValueError,
     ["scale must be a positive finite number", "-0.5"]),
    ("scale tensor zero", lambda: sdpa(q, k, v, scale=torch.tensor(0.0)), ValueError, ["scale", "positive", "0."]),
    ("scale vector", lambda: sdpa(q, k, v, scale=torch.ones(3)), ValueError, ["scale", "tensor of shape (3)"]),
    ("scale string", lambda: sdpa(q, k, v, scale="0.5"), TypeError, ["scale", "'0.5'", "str"]),
    # scalars at their limits, learned mods, double backward
    ("softcap cap infinite", lambda: mh_softcap(float("inf")), ValueError, ["softcap cap", "positive finite", "inf"]),
    ("softcap cap learned", lambda: mh_softcap(torch.tensor(30.0, requires_grad=True)), ValueError,
     ["softcap cap", "requires grad", "torch.tanh(s / cap)"]),
    ("window beyond int64 positions", lambda: masks.sliding_window(2**63), ValueError,
     ["window must be at most 2**62", "9223372036854775808"]),
    ("window 10**20", lambda: masks.sliding_window(10**20), ValueError,
     ["window", "100000000000000000000", "at most 2**62"]),
    ("chunk size huge", lambda: masks.local_chunks(2**64), ValueError, ["chunk size", "at most 2**62"]),
    ("prefix_len huge", lambda: masks.prefix_lm(10**20), ValueError, ["prefix_len", "100000000000000000000",
                                                                       "at most 2**62"]),
    ("tile_classes zero tile", lambda: masks.tile_classes(masks.causal(), 1, 1, 4, 4, 0, 2), ValueError,
     ["bq must be an int >= 1", "0"]),
    ("learned mod on tiles", lambda: sdpa(q, k, v, backend="tiles", score_mod=_learned_mod()), ValueError,
     ["score mod", "holds tensors that require grad", "backends that can: 'chunked', 'math'"]),
    ("unprobeable mod on tiles", lambda: sdpa(q, k, v, backend="tiles", score_mod=_unprobeable_mod), ValueError,
     ["raised on a probe", "backends that can: 'chunked', 'math'"]),
    ("double backward with sdpa dropout", lambda: _double_backward(backend="sdpa", dropout_p=0.1), ValueError,
     ["'sdpa' cannot differentiate twice", "dropout_p=0.1", "backends that can: 'tiles', 'math'"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_clear_error(case):
    _, fn, exc, needles = case
    with pytest.raises(exc) as info:
        fn()
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"message {message!r} lacks {needle!r}"


def _module_with_rope(**kw):
    return mh.Attention(16, 4, causal=True, rope=True, **kw)


MODULE_CASES = [
    ("positions float", lambda: _module_with_rope()(torch.randn(1, 3, 16), positions=torch.zeros(3)), TypeError,
     ["positions must be an integer tensor", "torch.float32"]),
    ("positions wrong length", lambda: _module_with_rope()(torch.randn(1, 3, 16), positions=torch.arange(4)),
     ValueError, ["positions must have shape (T,) = (3,)", "(4,)"]),
    ("positions and rotary", lambda: _module_with_rope()(torch.randn(1, 3, 16), positions=torch.arange(3),
                                                         rotary=(torch.ones(3, 2), torch.zeros(3, 2))),
     ValueError, ["positions= or rotary="]),
    ("positions without rope", lambda: _attn()(torch.randn(1, 3, 16), positions=torch.arange(3)), ValueError,
     ["no rotary embedding"]),
    ("window without causal", lambda: _attn(sliding_window=4), ValueError, ["causal window", "causal=True"]),
    ("window zero", lambda: _attn(causal=True, sliding_window=0), ValueError, ["sliding_window must be an int >= 1"]),
    ("softcap negative", lambda: _attn(softcap=-1.0), ValueError, ["softcap must be a positive finite number", "-1.0"]),
    ("rolling without window", lambda: _attn(causal=True).new_cache(1, rolling=True), ValueError,
     ["rolling=True needs a sliding-window layer"]),
    ("static cache without max_len", lambda: _attn().new_cache(1), ValueError, ["needs max_len"]),
    ("float64 x, float32 module", lambda: _attn()(torch.randn(1, 3, 16, dtype=torch.float64)), TypeError,
     ["x is torch.float64", "weights are torch.float32"]),
    ("mla float64 x", lambda: mh.LatentAttention(16, 4, 8)(torch.randn(1, 3, 16, dtype=torch.float64)), TypeError,
     ["x is torch.float64", "torch.float32"]),
]


@pytest.mark.parametrize("case", MODULE_CASES, ids=[c[0] for c in MODULE_CASES])
def test_bad_module_input_raises_clear_error(case):
    test_bad_input_raises_clear_error(case)


@pytest.mark.parametrize("case", CASES + MODULE_CASES, ids=[c[0] for c in CASES + MODULE_CASES])
def test_messages_are_one_line_from_our_boundary(case):
    """Each message is one line raised by multihead's own checks, not a torch internal error."""
    _, fn, exc, _ = case
    with pytest.raises(exc) as info:
        fn()
    assert "\n" not in str(info.value).strip(), f"multi-line message: {info.value!s}"
    origin = info.traceback[-1].path
    assert "multihead" in str(origin), f"raised from {origin}, not from multihead's checks"


@pytest.mark.parametrize("d_model", ["8", 8.0, True, 0, -1])
def test_module_and_plan_refuse_a_bad_size_alike(d_model):
    """`plan` describes the modules argument for argument, so one bad size is one mistake:
    the same exception type (TypeError for a wrong type, ValueError for a wrong value) and
    the same message from `Attention`, `LatentAttention`, `AttentionGeometry` and `LatentGeometry`."""
    from multihead import plan

    raised = []
    for build in (lambda: mh.Attention(d_model, 2), lambda: plan.AttentionGeometry(d_model, 2),
                  lambda: mh.LatentAttention(d_model, 2, 4), lambda: plan.LatentGeometry(d_model, 2, 4)):
        with pytest.raises((TypeError, ValueError)) as info:
            build()
        raised.append((type(info.value), str(info.value)))
    want = TypeError if isinstance(d_model, (str, float, bool)) else ValueError
    assert raised == [(want, raised[0][1])] * 4, raised
    assert raised[0][1].startswith(f"d_model must be an int >= 1; received {d_model!r}")
