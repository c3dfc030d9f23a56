"""Attention sinks (GPT-OSS: one extra logit per row in the softmax, with no value) through
`attend`, as a backend capability: equal to the softmax written out in float64 on every
backend that takes them, refused by name on the others, and empty at T = 0 through the
transformers registry as every other call of `attend` is."""

from __future__ import annotations

import pytest
import torch

from multihead import attend


def _qkv(B=2, H=4, Hkv=2, T=5, S=7, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, H, T, 8, generator=g, dtype=dtype), torch.randn(B, Hkv, S, 8, generator=g, dtype=dtype),
            torch.randn(B, Hkv, S, 6, generator=g, dtype=dtype))


def _written_out(q, k, v, allowed, sinks, scale):
    G = q.shape[1] // k.shape[1]
    s = (q @ k.repeat_interleave(G, 1).mT) * scale  # (B, H, T, S)
    s = s.masked_fill(~allowed, float("-inf"))
    logits = torch.cat([s, sinks.expand(*s.shape[:-1], 1)], -1)  # (B, H, T, S + 1)
    p = torch.softmax(logits, -1)[..., :-1]
    return p @ v.repeat_interleave(G, 1), p


@pytest.mark.parametrize("backend", ["auto", "math", "chunked"])
@pytest.mark.parametrize("per", ["head", "row"])
def test_sinks_equal_the_softmax_written_out(backend, per):
    q, k, v = _qkv()
    B, H, T, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    g = torch.Generator().manual_seed(1)
    sinks = torch.randn(H, generator=g, dtype=torch.float64) if per == "head" else \
        torch.randn(B, H, T, 1, generator=g, dtype=torch.float64)
    mask = torch.rand(B, 1, T, S, generator=g) > 0.3
    out, w = attend(q, k, v, mask, causal=True, scale=0.4, return_weights=True, backend=backend, sinks=sinks)
    allowed = mask & torch.ones(T, S, dtype=torch.bool).tril(S - T)
    want, pw = _written_out(q, k, v, allowed, sinks.view(1, H, 1, 1) if per == "head" else sinks, 0.4)
    assert (out - want).abs().max() < 1e-12 and (w - pw).abs().max() < 1e-12


def test_a_backend_without_sinks_is_refused_naming_those_that_take_them():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="backend 'sdpa' cannot take attention sinks; backends that can: 'math', "
                                         "'chunked'"):
        attend(q, k, v, backend="sdpa", sinks=torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"sinks must have shape \(H,\) = \(4,\)"):
        attend(q, k, v, sinks=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="sinks must be a tensor"):
        attend(q, k, v, sinks=[0.0] * 4)


def test_no_query_through_the_registry_with_sinks_is_empty_as_without():
    pytest.importorskip("transformers")
    from multihead.interop.hf import registry

    q, k, v = _qkv(T=0)
    module = torch.nn.Module()
    module.is_causal = True
    for sinks in (None, torch.zeros(4, dtype=torch.float64)):
        out, _ = registry.attention_forward(module, q, k, v, None, scaling=0.3, sinks=sinks)
        assert out.shape == (2, 0, 4, 6), (sinks, tuple(out.shape))  # (B, T, H, Dv)
