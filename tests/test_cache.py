"""multihead.cache: state rules (a failed call leaves the cache as it was, reset drops the
autograd graph, deepcopy copies values) and the rolling sliding-window cache against the
full forward and the NumPy reference."""

import copy

import numpy as np
import pytest
import torch

import multihead as mh
from conftest import assert_close
from multihead import masks
from multihead import reference as R
from multihead.cache import RollingKVCache


def _snapshot(cache):
    """The length and a copy of every tensor the cache holds (its buffers and its position)."""
    return cache.length, {n: t.detach().clone() for n, t in vars(cache).items() if isinstance(t, torch.Tensor)}


def _assert_unchanged(cache, snap):
    length, tensors = snap
    assert cache.length == length == int(cache.position)
    assert {"position", "k", "v"} <= set(tensors) or {"position", "buf"} <= set(tensors), sorted(tensors)
    for name, old in tensors.items():
        assert torch.equal(getattr(cache, name), old), f"cache.{name} changed by a call that raised"


BAD_CALLS = {
    "bad mask shape": dict(mask=torch.ones(5, 7, dtype=torch.bool)),
    "integer mask": dict(mask=torch.ones(1, 1, 1, 4, dtype=torch.int64)),
    "bad head index": dict(return_weights=[99]),
    "mask on a 3-D form": dict(mask=torch.ones(2, 1, 4, dtype=torch.bool)),
}


@pytest.mark.parametrize("bad", list(BAD_CALLS), ids=list(BAD_CALLS))
@pytest.mark.parametrize("module", ["gqa-rope", "sliding", "mla"])
def test_a_call_that_raises_leaves_the_cache_as_it_was(bad, module):
    torch.manual_seed(1)
    if module == "mla":
        attn = mh.LatentAttention(16, 4, 6, rope_dim=4, causal=True).double()
    elif module == "sliding":
        attn = mh.Attention(16, 4, 2, causal=True, sliding_window=3, rope=True).double()
    else:
        attn = mh.Attention(16, 4, 2, causal=True, rope=True).double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    cache = attn.new_cache(2, 8)
    attn(x[:, :3], cache=cache)
    snap = _snapshot(cache)
    with pytest.raises((ValueError, TypeError)):
        attn(x[:, 3:4], cache=cache, **BAD_CALLS[bad])
    _assert_unchanged(cache, snap)
    # the corrected retry gives exactly the answer of a cache that never saw the failure
    steps = [attn(x[:, t : t + 1], cache=cache) for t in range(3, 6)]
    assert_close(torch.cat(steps, 1), attn(x)[:, 3:], what=f"{module}: decode after a failed call")


def test_restore_puts_back_the_overwritten_slots_of_a_rolling_cache():
    cache = RollingKVCache(1, 1, 3, 2)
    for t in range(5):  # wraps around: slots hold tokens 2, 3, 4
        cache.update(torch.full((1, 1, 1, 2), float(t)), torch.full((1, 1, 1, 2), -float(t)))
    snap = _snapshot(cache)
    mark = cache.checkpoint(2)
    cache.update(torch.full((1, 1, 2, 2), 9.0), torch.full((1, 1, 2, 2), 9.0))
    assert not torch.equal(cache.k, snap[1]["k"])
    cache.restore(mark)
    _assert_unchanged(cache, snap)


@pytest.mark.parametrize("make", [lambda: mh.KVCache(1, 2, 6, 3), lambda: RollingKVCache(1, 2, 3, 3),
                                  lambda: mh.LatentCache(1, 6, 3, 2)], ids=["static", "rolling", "latent"])
def test_a_checkpoint_block_undoes_its_writes_only_when_it_raises(make):
    cache = make()

    def write(t):
        if isinstance(cache, mh.LatentCache):
            return cache.update(torch.randn(1, t, 5))
        return cache.update(torch.randn(1, 2, t, 3), torch.randn(1, 2, t, 3))

    write(2)
    snap = _snapshot(cache)
    with pytest.raises(RuntimeError, match="after the write"):
        with cache.checkpoint(2):
            write(2)
            raise RuntimeError("after the write")
    _assert_unchanged(cache, snap)
    with cache.checkpoint(1):
        write(1)
    changed = [n for n, t in _snapshot(cache)[1].items() if n != "position" and not torch.equal(t, snap[1][n])]
    assert cache.length == 3 and changed


