"""Kernel edge cases found by hostile passes: each of these once failed. Numbers are held
against the float64 NumPy reference or the float64 math path."""

import functools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import multihead as mh
from conftest import assert_close
from multihead import masks, score_mods
from multihead import reference as R
from multihead.kernels import common, fused_tiles

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


@pytest.mark.parametrize("cap, error", [(0.0, ValueError), (-1.0, ValueError), (float("inf"), ValueError),
                                        (float("nan"), ValueError), ("50", TypeError), (True, TypeError)])
def test_softcap_cap_range_is_validated(cap, error):
    with pytest.raises(error, match="softcap cap must be a positive finite number"):
        score_mods.softcap(cap)


def test_softcap_refuses_a_cap_that_requires_grad():
    """A learned cap read with .item() would silently never train."""
    with pytest.raises(ValueError, match="requires grad"):
        score_mods.softcap(torch.tensor(30.0, requires_grad=True))


# ------------------------------------------------------- integers the predicates take

_HUGE = [2**62 + 1, 2**63, 10**20, np.uint64(2**63)]


@pytest.mark.parametrize("make", [masks.sliding_window, masks.local_chunks, masks.prefix_lm],
                         ids=["sliding_window", "chunked", "prefix_lm"])
@pytest.mark.parametrize("n", _HUGE, ids=str)
def test_predicate_integers_beyond_int64_positions_are_refused(make, n):
    """sliding_window(2**63) was accepted and overflowed (a wrong mask); 10**20 raised a bare
    OverflowError. Positions are int64: every int a predicate takes is checked against 2**62."""
    with pytest.raises(ValueError, match=r"2\*\*62"):
        make(n)


@pytest.mark.parametrize("make, same", [(masks.sliding_window, masks.causal()),
                                        (masks.prefix_lm, lambda b, h, q, kv: kv >= 0),
                                        (masks.local_chunks, lambda b, h, q, kv: kv >= 0)],
                         ids=["sliding_window", "prefix_lm", "chunked"])
def test_predicate_integers_up_to_the_bound_are_exact(make, same):
    """The largest value accepted still gives the right mask (a window past S is causal)."""
    got = masks.to_dense(make(2**62), 1, 1, 5, 6)
    want = masks.to_dense(same, 1, 1, 5, 6)
    assert torch.equal(got.expand(1, 1, 5, 6), want.expand(1, 1, 5, 6))


def test_tile_sizes_are_validated():
    with pytest.raises(ValueError, match="bq must be an int >= 1"):
        masks.tile_classes(masks.causal(), 1, 1, 4, 4, 0, 2)
    with pytest.raises(ValueError, match=r"bk must be at most 2\*\*62"):
        masks.tile_classes(masks.causal(), 1, 1, 4, 4, 2, 2**63)


# ------------------------------------------------------ no gradient silently lost

_BACKENDS = ["auto", "math", "chunked", "tiles", "sdpa"]


def _grads(out, inputs, seed=5):
    g_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    wanted = [x for x in inputs if x.requires_grad]
    return torch.autograd.grad(out, wanted, g_out, allow_unused=True)


def test_float_mask_with_dropout_on_the_cpu_auto_path_gets_its_gradient():
    """The issue's example: sdpa(q, k, v, bias, dropout_p=0.2) on the CPU auto path ran on the tile
    engine and left bias.grad None. Dropout seeded per call makes the forward a fixed function:
    gradcheck holds the bias gradient to the finite differences (GQA, a -inf hole, an empty row)."""
    q, k, v = _qkv(B=1, H=2, Hkv=1, T=5, S=6, D=3, Dv=2)
    bias = torch.randn(1, 2, 5, 6, dtype=torch.float64)
    bias[0, 0, 1, 2] = float("-inf")
    bias[0, 1, 3] = float("-inf")
    bias.requires_grad_()

    def f(bias, q):
        torch.manual_seed(3)
        return sdpa(q, k, v, bias, dropout_p=0.2)

    out = f(bias, q)
    out.sum().backward()
    assert bias.grad is not None and bias.grad.abs().sum() > 0
    assert torch.autograd.gradcheck(f, (bias, q.requires_grad_()))


