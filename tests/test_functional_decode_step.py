"""`functional.decode_step`: attend's plain decode step for a caller that knows nothing else
is asked (the HF attention function's decode step). It equals `attend` bit for bit where it
answers, keeps the NaN rule, and answers None wherever `attend` would do something else
(more than one query, an empty dim, a shape or dtype attend names), so that the caller's
fallback to `attend` gives the answer or the error."""

from __future__ import annotations

import pytest
import torch

from multihead.functional import attend, decode_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _qkv(B=1, H=8, Hkv=2, T=1, S=40, D=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g).to(dtype) for shape in ((B, H, T, D), (B, Hkv, S, D), (B, Hkv, S, D)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("H, Hkv, B", [(8, 2, 1), (4, 1, 2), (6, 6, 1)])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_equals_attend_bit_for_bit(dtype, H, Hkv, B, scale):
    q, k, v = _qkv(B=B, H=H, Hkv=Hkv, dtype=dtype)
    out = decode_step(q, k, v, scale)
    assert out is not None
    assert torch.equal(out, attend(q, k, v, scale=scale)[0])


@pytest.mark.parametrize("where", ["query", "key"])
def test_the_nan_rule_holds(where):
    q, k, v = _qkv()
    (q if where == "query" else k)[0, 1, 0 if where == "query" else 7, 3] = float("nan")
    out = decode_step(q, k, v)
    want = attend(q, k, v)[0]
    assert torch.equal(torch.isnan(out), torch.isnan(want)) and torch.isnan(out).any()
    assert torch.equal(out.nan_to_num(), want.nan_to_num())


def test_none_where_attend_does_something_else():
    q, k, v = _qkv()
    assert decode_step(*_qkv(T=3)) is None  # a prefill: attend's own path (causality, checks)
    assert decode_step(q, k[:, :, :0], v[:, :, :0]) is None  # no key: attend's empty problem
    assert decode_step(q, k.double(), v) is None  # mixed dtypes: attend names them
    assert decode_step(q[0], k, v) is None  # 3-D: attend names the shape
    assert decode_step(torch.randn(1, 7, 1, 16), k, v) is None  # 7 heads over 2 K/V heads
    with pytest.raises(ValueError, match="divisible|multiple"):
        attend(torch.randn(1, 7, 1, 16), k, v)  # ... which attend refuses by name


def test_the_hf_decode_step_takes_it_and_counts_once(monkeypatch):
    """The HF attention function's decode step runs through `decode_step` (not `attend`) on
    "auto" without dropout, and through `attend` with dropout, with the same answer."""
    pytest.importorskip("transformers")
    import multihead.functional as functional
    from multihead.interop.hf import attention_forward, registry

    class Layer(torch.nn.Module):
        is_causal = True

    seen = []
    real_step, real_attend = functional.decode_step, registry.attend
    monkeypatch.setattr(functional, "decode_step", lambda *a: seen.append("decode_step") or real_step(*a))
    monkeypatch.setattr(registry, "attend", lambda *a, **k: seen.append("attend") or real_attend(*a, **k))
    q, k, v = _qkv()
    out, _ = attention_forward(Layer(), q, k, v, None, scaling=0.25)
    assert seen == ["decode_step"]
    assert torch.equal(out.transpose(1, 2), attend(q, k, v, scale=0.25)[0])
    seen.clear()
    torch.manual_seed(0)
    attention_forward(Layer(), q, k, v, None, scaling=0.25, dropout=0.1)
    assert seen == ["attend"]  # dropout: attend's own path