def test_reset_drops_the_graph_and_deepcopy_copies_values():
    attn = mh.Attention(16, 4, 2, causal=True, rope=True)
    cache = attn.new_cache(1, 8)
    x = torch.randn(1, 4, 16)
    attn(x, cache=cache).sum().backward()
    assert cache.k.grad_fn is not None  # within a sequence the graph is kept (documented)
    mid = copy.deepcopy(cache)  # values, not the graph
    assert mid.k.grad_fn is None and mid.length == 4 and torch.equal(mid.k, cache.k.detach())
    cache.reset()
    assert cache.length == 0 and cache.k.grad_fn is None and cache.v.grad_fn is None
    assert not cache.k.requires_grad
    copy.deepcopy(cache)


def test_backward_from_the_latest_cached_step_equals_the_full_forward():
    """Under grad the cache keeps the graph of every write, so the latest step's output
    backpropagates into every earlier token's projections, exactly as the full forward."""
    torch.manual_seed(2)
    attn = mh.Attention(16, 4, 2, causal=True, rope=True).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    attn(x)[:, -1].square().sum().backward()
    full = [p.grad.clone() for p in attn.parameters()]
    attn.zero_grad()
    cache = attn.new_cache(2, 5)
    attn(x[:, :3], cache=cache)
    attn(x[:, 3:4], cache=cache)
    attn(x[:, 4:5], cache=cache).square().sum().backward()
    for g_full, p in zip(full, attn.parameters()):
        assert_close(p.grad, g_full, what="grad through cache")


def _windowed_reference(attn, x, W):
    T = x.shape[1]
    allowed = masks.sliding_window(W).to_dense(1, 1, T, T).numpy()
    w = lambda lin: lin.weight.detach().double().numpy().T  # noqa: E731
    b = lambda lin: lin.bias.detach().double().numpy()  # noqa: E731
    return R.gqa_forward(x.double().numpy(), w(attn.q_proj), w(attn.k_proj), w(attn.v_proj), w(attn.o_proj),
                         attn.n_heads, attn.n_kv_heads, mask=allowed, b_q=b(attn.q_proj), b_k=b(attn.k_proj),
                         b_v=b(attn.v_proj), b_o=b(attn.o_proj))


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("W", [1, 3, 5])
def test_sliding_window_module_equals_the_reference(heads, W):
    attn = mh.Attention(16, *heads, causal=True, sliding_window=W).double()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    assert_close(attn(x), _windowed_reference(attn, x, W), what=f"sliding_window={W}")


@pytest.mark.parametrize("rope", [None, True])
@pytest.mark.parametrize("chunks", [[1] * 13, [5, 1, 1, 4, 1, 1], [7, 6], [2, 2, 2, 2, 2, 2, 1]])
def test_rolling_cache_decode_equals_full_windowed_forward(rope, chunks):
    """Token by token (and in chunks longer than the window) past several wrap-arounds."""
    W = 4
    attn = mh.Attention(16, 4, 2, causal=True, sliding_window=W, rope=rope).double()
    x = torch.randn(2, sum(chunks), 16, dtype=torch.float64)
    cache = attn.new_cache(2)
    assert isinstance(cache, RollingKVCache) and cache.window == W
    assert cache.nbytes == 2 * (2 * 2 * W * 4) * 8  # k and v: B * Hkv * W * D float64, whatever the length
    outs, t = [], 0
    for n in chunks:
        outs.append(attn(x[:, t : t + n], cache=cache))
        t += n
    assert cache.length == t
    assert_close(torch.cat(outs, 1), attn(x), what="rolling cache vs full windowed forward")
    if rope is None:
        assert_close(torch.cat(outs, 1), _windowed_reference(attn, x, W), what="rolling cache vs reference")


def test_static_cache_on_a_sliding_window_layer_still_works():
    attn = mh.Attention(16, 4, causal=True, sliding_window=3).double()
    x = torch.randn(1, 7, 16, dtype=torch.float64)
    cache = attn.new_cache(1, 7, rolling=False)
    out = torch.cat([attn(x[:, t : t + 1], cache=cache) for t in range(7)], 1)
    assert_close(out, attn(x))