@pytest.mark.parametrize("backend", _BACKENDS)
@pytest.mark.parametrize("mod", [None, "softcap", "alibi"])
@pytest.mark.parametrize("shape", [(1, 1, 9, 11), (2, 1, 9, 11), (1, 4, 1, 11)], ids=["TS", "BTS", "HS"])
def test_float_mask_gradient_equals_math_on_every_backend(backend, mod, shape):
    """A learned bias (T5's position bias) added to the scores, with a score mod or not, more than 8
    queries: its gradient (summed over the dims it broadcasts along) equals the math path's."""
    q, k, v = _qkv(B=2, H=4, Hkv=2, T=9, S=11, grad=True)
    bias = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    score_mod = {None: None, "softcap": score_mods.softcap(2.0), "alibi": score_mods.alibi(4)}[mod]
    want = _grads(sdpa(q, k, v, bias, causal=True, score_mod=score_mod, backend="math"), (q, k, v, bias))
    try:
        out = sdpa(q, k, v, bias, causal=True, score_mod=score_mod, backend=backend)
    except ValueError as e:  # a backend that cannot apply the mod says so, naming those that can
        assert backend == "sdpa" and mod == "softcap" and "'tiles'" in str(e)
        return
    got = _grads(out, (q, k, v, bias))
    for name, a, b in zip(["dq", "dk", "dv", "dbias"], got, want):
        assert a is not None, f"{name} lost on {backend}"
        assert_close(a, b, what=f"{name} {backend} {mod}")


def test_float_mask_gradient_through_the_predicate_planner():
    """A learned bias with an additive mod and a predicate on "sdpa" (the block-sparse LSE engine,
    whose backward has no mask gradient, gives way to autograd through the fused calls)."""
    q, k, v = _qkv(B=1, H=4, Hkv=2, T=40, S=40, grad=True)
    bias = torch.randn(1, 4, 40, 40, dtype=torch.float64, requires_grad=True)
    mod = score_mods.alibi(4)
    want = _grads(sdpa(q, k, v, bias, causal=True, score_mod=mod, backend="math"), (q, k, v, bias))
    got = _grads(sdpa(q, k, v, bias, causal=True, score_mod=mod, backend="sdpa"), (q, k, v, bias))
    for name, a, b in zip(["dq", "dk", "dv", "dbias"], got, want):
        assert_close(a, b, what=name)


def test_trainable_mod_that_the_old_probe_could_not_run_is_trained():
    """A mod that only runs on scores with the attention's heads: the one-element probe raised,
    so it counted as not trainable and ran on the tile engine, which dropped its gradient."""
    q, k, v = _qkv(B=1, H=2, Hkv=2, T=12, S=12, grad=True)
    w = torch.randn(2, dtype=torch.float64, requires_grad=True)

    def per_head(s, b, h, qi, kv):  # (B, 2, t, s) -> (B, 2, 1, t, s): a bias per head
        return (s.unflatten(1, (2, -1)) * w.view(1, 2, 1, 1, 1)).flatten(1, 2)

    want = _grads(sdpa(q, k, v, score_mod=per_head, backend="math"), (q, w))
    got = _grads(sdpa(q, k, v, score_mod=per_head), (q, w))
    assert_close(got[1], want[1], what="d w (auto)")
    for backend in ("tiles", "flex"):
        with pytest.raises(ValueError, match="backends that can: 'chunked', 'math'"):
            sdpa(q.float(), k.float(), v.float(), score_mod=per_head, backend=backend)


