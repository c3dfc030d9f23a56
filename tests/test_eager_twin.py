"""`kernels.common.eager`, the formula written out once (fold the G query heads, scores,
masked softmax, values): the NumPy float64 reference equals it, and every engine equals it:
the backends in float64 over masks, GQA, causal with S > T and rows with nothing to attend;
flex in float32; ring attention on one rank (both block kernels, a key-padding mask and
causal); the decode step with its key split on and off; the stream's probabilities (their
entropy and first-token mass, with and without a sink)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from multihead import attend, reference
from multihead.inspect.rowstats import RowSums, TextContext
from multihead.inspect.stream import layer_statistics
from multihead.kernels import common, decode

EPS32 = torch.finfo(torch.float32).eps


def _case(B=2, H=4, Hkv=2, T=5, S=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, 6, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, S, 6, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, S, 3, generator=g, dtype=torch.float64)
    allowed = torch.rand(B, 1, T, S, generator=g) > 0.4
    allowed[0, 0, 1] = False  # a row with nothing to attend
    return q, k, v, allowed


@pytest.mark.parametrize("backend", ["math", "sdpa", "chunked", "tiles"])
@pytest.mark.parametrize("causal", [False, True])
def test_every_backend_equals_the_eager_twin(backend, causal):
    q, k, v, allowed = _case()
    T, S = q.shape[2], k.shape[2]
    if causal:
        allowed = allowed & torch.ones(T, S, dtype=torch.bool).tril(S - T)
    want, probs = common.eager(q, k, v, 0.5, allowed)
    out, w = attend(q, k, v, allowed, scale=0.5, return_weights=True, backend=backend)
    assert (out - want).abs().max() < 1e-10 and (w - probs).abs().max() < 1e-10
    assert bool((want[0, :, 1] == 0).all()), "a row with nothing to attend is zeros"


def test_the_eager_twin_equals_the_numpy_reference():
    q, k, v, allowed = _case()
    allowed[0, 0, 1] = True  # the reference's empty row is NaN (the textbook's); the kernel's 0
    want, wants = reference.attention(q.numpy(), k.numpy(), v.numpy(), mask=allowed.numpy(), scale=0.5,
                                      return_weights=True)
    out, probs = common.eager(q, k, v, 0.5, allowed)
    assert np.abs(out.numpy() - want).max() < 1e-10 and np.abs(probs.numpy() - wants).max() < 1e-10


@pytest.mark.slow  # torch.compile: ~20 s on a CPU (as every compiling test in test_flex.py)
def test_flex_equals_the_eager_twin():
    """flex on the CPU takes float32: the twin in float64 of the same inputs. The bound: float32
    scores carry a relative rounding of a few eps, which moves each probability by a few eps
    times the largest score, and the output by that times the largest value (x 8 for the sums)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v, allowed = _case()
    want, _ = common.eager(q, k, v, 0.5, allowed)
    out, _ = attend(q.float(), k.float(), v.float(), allowed, scale=0.5, backend="flex")
    scores = common.fold_scores(q, k, 0.5).abs().max().item()
    bound = 8 * EPS32 * (1 + scores) * v.abs().max().item()
    err = (out.double() - want).abs().max().item()
    assert err < bound, f"flex vs eager: max diff {err:.3g}, bound {bound:.3g}"


@pytest.fixture
def one_rank():
    """A one-rank gloo world in this process (a hash store: no port), torn down afterwards."""
    if not dist.is_available() or not dist.is_gloo_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed with gloo and no process group already set up")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("kernel", ["flash", "explicit"])
def test_ring_attention_on_one_rank_equals_the_eager_twin(one_rank, kernel):
    """Both block kernels of ring attention (the fused CPU one needs D == Dv): a key-padding
    mask with a batch row of no keys (zeros), and causal self-attention."""
    from multihead.distributed import ring_attention

    if kernel == "flash" and not common.HAS_CPU_FLASH:
        pytest.skip("this torch has no CPU flash kernel with its lse")
    q, k, v, _ = _case()
    v = torch.randn(2, 2, 8, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    keep = torch.rand(2, 8, generator=torch.Generator().manual_seed(2)) > 0.3
    keep[1] = False
    out = ring_attention(q, k, v, scale=0.5, mask=keep, _kernel=kernel)
    want, _ = common.eager(q, k, v, 0.5, keep[:, None, None])
    assert (out - want).abs().max() < 1e-12 and bool((out[1] == 0).all())
    qs, ks, vs = q[:, :, :5], k[:, :, :5], v[:, :, :5]
    out = ring_attention(qs, ks, vs, scale=0.5, causal=True, _kernel=kernel)
    want, _ = common.eager(qs, ks, vs, 0.5, torch.ones(5, 5, dtype=torch.bool).tril())
    assert (out - want).abs().max() < 1e-12


@pytest.mark.parametrize("parts", [1, 2, 3])
@pytest.mark.parametrize("S", [40, 41])
def test_the_decode_step_equals_the_eager_twin(parts, S):
    """One query (GQA, float64) over S keys: the plain step (parts 1) and the key split in 2
    parts (merged by `common.merge_two`) and 3 (the stacked merge), for an even and odd S."""
    if parts > 1 and not common.HAS_CPU_FLASH:
        pytest.skip("this torch has no CPU flash kernel with its lse")
    g = torch.Generator().manual_seed(S)
    q = torch.randn(1, 6, 1, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, S, 16, generator=g, dtype=torch.float64) for _ in range(2))
    want, _ = common.eager(q, k, v, 0.25)
    if parts == 1:
        out, _ = decode.step(q, k, v, 0.25, causal=True)  # one thread or not worth splitting: sdpa's plain call
    else:
        out, _ = decode.split_keys(q, k, v, 0.25, parts)
    assert (out - want).abs().max() < 1e-12


@pytest.mark.parametrize("sink", [False, True])
def test_the_stream_equals_the_eager_twin(sink):
    """`inspect`'s streamed statistics (the probabilities block by block, float64) equal those of
    the twin's probabilities: each head's mean entropy and first-token mass over a window mask.
    The bound: `RowSums.result` is float32, one rounding of a float64 sum (eps32 x its size)."""
    T, H, Hkv, D = 60, 4, 2, 8
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, H, T, D, generator=g, dtype=torch.float64) * 2
    k = torch.randn(1, Hkv, T, D, generator=g, dtype=torch.float64) * 2
    sinks = torch.randn(1, H, 1, 1, generator=g, dtype=torch.float64) if sink else None
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = ((j <= i) & (j > i - 12))[None, None]
    ids = torch.randint(0, 20, (T,), generator=g)
    acc = RowSums(H, TextContext(ids=ids, plain=torch.ones(T, dtype=torch.bool), delimiter=ids == 3, causal=True))
    layer_statistics(q, k, acc, list(range(H)), mask=allowed, scale=D ** -0.5, sinks=sinks, block_elements=500)
    got = acc.result()
    _, probs = common.eager(q, k, torch.zeros(1, Hkv, T, 1, dtype=torch.float64), D ** -0.5, allowed, sinks=sinks)
    p = probs[0]  # (H, T, S)
    entropy = -(p * torch.log(torch.where(p > 0, p, 1.0))).sum(-1).mean(-1)
    for name, want in (("entropy", entropy), ("first_token_mass", p[..., 0].mean(-1))):
        err, bound = (got[name] - want).abs().max().item(), EPS32 * max(1.0, want.abs().max().item())
        assert err < bound, f"stream {name} vs eager: max diff {err:.3g}, bound {bound:.3g}"