def test_cache_length_needs_no_device_read():
    """The eager length is a Python int kept beside the tensor (no sync per layer per step)."""
    cache = mh.KVCache(1, 1, 8, 2)
    cache.update(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))
    cache.position.fill_(99)  # were length read from the tensor, it would say 99
    assert cache.length == 3


def test_positions_equal_a_numpy_rope_reference():
    """Explicit per-batch positions (non-contiguous) against RoPE written in NumPy."""
    attn = mh.Attention(16, 4, 2, causal=True, rope=True).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    pos = torch.tensor([[0, 1, 2, 10, 11], [3, 4, 5, 6, 7]])
    out = attn(x, positions=pos)

    def rope_np(a, p):  # half-split pairing (f, f + D/2), angle p / 10000^(2f/D)
        D = a.shape[-1]
        inv = 1.0 / 10000.0 ** (np.arange(0, D, 2) / D)
        ang = p[:, None, :, None] * inv  # (B, 1, T, D/2)
        a1, a2 = a[..., : D // 2], a[..., D // 2 :]
        return np.concatenate([a1 * np.cos(ang) - a2 * np.sin(ang), a1 * np.sin(ang) + a2 * np.cos(ang)], -1)

    with torch.no_grad():
        q = attn.q_proj(x).view(2, 5, 4, 4).transpose(1, 2).numpy()
        k = attn.k_proj(x).view(2, 5, 2, 4).transpose(1, 2).numpy()
        v = attn.v_proj(x).view(2, 5, 2, 4).transpose(1, 2).numpy()
    heads = R.attention(rope_np(q, pos.numpy()), rope_np(k, pos.numpy()), v, causal=True)
    ref = R.combine_heads(heads) @ attn.o_proj.weight.detach().numpy().T + attn.o_proj.bias.detach().numpy()
    assert_close(out, ref, what="positions=")
    # rotary=(cos, sin) with the same angles gives the same output
    cos, sin = attn.rope.cos_sin(pos.reshape(-1))
    rot = (cos.view(2, 1, 5, -1), sin.view(2, 1, 5, -1))
    assert_close(attn(x, rotary=rot), out, what="rotary=")


def test_default_positions_continue_from_the_cache():
    attn = mh.Attention(16, 4, causal=True, rope=True).double()
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    assert_close(attn(x, positions=torch.arange(6)), attn(x))


@pytest.mark.parametrize("shape", [(2, 0), (0, 3)], ids=["T=0", "B=0"])
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_empty_inputs_give_empty_outputs_and_leave_the_cache(shape, kind):
    """B = 0 or T = 0: an empty output of the right shape, the same way in both modules."""
    if kind == "mla":
        attn = mh.LatentAttention(16, 4, 6, rope_dim=4, causal=True)
    else:
        attn = mh.Attention(16, 4, 2, causal=True, rope=True)
    B, T = shape
    out, w = attn(torch.randn(B, T, 16), return_weights=True)
    assert out.shape == (B, T, 16) and w.shape == (B, 4, T, T)
    if B:
        cache = attn.new_cache(B, 4)
        attn(torch.randn(B, 2, 16), cache=cache)
        out, w = attn(torch.randn(B, 0, 16), cache=cache, return_weights=[1])
        assert out.shape == (B, 0, 16) and w.shape == (B, 1, 0, 2) and cache.length == 2


def test_cache_holds_kv_heads_not_query_heads_and_counts_bytes():
    attn = mh.Attention(512, 8, 2)
    cache = attn.new_cache(3, 100, dtype=torch.bfloat16)
    assert cache.k.shape == (3, 2, 100, 64)
    assert cache.nbytes == 2 * 3 * 2 * 100 * 64 * 2
    assert cache.max_len == 100 and cache.length == 0


def test_cache_update_returns_all_tokens_and_reset():
    cache = mh.KVCache(1, 2, 5, 3)
    k1, v1 = torch.randn(1, 2, 2, 3), torch.randn(1, 2, 2, 3)
    k2, v2 = torch.randn(1, 2, 1, 3), torch.randn(1, 2, 1, 3)
    cache.update(k1, v1)
    ka, va = cache.update(k2, v2)
    assert torch.equal(ka, torch.cat([k1, k2], 2)) and torch.equal(va, torch.cat([v1, v2], 2))
    assert cache.length == 3
    cache.reset()
    assert cache.length == 0
    assert torch.equal(cache.update(k2, v2)[0], k2)


def test_static_update_matches_eager_update():
    a, b = mh.KVCache(1, 2, 6, 3), mh.KVCache(1, 2, 6, 3)
    for t in (2, 1, 3):
        k, v = torch.randn(1, 2, t, 3), torch.randn(1, 2, t, 3)
        ka, _ = a.update(k, v)
        kb, _ = b.update(k, v, static=True)
        assert torch.equal(kb[:, :, : a.length], ka)
    assert a.length == b.length == 6


def test_one_token_steps_over_a_rolling_cache_take_the_slots_unordered(monkeypatch):
    """T = 1 over a rolling cache: every cached key is visible, so the kernel gets the W slots
    as they lie (no copy into chronological order, no mask) and the step equals both the
    chronological path (forced with a redundant mask) and the full windowed forward."""
    W = 4
    attn = mh.Attention(16, 4, 2, causal=True, sliding_window=W, rope=True, softcap=3.0).double()
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    seen = []
    # the layer reports neither the keys nor the mask of a step: a spy on its kernel call records them
    real = attn._attend

    def spy(q, k, v, mask, **kw):
        seen.append((k.shape[2], mask))
        return real(q, k, v, mask, **kw)

    monkeypatch.setattr(attn, "_attend", spy)  # records (keys, mask) of each step
    fast, slow = attn.new_cache(2), attn.new_cache(2)
    outs_fast = [attn(x[:, t:t + 1], cache=fast) for t in range(11)]
    assert [s for s, _ in seen] == [1, 2, 3, 4, 4, 4, 4, 4, 4, 4, 4] and all(m is None for _, m in seen)
    outs_slow = [attn(x[:, t:t + 1], cache=slow, mask=masks.causal()) for t in range(11)]
    assert all(m is not None for _, m in seen[11:])  # the chronological path, with the window predicate
    assert_close(torch.cat(outs_fast, 1), torch.cat(outs_slow, 1), what="unordered slots vs chronological")
    assert_close(torch.cat(outs_fast, 1), attn(x), what="unordered slots vs full forward")


def test_rolling_steps_that_need_order_keep_it():
    """ALiBi (scores depend on the distance) and weights (read per key) decode chronologically:
    equal to the full windowed forward, weights included."""
    W = 3
    attn = mh.Attention(16, 4, causal=True, sliding_window=W, alibi=True).double()
    x = torch.randn(1, 8, 16, dtype=torch.float64)
    cache = attn.new_cache(1)
    outs = [attn(x[:, t:t + 1], cache=cache) for t in range(8)]
    assert_close(torch.cat(outs, 1), attn(x), what="alibi, rolling cache")
    plain = mh.Attention(16, 4, causal=True, sliding_window=W).double()
    full, full_w = plain(x, return_weights=True)  # (1, 4, 8, 8)
    cache = plain.new_cache(1)
    for t in range(8):
        out, w = plain(x[:, t:t + 1], cache=cache, return_weights=True)  # keys: the last min(t + 1, W) in order
        assert_close(out, full[:, t:t + 1], what=f"step {t}")
        assert_close(w[:, :, 0], full_w[:, :, t, max(0, t - W + 1):t + 1], what=f"weights step {t}")


# ------------------------------------------------- a cache must fit the layer it serves


@pytest.mark.parametrize("layer_window, cache_window", [(4, 8), (4, 2), (None, 4)])
def test_a_rolling_cache_that_does_not_fit_the_layer_is_refused(layer_window, cache_window):
    """A rolling cache of another window (or on a full causal layer) would drop keys the layer
    still sees, or keep keys it must not see: refused before anything is written, naming both."""
    attn = mh.Attention(16, 4, 2, causal=True, sliding_window=layer_window).double()
    cache = RollingKVCache(1, 2, cache_window, 4, dtype=torch.float64)
    x = torch.randn(1, 9, 16, dtype=torch.float64)
    snap = _snapshot(cache)
    for chunk in (x[:, :1], x[:, :5]):  # the one-token path and the chronological path
        with pytest.raises(ValueError, match=rf"window {cache_window}.*sliding_window={layer_window}"):
            attn(chunk, cache=cache)
        _assert_unchanged(cache, snap)


def test_the_default_cache_of_a_windowed_layer_fits_it_and_decodes_right():
    attn = mh.Attention(16, 4, 2, causal=True, sliding_window=4).double()
    x = torch.randn(1, 9, 16, dtype=torch.float64)
    cache = attn.new_cache(1)
    outs = [attn(x[:, t:t + 1], cache=cache) for t in range(9)]
    assert_close(torch.cat(outs, 1), attn(x), what="rolling cache of the layer's own window")


@pytest.mark.parametrize("max_len, kind, slots", [(5, mh.KVCache, 5), (8, mh.KVCache, 8), (16, RollingKVCache, 8)])
def test_new_cache_on_a_windowed_layer_holds_min_of_window_and_max_len(max_len, kind, slots):
    """sliding_window=8 with max_len=5 needs 5 slots, not 8 (32768 vs 512 on a real model):
    a static cache of max_len (nothing ever leaves the window), else W rolling slots."""
    attn = mh.Attention(16, 4, 2, causal=True, sliding_window=8).double()
    cache = attn.new_cache(1, max_len)
    assert type(cache) is kind and cache.k.shape[2] == slots
    x = torch.randn(1, max_len, 16, dtype=torch.float64)
    outs = [attn(x[:, t:t + 1], cache=cache) for t in range(max_len)]
    assert_close(torch.cat(outs, 1), attn(x), what=f"max_len={max_len}")


def test_new_cache_on_a_huge_window_allocates_max_len_slots():
    attn = mh.Attention(64, 8, 1, causal=True, sliding_window=32768)
    cache = attn.new_cache(1, 512)
    assert cache.k.shape[2] == 512 and cache.nbytes == 2 * 512 * 8 * 4


@pytest.mark.parametrize("S", [3, 4, 7])
@pytest.mark.parametrize("first_T", [1, 2])
def test_cross_attention_on_a_windowed_layer_with_its_default_cache(S, first_T):
    """Cross-attention needs the whole context, whatever the layer's window: the default cache
    of a windowed layer holds it all (the context is not a stream to roll over), and every step
    equals the no-cache forward."""
    attn = mh.Attention(16, 4, 2, causal=True, sliding_window=3).double()
    x, ctx = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, S, 16, dtype=torch.float64)
    cache = attn.new_cache(2)
    bounds = [0, first_T, first_T + 2, 5]  # a first chunk, two queries at once, then the rest
    outs = [attn(x[:, a:b], ctx, cache=cache) for a, b in zip(bounds, bounds[1:])]
    expected = [attn(x[:, a:b], ctx) for a, b in zip(bounds, bounds[1:])]
    assert cache.length == S
    assert_close(torch.cat(outs, 1), torch.cat(expected, 1), what=f"cross-attention, S={S}, window 3")
    cache.reset()  # back to a rolling cache of the layer's window, for self-attention
    assert cache.k.shape[2] == 3
    steps = [attn(x[:, t:t + 1], cache=cache) for t in range(5)]
    assert_close(torch.cat(steps, 1), attn(x), what="self-attention after reset")