def _penalty(backend, q, k, v, **kw):
    """A gradient penalty (WGAN-GP style): |d out.sum() / d q|^2, differentiated again. out.sum()
    has a constant output gradient, the case where once_differentiable raised nothing and the
    second-order term was silently dropped."""
    out = sdpa(q, k, v, backend=backend, **kw)
    (g,) = torch.autograd.grad((out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum(), q,
                               create_graph=True)
    penalty = g.square().sum()
    return penalty, torch.autograd.grad(penalty, (q, k, v))


@pytest.mark.parametrize("backend", _BACKENDS)
@pytest.mark.parametrize("case", ["softcap", "plain", "causal-rectangular", "window", "alibi", "bias"])
def test_double_backward_equals_math_on_every_backend(backend, case):
    """Gradient penalty through attention: the tile engine gave 25.2 where math gave 257.2 (the
    second-order term dropped without a word); torch's fused kernels raise on it."""
    T, S = (12, 20) if case == "causal-rectangular" else (12, 12)
    q, k, v = _qkv(B=1, H=4, Hkv=2, T=T, S=S, grad=True, spread=3.0)
    kw = {"softcap": {"score_mod": score_mods.softcap(1.5), "causal": True},
          "plain": {},
          "causal-rectangular": {"causal": True},
          "window": {"mask": masks.sliding_window(5)},
          "alibi": {"score_mod": score_mods.alibi(4), "causal": True},
          "bias": {"mask": torch.randn(1, 4, T, S, dtype=torch.float64)}}[case]
    want, want_g = _penalty("math", q, k, v, **kw)
    try:
        got, got_g = _penalty(backend, q, k, v, **kw)
    except ValueError as e:
        assert backend == "sdpa" and case == "softcap" and "'tiles'" in str(e)
        return
    assert_close(got, want, what=f"penalty {backend}")
    for name, a, b in zip("qkv", got_g, want_g):
        assert_close(a, b, what=f"d penalty / d{name} {backend}")


def test_double_backward_of_a_learned_bias_and_with_dropout():
    """Second order through a float mask that requires grad (tiles, sdpa); with dropout the tile
    engine regenerates its keeps (gradcheck of the gradient: gradgradcheck), while torch's fused
    kernel, whose dropout cannot be redrawn, refuses by name."""
    q, k, v = _qkv(B=1, H=2, Hkv=1, T=4, S=5, D=3, Dv=2, grad=True)
    bias = torch.randn(1, 2, 4, 5, dtype=torch.float64, requires_grad=True)
    for backend in ("tiles", "sdpa", "auto"):
        def f(q, k, v, bias, backend=backend):
            return sdpa(q, k, v, bias, causal=True, backend=backend)

        assert torch.autograd.gradgradcheck(f, (q, k, v, bias)), backend

    def dropped(q, k, v, bias):
        torch.manual_seed(11)
        return sdpa(q, k, v, bias, dropout_p=0.3, backend="tiles", score_mod=score_mods.softcap(2.0))

    assert torch.autograd.gradgradcheck(dropped, (q, k, v, bias))
    out = sdpa(q, k, v, dropout_p=0.3, backend="sdpa")
    with pytest.raises(ValueError, match=r"cannot differentiate twice.*dropout.*'tiles', 'math'"):
        torch.autograd.grad(out.sum(), q, create_graph=True)


def test_double_backward_through_the_block_sparse_engines_directly():
    """The fused tiles' LSE engine and the explicit tiles: second order equals math's."""
    from multihead.kernels import explicit_tiles, fused_tiles

    q, k, v = _qkv(B=1, H=2, Hkv=1, T=30, S=30, grad=True)
    scale = 8 ** -0.5
    want, want_g = _penalty("math", q, k, v, mask=masks.sliding_window(7))
    for engine in (fused_tiles.fused, explicit_tiles.explicit):
        out = engine(q, k, v, masks.sliding_window(7), causal=False, scale=scale, dropout_p=0.0, tile=8)
        (g,) = torch.autograd.grad((out * torch.linspace(-1, 1, 8, dtype=out.dtype)).sum(), q, create_graph=True)
        got = g.square().sum()
        assert_close(got, want, what=engine.__name__)
        for name, a, b in zip("qkv", torch.autograd.grad(got, (q, k, v)), want_g):
            assert_close(a, b, what=f"{engine.__name__} d{name}")


def test_t5_relative_position_bias_trains_through_the_registry():
    """T5 in train() with attn_implementation="multihead": its relative attention bias reaches the
    kernel as a float mask that requires grad, with dropout on (the CPU tile engine): its gradient
    was None. A dropout of 1e-9 keeps every element (both sides), so the gradients of every
    parameter must equal eager's (float64)."""
    transformers = pytest.importorskip("transformers")
    import multihead.interop.hf  # noqa: F401  (registers "multihead")

    cfg = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, vocab_size=40,
               dropout_rate=1e-9, relative_attention_num_buckets=8)
    grads = {}
    for impl in ("eager", "multihead"):
        torch.manual_seed(0)
        model = transformers.T5Model(transformers.T5Config(**cfg, attn_implementation=impl)).double().train()
        ids = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(1))
        keep = torch.ones(2, 7, dtype=torch.long)
        keep[1, 5:] = 0
        out = model(input_ids=ids, attention_mask=keep, decoder_input_ids=ids[:, :5]).last_hidden_state
        out.square().sum().backward()
        grads[impl] = {n: p.grad for n, p in model.named_parameters()}
    bias = [n for n in grads["eager"] if "relative_attention_bias" in n]
    assert bias
    for n, g in grads["eager"].items():
        if g is None:
            continue
        assert grads["multihead"][n] is not None, f"{n}: gradient lost"
        assert_close(grads["multihead"][n], g, atol=1e-8, rtol=1e-8, what=n)


