"""Issue 18 (reliability, round 3), the kernel-side classes: every one of these failed before
its fix. Numbers are held against the float64 NumPy reference or the float64 math path."""

import numpy as np
import pytest
import torch

import multihead as mh
from conftest import assert_close
from multihead import masks, score_mods
from multihead import reference as R

sdpa = mh.scaled_dot_product_attention


def _qkv(B=1, H=2, Hkv=2, T=6, S=7, D=8, Dv=8, dtype=torch.float64, seed=0, grad=False, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(B, n, L, d, generator=g, dtype=torch.float64) for n, L, d in
           ((H, T, D), (Hkv, S, D), (Hkv, S, Dv))]
    out[0] = out[0] * spread
    return [x.to(dtype).requires_grad_(grad) for x in out]


# ------------------------------------------------------------ softcap at the edges


@pytest.mark.parametrize("cap", [1e-40, 1e-6, 0.5, 50.0, 1e4, 1e30, 3e38])
@pytest.mark.parametrize("backend", ["tiles", "math", "auto"])
def test_softcap_accurate_for_any_cap_float32(cap, backend):
    """cap * tanh(s / cap) on float32: the fast sigmoid form cancels for large caps (1e30 gave a
    uniform attention, 1e4 erred 6.7e-4) and overflowed to NaN for tiny ones (1e-40)."""
    q, k, v = _qkv(T=40, S=45, spread=8.0)
    want = R.attention(q.numpy(), k.numpy(), v.numpy(), causal=True, softcap_cap=cap)
    got = sdpa(q.float(), k.float(), v.float(), causal=True, score_mod=score_mods.softcap(cap), backend=backend)
    assert_close(got, want, torch.float32, atol=2e-5, rtol=2e-5, what=f"softcap({cap:g}) {backend}")


@pytest.mark.parametrize("cap", [0.0, -1.0, float("inf"), float("nan"), "50", True])
def test_softcap_cap_range_is_validated(cap):
    with pytest.raises(ValueError, match="softcap cap must be a positive finite number"):
        score_mods.softcap(cap)


def test_softcap_refuses_a_cap_that_requires_grad():
    """A learned cap read with .item() would silently never train."""
    with pytest.raises(ValueError, match="requires grad"):
        score_mods.softcap(torch.tensor(30.0, requires_grad=True))


# ------------------------------------------------------- integers the predicates take

_HUGE = [2**62 + 1, 2**63, 10**20, np.uint64(2**63)]


@pytest.mark.parametrize("make", [masks.sliding_window, masks.chunked, masks.prefix_lm],
                         ids=["sliding_window", "chunked", "prefix_lm"])
@pytest.mark.parametrize("n", _HUGE, ids=str)
def test_predicate_integers_beyond_int64_positions_are_refused(make, n):
    """sliding_window(2**63) was accepted and overflowed (a wrong mask); 10**20 raised a bare
    OverflowError. Positions are int64: every int a predicate takes is checked against 2**62."""
    with pytest.raises(ValueError, match=r"2\*\*62"):
        make(n)


@pytest.mark.parametrize("make, same", [(masks.sliding_window, masks.causal()),
                                        (masks.prefix_lm, lambda b, h, q, kv: kv >= 0),
                                        (masks.chunked, lambda b, h, q, kv: kv >= 0)],
                         ids=["sliding_window", "prefix_lm", "chunked"])
def test_predicate_integers_up_to_the_bound_are_exact(make, same):
    """The largest value accepted still gives the right mask (a window past S is causal)."""
    got = masks.to_dense(make(2**62), 1, 1, 5, 6)
    want = masks.to_dense(same, 1, 1, 5, 6)
    assert torch.equal(got.expand(1, 1, 5, 6), want.expand(1, 1, 5, 6))


def test_tile_sizes_are_validated():
    with pytest.raises(ValueError, match="bq must be a positive int"):
        masks.tile_classes(masks.causal(), 1, 1, 4, 4, 0, 2)
    with pytest.raises(ValueError, match="bk must be a positive int"):
        masks.tile_classes(masks.causal(), 1, 1, 4, 4, 2, 2**63)