def test_a_cross_attention_cache_refuses_another_context_and_self_attention():
    attn = mh.Attention(16, 4, 2, causal=True, sliding_window=3).double()
    x, ctx = torch.randn(1, 2, 16, dtype=torch.float64), torch.randn(1, 7, 16, dtype=torch.float64)
    cache = attn.new_cache(1)
    with pytest.raises(ValueError):  # a bad mask on the first call: nothing is kept
        attn(x, ctx, cache=cache, mask=torch.ones(5, 7, dtype=torch.bool))
    assert cache.length == 0 and cache.k.shape[2] == 3
    attn(x, ctx, cache=cache)
    with pytest.raises(ValueError, match=r"context of 7 tokens; received a context of 5"):
        attn(x, ctx[:, :5], cache=cache)
    with pytest.raises(ValueError, match=r"holds a cross-attention context"):
        attn(x, cache=cache)


def test_cross_attention_with_a_too_small_static_cache_is_refused_by_name():
    attn = mh.Attention(16, 4, 2, context_dim=12).double()
    x, ctx = torch.randn(1, 1, 16, dtype=torch.float64), torch.randn(1, 7, 12, dtype=torch.float64)
    cache = attn.new_cache(1, 4)
    with pytest.raises(ValueError, match=r"context.*7.*max_len 4"):
        attn(x, ctx, cache=cache)
    assert cache.length == 0