def test_sinks_gradient_through_the_registry_equals_a_written_out_softmax():
    """GPT-OSS sinks (a learned extra logit per head) with a learned bias and a softcap: the
    gradients of the sinks, the bias, q, k and v equal autograd through a plain float64 softmax."""
    pytest.importorskip("transformers")
    from multihead.interop.hf import registry

    q, k, v = _qkv(B=2, H=4, Hkv=2, T=6, S=6, grad=True)
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(2, 1, 6, 6, dtype=torch.float64, requires_grad=True)
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = registry.attention_forward(module, q, k, v, bias, scaling=0.3, softcap=2.0, sinks=sinks)
    got = _grads(out.transpose(1, 2), (q, k, v, sinks, bias))
    s = (q @ k.repeat_interleave(2, 1).mT) * 0.3
    s = torch.tanh(s / 2.0) * 2.0 + bias
    logits = torch.cat([s, sinks.view(1, 4, 1, 1).expand(2, 4, 6, 1)], -1)
    ref = torch.softmax(logits, -1)[..., :6] @ v.repeat_interleave(2, 1)
    want = _grads(ref, (q, k, v, sinks, bias))
    for name, a, b in zip(["dq", "dk", "dv", "dsinks", "dbias"], got, want):
        assert_close(a, b, what=name)


def _three_orders(out_fn, inputs, seed=5):
    """The gradient as is, under create_graph=True, and the gradient of a penalty (its sum of
    squares) for `out_fn()`: None for an input the call does not reach."""
    out = out_fn()
    g_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    plain = torch.autograd.grad(out, inputs, g_out, allow_unused=True)
    graph = torch.autograd.grad(out_fn(), inputs, g_out, create_graph=True, allow_unused=True)
    penalty = sum(g.square().sum() for g in graph if g is not None and g.requires_grad)
    second = torch.autograd.grad(penalty, inputs, allow_unused=True) if torch.is_tensor(penalty) \
        else [None] * len(inputs)
    return plain, graph, second


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 2), Hkv=st.integers(1, 2), G=st.sampled_from([1, 2]), T=st.integers(1, 20),
       S=st.integers(1, 20), causal=st.booleans(), mask=st.sampled_from(["none", "bias", "bias-B", "bool", "window"]),
       mod=st.sampled_from(["none", "softcap", "alibi-learned", "captured", "softcap+bias-learned"]),
       alias=st.sampled_from(["none", "q=k", "k=v", "q=k=v", "views"]), seed=st.integers(0, 2**16))
def test_property_every_input_that_requires_grad_gets_the_math_gradient(B, Hkv, G, T, S, causal, mask, mod, alias,
                                                                        seed):
    """Any backend either refuses by name or gives every input requiring grad (q, k, v, a float mask,
    ALiBi slopes, tensors a score mod captured) the math path's gradient, as is and under
    create_graph=True, and the math path's second-order gradient (of a gradient penalty), also
    when q, k, v alias: one tensor in two or three slots, or k and v views of q's heads."""
    if alias in ("q=k", "q=k=v"):
        G, S = 1, T  # q and k one tensor: as many heads and positions
    if alias == "views":
        S = T
    H = Hkv * G
    q, k, v = _qkv(B=B, H=H, Hkv=Hkv, T=T, S=S, D=4, Dv=3 if alias in ("none", "q=k") else 4, seed=seed,
                   grad=True)
    slots = {"none": lambda: (q, k, v), "q=k": lambda: (q, q, v), "k=v": lambda: (q, k, k),
             "q=k=v": lambda: (q, q, q), "views": lambda: (q, q[:, ::G], q[:, ::G])}[alias]
    leaves = {"none": [q, k, v], "q=k": [q, v], "k=v": [q, k], "q=k=v": [q], "views": [q]}[alias]
    g = torch.Generator().manual_seed(seed + 1)
    m = {"none": None, "bias": torch.randn(1, H, T, S, generator=g, dtype=torch.float64),
         "bias-B": torch.randn(B, 1, 1, S, generator=g, dtype=torch.float64),
         "bool": torch.rand(B, 1, T, S, generator=g) > 0.3, "window": masks.sliding_window(3)}[mask]
    if m is not None and not isinstance(m, masks.MaskMod) and m.is_floating_point():
        m.requires_grad_()
    learned = torch.rand(H, generator=g, dtype=torch.float64).requires_grad_()
    extra = [learned] if mod in ("alibi-learned", "captured", "softcap+bias-learned") else []
    cap = score_mods.softcap(2.5)
    score_mod = {"none": None, "softcap": cap, "alibi-learned": score_mods.alibi(learned),
                 "captured": lambda s, b, h, qi, kv: s * learned[h],
                 "softcap+bias-learned": lambda s, b, h, qi, kv: cap(s, b, h, qi, kv) + learned[h] * (kv - qi)}[mod]
    inputs = leaves + ([m] if isinstance(m, torch.Tensor) and m.requires_grad else []) + extra
    want = _three_orders(lambda: sdpa(*slots(), m, causal=causal, score_mod=score_mod, backend="math"), inputs)
    for backend in ("auto", "chunked", "tiles", "sdpa"):
        try:
            got = _three_orders(lambda b=backend: sdpa(*slots(), m, causal=causal, score_mod=score_mod, backend=b),
                                inputs)
        except ValueError as e:
            assert backend in ("tiles", "sdpa") and "backends that can" in str(e)
            continue
        for order, got_o, want_o in zip(("gradient", "create_graph gradient", "second-order gradient"), got, want):
            for i, (a, b) in enumerate(zip(got_o, want_o)):
                if b is None:
                    assert a is None or not a.any(), f"{order} of input {i} on {backend}: math has none"
                    continue
                assert a is not None, f"input {i} lost its {order} on {backend} ({alias})"
                assert_close(a, b, what=f"{order} of input {i} on {backend} ({alias})")


# ----------------------------------------------------- rows a score mod hides entirely


def _hide_first(s, b, h, qi, kv):
    return torch.where(qi == 0, float("-inf"), s)


def _hide_first_bias(b, h, qi, kv):
    return torch.where(qi == 0, float("-inf"), 0.0 * kv)


_HIDE_ADDITIVE = score_mods.ScoreMod(lambda s, b, h, qi, kv: s + _hide_first_bias(b, h, qi, kv), "hide-additive",
                                     bias=_hide_first_bias, top_left=True)


@pytest.mark.parametrize("mod", [_hide_first, _HIDE_ADDITIVE], ids=["where", "additive"])
@pytest.mark.parametrize("backend", ["auto", "math", "chunked", "tiles", "sdpa"])
@pytest.mark.parametrize("T, Dv", [(3, 8), (12, 8), (40, 5)])
def test_a_row_hidden_by_a_score_mod_is_zero_on_every_backend(mod, backend, T, Dv):
    """where(q_idx == 0, -inf, s): the tile engine gave 0, math and chunked NaN (output, weights,
    and every gradient through the shared K and V) when no mask was given. The row is zero,
    weights and gradients too; every other row equals the float64 reference."""
    q, k, v = _qkv(B=2, H=4, Hkv=2, T=T, S=T, Dv=Dv, grad=True)
    try:
        out, w = mh.attend(q, k, v, score_mod=mod, backend=backend, return_weights=True)
    except ValueError as e:
        assert backend == "sdpa" and mod is _hide_first and "'tiles'" in str(e)
        return
    want, want_w = R.attention(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(),
                               return_weights=True)
    want, want_w = torch.from_numpy(want), torch.from_numpy(want_w)
    want[:, :, 0], want_w[:, :, 0] = 0.0, 0.0
    assert_close(out, want, what=f"out {backend}")
    assert_close(w, want_w, what=f"weights {backend}")
    got = _grads(out, (q, k, v))
    ref = _grads(sdpa(q, k, v, backend="math") * (torch.arange(T) > 0).view(1, 1, T, 1), (q, k, v))
    for name, a, b in zip("qkv", got, ref):
        assert_close(a, b, what=f"d{name} {backend}")


# ------------------------------------------------ the NaN rule, whatever the kernel does


def _zeroing_nan_rows(kernel, returns_lse=False):
    """A fused kernel that zeroes the output rows of NaN queries (torch's CPU kernel on an Intel
    Xeon did), instead of propagating them as it does on this machine."""
    def wrapped(q, *args, **kwargs):
        res = kernel(q, *args, **kwargs)
        out = res[0] if returns_lse else res
        out = out.masked_fill(torch.isnan(q).any(-1, keepdim=True), 0.0)
        return (out, *res[1:]) if returns_lse else out
    return wrapped


@pytest.mark.parametrize("kernel", ["zeroing", "as this machine's"])
@pytest.mark.parametrize("mask", [None, "causal", "window", "bool"])
@pytest.mark.parametrize("where", ["query", "key", "both"])
def test_nan_rule_holds_whatever_the_fused_kernel_does_with_nan(kernel, mask, where, monkeypatch):
    """The documented rule (functional's docstring, README): a row is NaN exactly when its query,
    or a key or value it may attend, holds a NaN; a row with no key is zero. It was enforced only
    when the kernel's output had a NaN, so a kernel that zeroes NaN rows gave a zero row."""

    if kernel == "zeroing":
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                            _zeroing_nan_rows(torch.nn.functional.scaled_dot_product_attention))
        if common.HAS_CPU_FLASH:
            # the other kernel behaviour, injected: this machine's torch has one of the two
            monkeypatch.setattr(fused_tiles, "flash_lse", _zeroing_nan_rows(fused_tiles.flash_lse, True))
    B, H, T, S = 1, 2, 20, 20
    q, k, v = _qkv(B=B, H=H, Hkv=1, T=T, S=S, dtype=torch.float32)
    m = {None: None, "causal": masks.causal(), "window": masks.sliding_window(4),
         "bool": torch.ones(1, 1, T, S, dtype=torch.bool).tril()}[mask]
    if where != "key":
        q[0, 1, 7, 3] = float("nan")  # query row 7 of head 1
    if where != "query":
        k[0, 0, 15, 0] = float("nan")  # key 15: rows that may attend it are NaN, the others not
    allowed = torch.ones(T, S, dtype=torch.bool) if m is None else masks.to_dense(m, B, H, T, S)[0, 0] \
        if isinstance(m, masks.MaskMod) else m[0, 0]
    want_nan = torch.zeros(B, H, T, dtype=torch.bool)
    want_nan[0, 1, 7] = where != "key" and bool(allowed[7].any())
    if where != "query":
        want_nan |= allowed[:, 15].view(1, 1, T)
    for backend in ("auto", "sdpa", "math", "tiles"):
        out = sdpa(q, k, v, m, backend=backend)
        got_nan = torch.isnan(out).any(-1)
        assert torch.equal(got_nan, want_nan), f"{backend}: NaN rows {got_nan.nonzero().tolist()}"
        assert not torch.isnan(out[~want_nan]).any()


# ------------------------------------------- flex: cached block masks keyed on what they read


class _Window:
    """A callable mask object whose attribute a user changes between calls."""

    def __init__(self, width):
        self.width = width

    def __call__(self, b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < self.width)


def _doc_mask(ids, b, h, q_idx, kv_idx):
    return ids[q_idx] == ids[kv_idx]


def _stale_cases():
    ids = torch.zeros(512, dtype=torch.long)
    ids[256:] = 1
    partial = functools.partial(_doc_mask, ids)

    def edit_partial():
        ids[:] = 0  # in place: the partial is the same object; every pair allowed now

    obj = _Window(4)

    def edit_obj():
        obj.width = 400

    table = {"width": 4}

    def from_dict(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < table["width"])

    def edit_dict():
        table["width"] = 400

    widths = [4]

    def from_list(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < widths[0])

    def edit_list():
        widths[0] = 400

    bound = _Window(4).__call__

    def edit_bound():
        bound.__self__.width = 400

    return {"partial over a tensor": (partial, edit_partial), "callable object": (obj, edit_obj),
            "closure over a dict": (from_dict, edit_dict), "closure over a list": (from_list, edit_list),
            "bound method": (bound, edit_bound)}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(_stale_cases()))
def test_flex_block_mask_cache_never_serves_a_stale_mask(case):
    """The flex backend cached block masks by the callable's identity for objects it could not
    look into: after an in-place edit of a tensor a functools.partial holds, or of a callable
    object's attribute, it skipped the blocks the old mask left empty (off by 0.8). Each call must equal the math path
    with the mask as it is now."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from multihead.kernels import flex

    flex.clear_cache()
    mask, edit = _stale_cases()[case]
    q, k, v = _qkv(B=1, H=2, Hkv=2, T=512, S=512, D=8, Dv=8, dtype=torch.float32)  # 128-key blocks
    for _ in range(2):
        before = sdpa(q, k, v, mask, backend="flex")
        assert_close(before, sdpa(q, k, v, mask, backend="math"), torch.float32, atol=1e-5, what=f"{case} before")
    edit()
    after = sdpa(q, k, v, mask, backend="flex")
    want = sdpa(q, k, v, mask, backend="math")
    assert (want - before).abs().max() > 0.05  # the edit changes the answer
    assert_close(after, want, torch.float32, atol=1e-5, what=f"{case} after the edit")


class _SlotWindow:
    """A callable object `_key` cannot look into (slots): never cached, always right."""

    __slots__ = ("width",)

    def __init__(self, width):
        self.width = width

    def __call__(self, b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < self.width)


@pytest.mark.slow
def test_flex_cache_hit_is_checked_against_the_object_it_was_built_from():
    """Two predicates of the same code: the second's key matches the entry the first built, but
    the first's list was edited since; the entry (whose mask reads the first's list) is rebuilt.
    An object the key cannot see into is not cached at all."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from multihead.kernels import flex

    def make(widths):
        def window(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx - kv_idx < widths[0])
        return window

    flex.clear_cache()
    q, k, v = _qkv(B=1, H=2, Hkv=2, T=512, S=512, D=8, Dv=8, dtype=torch.float32)
    first_widths = [4]
    first, second = make(first_widths), make([4])
    sdpa(q, k, v, first, backend="flex")
    first_widths[0] = 400
    for mask in (second, first):
        assert_close(sdpa(q, k, v, mask, backend="flex"), sdpa(q, k, v, mask, backend="math"), torch.float32,
                     atol=1e-5, what="second, then the edited first")
    slot = _SlotWindow(4)
    for width in (4, 400):
        slot.width = width
        assert_close(sdpa(q, k, v, slot, backend="flex"), sdpa(q, k, v, slot, backend="math"), torch.float32,
                     atol=1e-5, what=f"slots object, width {width}")


@pytest.mark.slow
def test_flex_learned_bias_and_double_backward_equal_math():
    """The flex backend (CPU: flex forward, tile-engine backward): a float mask that requires grad
    gets its gradient, and a gradient penalty through it equals math's (the backward was
    once_differentiable, so the second-order term was dropped when dO had no graph)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = _qkv(B=1, H=2, Hkv=1, T=16, S=16, dtype=torch.float32, grad=True)
    bias = torch.randn(1, 2, 16, 16, requires_grad=True)
    mod = score_mods.softcap(3.0)
    want = _grads(sdpa(q, k, v, bias, causal=True, score_mod=mod, backend="math"), (q, k, v, bias))
    got = _grads(sdpa(q, k, v, bias, causal=True, score_mod=mod, backend="flex"), (q, k, v, bias))
    for name, a, b in zip(["dq", "dk", "dv", "dbias"], got, want):
        assert_close(a, b, torch.float32, atol=1e-4, rtol=1e-4, what=f"flex {name}")
    want_p, want_g = _penalty("math", q, k, v, causal=True, score_mod=mod)
    got_p, got_g = _penalty("flex", q, k, v, causal=True, score_mod=mod)
    assert_close(got_p, want_p, torch.float32, atol=1e-4, rtol=1e-4, what="flex penalty")
    for name, a, b in zip("qkv", got_g, want_g):
        assert_close(a, b, torch.float32, atol=1e-4, rtol=1e-4, what=f"flex d penalty / d{name}")


@pytest.mark.parametrize("T, S", [(1, 1), (1, 9), (3, 5), (15, 40)])
@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_nan_rule_when_every_key_a_row_sees_is_nan_few_queries(T, S, backend):
    """torch's CPU kernel (on this machine too) zeroes a row whose every score is NaN: a NaN in
    every key a decoding query sees gave 0, not NaN. Few queries: the check must catch it
    without reading K and V (what decoding cannot afford)."""
    q, k, v = _qkv(B=2, H=4, Hkv=2, T=T, S=S, dtype=torch.float32)
    k[1, 0, :, 2] = float("nan")  # every key of batch 1, K/V head 0: query heads 0 and 1
    out = sdpa(q, k, v, causal=True, backend=backend)
    want = torch.zeros(2, 4, T, dtype=torch.bool)
    want[1, :2] = True
    assert torch.equal(torch.isnan(out).any(-1), want)
    clean = sdpa(q[:1], k[:1], v[:1], causal=True, backend="math")
    assert_close(out[:1], clean, torch.float32, atol=1e-6, what="the batch without NaN")
