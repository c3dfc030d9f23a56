"""Gradients when the attention's inputs alias each other: self-attention on one tensor
(q is k is v), one memory as keys and values (k is v), views of one tensor (a packed QKV
projection sliced, `unbind`, a slice of the tensor that is also q), inputs computed from
one another, and a learnable float mask that is one of them.

A tensor that fills several slots must get the sum of the slots' partial derivatives, once.
Every backend's gradient, as is and under create_graph=True, and the gradient of a function
of that gradient (a gradient penalty) are held against the explicit "math" path (plain
autograd through matmul, softmax, matmul) in float64, and, as an independent reference,
against finite differences (`gradcheck`, `gradgradcheck`). With dropout, whose keeps only
the tile engine redraws, the reference is the same call on distinct leaves (the tensor's
gradient is then the sum of the leaves' gradients) and finite differences."""

import pytest
import torch

import multihead as mh
from conftest import assert_close
from multihead import masks, score_mods

sdpa = mh.scaled_dot_product_attention

BACKENDS = ["auto", "chunked", "tiles", "sdpa"]
B, H, T, D = 2, 4, 6, 6  # D == T == S: a (B, H, T, D) tensor can also be a (B, H, T, S) float mask


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _pattern(name: str):
    """(leaves, build): the tensors that require grad and `build(*leaves) -> (q, k, v, mask)`."""
    x = _rand(B, H, T, D, seed=1).requires_grad_()
    y = _rand(B, H, T, D, seed=2).requires_grad_()
    if name == "q=k":
        return [x, y], lambda x, y: (x, x, y, None)
    if name == "k=v":  # GQA: one (B, Hkv, S, D) memory as keys and values
        m = _rand(B, 2, T, D, seed=3).requires_grad_()
        return [y, m], lambda y, m: (y, m, m, None)
    if name == "q=v":
        return [x, y], lambda x, y: (x, y, x, None)
    if name == "q=k=v":
        return [x], lambda x: (x, x, x, None)
    if name == "unbind":  # q, k, v as views of one stacked tensor
        w = _rand(3, B, H, T, D, seed=4).requires_grad_()
        return [w], lambda w: (*w.unbind(0), None)
    if name == "slices":  # a packed QKV projection's output, sliced on the last dim
        w = _rand(B, H, T, 3 * D, seed=5).requires_grad_()
        return [w], lambda w: (w[..., :D], w[..., D:2 * D], w[..., 2 * D:], None)
    if name == "base+view":  # q is the tensor, k and v views of it (GQA: k, v its first heads)
        return [x], lambda x: (x, x[:, :2, :, :D], x[:, :2], None)
    if name == "derived":  # k computed from q, v from k
        return [x], lambda x: (x, x * 0.5, x * 0.5 + 1.0, None)
    if name == "mask=q=k=v":  # a learnable float mask (B, H, T, S) that is the queries, keys, values too
        return [x], lambda x: (x, x, x, x)
    if name == "mask-view":  # the mask a view of k (broadcast over heads), q separate
        return [x, y], lambda x, y: (y, x, x, x[:, :1])
    raise AssertionError(name)


PATTERNS = ["q=k", "k=v", "q=v", "q=k=v", "unbind", "slices", "base+view", "derived", "mask=q=k=v", "mask-view"]
CONDITIONS = ["plain", "causal", "padding", "window", "softcap", "alibi"]


def _call(backend, q, k, v, mask, condition, dropout_p=0.0):
    kw = {"causal": condition in ("causal", "softcap", "alibi")}
    if condition == "softcap":
        kw["score_mod"] = score_mods.softcap(1.5)
    if condition == "alibi":
        kw["score_mod"] = score_mods.alibi(q.shape[1])
    if condition == "padding":  # batch 1 may not attend its last two keys
        keep = torch.ones(B, 1, 1, k.shape[2], dtype=torch.bool)
        keep[1, ..., -2:] = False
        mask = keep if mask is None else mask + torch.zeros(keep.shape, dtype=mask.dtype).masked_fill(~keep, -1e9)
    if condition == "window":
        if mask is not None:  # a float mask and a predicate together: the window as a bias
            idx = torch.arange(T)
            mask = mask + torch.zeros(T, T, dtype=mask.dtype).masked_fill((idx[:, None] - idx).abs() > 2, -1e9)
        else:
            mask = masks.sliding_window(3)
    return sdpa(q, k, v, mask, backend=backend, dropout_p=dropout_p, **kw)


def _weights(out):
    return torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out).cos()


def _orders(backend, leaves, build, condition):
    """(plain gradient, gradient under create_graph, penalty, gradient of the penalty) per leaf."""
    out = _call(backend, *build(*leaves), condition)
    plain = torch.autograd.grad((out * _weights(out)).sum(), leaves)
    out = _call(backend, *build(*leaves), condition)
    graph = torch.autograd.grad((out * _weights(out)).sum(), leaves, create_graph=True)
    penalty = sum(g.square().sum() for g in graph)
    return plain, graph, penalty, torch.autograd.grad(penalty, leaves)


@pytest.mark.parametrize("condition", CONDITIONS)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_aliased_gradient_and_double_gradient_equal_math(pattern, condition):
    """Each backend's gradient (plain and under create_graph=True) and its gradient penalty's
    gradient equal the math path's when inputs alias; the fused and tile backends gave 3x
    (q is k is v) and 2x (k is v) under create_graph."""
    leaves, build = _pattern(pattern)
    want = _orders("math", leaves, build, condition)
    for backend in BACKENDS:
        try:
            got = _orders(backend, leaves, build, condition)
        except ValueError as e:  # torch's fused kernel takes additive mods only
            assert backend == "sdpa" and condition == "softcap" and "'tiles'" in str(e), str(e)
            continue
        for what, a_s, b_s in zip(("gradient", "create_graph gradient"), got[:2], want[:2]):
            for i, (a, b) in enumerate(zip(a_s, b_s)):
                assert_close(a, b, what=f"{backend} {pattern} {condition}: {what} of leaf {i}")
        assert_close(got[2], want[2], what=f"{backend} {pattern} {condition}: penalty")
        for i, (a, b) in enumerate(zip(got[3], want[3])):
            assert_close(a, b, what=f"{backend} {pattern} {condition}: penalty gradient of leaf {i}")


def test_softcap_gradient_penalty_on_one_tensor():
    """A gradient penalty ||d loss / d x||^2 with q = k = v = x and a softcap (Gemma-style),
    the case the tile engine got ~9x too large: its value and gradient equal math's."""
    x = (_rand(1, 4, 12, 8, seed=0) * 3.0).requires_grad_()
    results = {}
    for backend in ("math", "tiles", "auto", "chunked"):
        out = sdpa(x, x, x, score_mod=score_mods.softcap(1.5), causal=True, backend=backend)
        (g,) = torch.autograd.grad((out * torch.linspace(-1, 1, 8, dtype=out.dtype)).sum(), x, create_graph=True)
        penalty = g.square().sum()
        results[backend] = (penalty, torch.autograd.grad(penalty, x)[0])
    for backend in ("tiles", "auto", "chunked"):
        assert_close(results[backend][0], results["math"][0], what=f"penalty {backend}")
        assert_close(results[backend][1], results["math"][1], what=f"penalty gradient {backend}")


def test_hessian_vector_product_of_self_attention():
    """A Hessian-vector product through q = k = v (double backward against a direction):
    every backend's equals math's."""
    x = _rand(1, 2, 5, 4, seed=7).requires_grad_()
    direction = _rand(1, 2, 5, 4, seed=8)
    hvp = {}
    for backend in ["math"] + BACKENDS:
        out = sdpa(x, x, x, causal=True, backend=backend)
        (g,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
        hvp[backend] = torch.autograd.grad((g * direction).sum(), x)[0]
    for backend in BACKENDS:
        assert_close(hvp[backend], hvp["math"], what=f"Hessian-vector product {backend}")


# ------------------------------------------------------------ finite differences


def _numeric(fn, inputs, eps=1e-5):
    """Central differences of the scalar fn(*inputs) with respect to every element of every input
    (on copies: the graphs already built from the inputs stay valid)."""
    xs = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    grads = []
    for x in xs:
        g = torch.zeros_like(x)
        for i in range(x.numel()):
            with torch.no_grad():
                keep = x.view(-1)[i].item()
                x.view(-1)[i] = keep + eps
            up = fn(*xs).item()
            with torch.no_grad():
                x.view(-1)[i] = keep - eps
            down = fn(*xs).item()
            with torch.no_grad():
                x.view(-1)[i] = keep
            g.view(-1)[i] = (up - down) / (2 * eps)
        grads.append(g)
    return grads


def _check_against_finite_differences(f, inputs, what):
    """gradcheck and gradgradcheck, then what they cannot see: gradgradcheck holds the create_graph
    gradient's derivative to finite differences of that same gradient, so a gradient 3x too large
    passes it. Here the create_graph gradient of L = sum(f * w) is held to finite differences of L,
    and the gradient of the penalty ||dL/dx||^2 to finite differences of the penalty computed from
    the plain backward (which gradcheck holds to finite differences)."""
    assert torch.autograd.gradcheck(f, inputs), what
    assert torch.autograd.gradgradcheck(f, inputs), what

    def loss(*xs):
        out = f(*xs)
        return (out * _weights(out)).sum()

    def penalty(*xs):
        return sum(g.square().sum() for g in torch.autograd.grad(loss(*xs), xs))

    graph = torch.autograd.grad(loss(*inputs), inputs, create_graph=True)
    for i, (a, b) in enumerate(zip(graph, _numeric(loss, inputs))):
        assert_close(a, b, atol=1e-6, rtol=1e-6, what=f"{what}: create_graph gradient of input {i}")
    got = torch.autograd.grad(sum(g.square().sum() for g in graph), inputs)
    for i, (a, b) in enumerate(zip(got, _numeric(penalty, inputs))):
        assert_close(a, b, atol=1e-5, rtol=1e-5, what=f"{what}: penalty gradient of input {i}")


@pytest.mark.parametrize("backend", ["math", "tiles", "sdpa", "auto"])
@pytest.mark.parametrize("case", ["q=k=v alibi causal", "k=v GQA padding", "mask=q=k=v", "base+view window"])
def test_aliased_calls_against_finite_differences(backend, case):
    """Finite differences as a reference independent of every backend, on small aliased calls."""
    if case == "q=k=v alibi causal":
        x = _rand(1, 2, 4, 3, seed=9).requires_grad_()
        inputs = (x,)

        def f(x):
            return sdpa(x, x, x, causal=True, score_mod=score_mods.alibi(2), backend=backend)
    elif case == "k=v GQA padding":
        q, m = _rand(2, 2, 3, 3, seed=10).requires_grad_(), _rand(2, 1, 4, 3, seed=11).requires_grad_()
        keep = torch.ones(2, 1, 1, 4, dtype=torch.bool)
        keep[1, ..., -1] = False
        inputs = (q, m)

        def f(q, m):
            return sdpa(q, m, m, keep, backend=backend)
    elif case == "mask=q=k=v":
        x = _rand(1, 2, 3, 3, seed=12).requires_grad_()
        inputs = (x,)

        def f(x):
            return sdpa(x, x, x, x, backend=backend)
    else:  # q the tensor, k and v a view of its first head (MQA)
        x = _rand(1, 2, 5, 2, seed=13).requires_grad_()
        inputs = (x,)

        def f(x):
            return sdpa(x, x[:, :1], x[:, :1], masks.sliding_window(2), backend=backend)

    _check_against_finite_differences(f, inputs, f"{backend} {case}")


# ------------------------------------------------------------------------ dropout


def _dropped(backend, q, k, v, p, seed=21):
    torch.manual_seed(seed)  # the tile engine draws its per-call seed from torch's generator
    out = sdpa(q, k, v, causal=True, dropout_p=p, backend=backend)
    return (out * _weights(out)).sum()


@pytest.mark.parametrize("backend", ["tiles", "auto"])
@pytest.mark.parametrize("pattern", ["q=k=v", "k=v"])
def test_dropout_gradients_on_aliased_inputs_equal_distinct_leaves(backend, pattern):
    """With dropout (the same keeps: same seed, same shapes), the aliased call's gradient and its
    gradient penalty's gradient equal those of the same call on distinct leaves holding the same
    values, summed over the slots each tensor fills ("auto" on the CPU: the tile engine)."""
    x = _rand(1, 2, 8, 4, seed=14).requires_grad_()
    q0 = _rand(1, 4, 8, 4, seed=15).requires_grad_()
    if pattern == "q=k=v":
        leaves, slots = [x], lambda x: (x, x, x)
        groups = [[0, 1, 2]]  # the one leaf fills every slot
    else:
        leaves, slots = [q0, x], lambda q, x: (q, x, x)
        groups = [[0], [1, 2]]
    p = 0.3
    got = torch.autograd.grad(_dropped(backend, *slots(*leaves), p), leaves, create_graph=True)
    got_penalty = sum(g.square().sum() for g in got)
    got_pg = torch.autograd.grad(got_penalty, leaves)

    distinct = [t.detach().clone().requires_grad_() for t in slots(*leaves)]
    plain = torch.autograd.grad(_dropped(backend, *distinct, p), distinct)  # the fast FlashAttention-2 backward
    per_slot = torch.autograd.grad(_dropped(backend, *distinct, p), distinct, create_graph=True)
    summed = [sum(per_slot[i] for i in grp) for grp in groups]
    penalty = sum(g.square().sum() for g in summed)
    pg = torch.autograd.grad(penalty, distinct)
    for n, grp in enumerate(groups):
        assert_close(got[n], sum(plain[i] for i in grp), what=f"{pattern} gradient of leaf {n}")
        assert_close(got_pg[n], sum(pg[i] for i in grp), what=f"{pattern} penalty gradient of leaf {n}")
    assert_close(got_penalty, penalty, what=f"{pattern} penalty")


def test_dropout_keeping_everything_equals_math_on_one_tensor():
    """dropout_p = 1e-9 keeps every element (on the tile engine's keep path and math's F.dropout
    alike), so the aliased call's gradient and penalty gradient must equal math's without dropout,
    up to the keeps' scale 1 / (1 - p) = 1 + 1e-9."""
    x = _rand(1, 2, 8, 4, seed=16).requires_grad_()
    want = torch.autograd.grad(_dropped("math", x, x, x, 0.0), x, create_graph=True)[0]
    want_pg = torch.autograd.grad(want.square().sum(), x)[0]
    for backend in ("tiles", "auto", "math"):
        got = torch.autograd.grad(_dropped(backend, x, x, x, 1e-9), x, create_graph=True)[0]
        assert_close(got, want, atol=1e-8, rtol=1e-8, what=f"{backend} gradient")
        assert_close(torch.autograd.grad(got.square().sum(), x)[0], want_pg, atol=1e-8, rtol=1e-8,
                     what=f"{backend} penalty gradient")


def test_dropout_on_one_tensor_against_finite_differences():
    """Dropout seeded per call is a fixed function of x: q = k = v = x on the tile engine, with a
    softcap, against finite differences."""
    x = _rand(1, 2, 4, 3, seed=17).requires_grad_()

    def f(x):
        torch.manual_seed(5)
        return sdpa(x, x, x, dropout_p=0.3, backend="tiles", score_mod=score_mods.softcap(2.0))

    _check_against_finite_differences(f, (x,), "tiles dropout")


# --------------------------------------------------------------------------- flex


@pytest.mark.slow
def test_flex_aliased_gradient_and_double_gradient_equal_math():
    """The flex backend (CPU: flex forward, tile-engine backward) with q = k = v and k = v (GQA):
    gradient under create_graph and penalty gradient equal math's (float32: flex's CPU kernel)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    x = torch.randn(1, 2, 16, 8, generator=torch.Generator().manual_seed(18)).requires_grad_()
    q = torch.randn(1, 4, 16, 8, generator=torch.Generator().manual_seed(19)).requires_grad_()
    for leaves, build in (([x], lambda x: (x, x, x)), ([q, x], lambda q, x: (q, x, x))):
        res = {}
        for backend in ("math", "flex"):
            out = sdpa(*build(*leaves), causal=True, score_mod=score_mods.softcap(3.0), backend=backend)
            g = torch.autograd.grad((out * _weights(out)).sum(), leaves, create_graph=True)
            penalty = sum(t.square().sum() for t in g)
            res[backend] = (g, penalty, torch.autograd.grad(penalty, leaves))
        tol = {"dtype": torch.float32, "atol": 1e-4, "rtol": 1e-4}
        for a, b in zip(res["flex"][0], res["math"][0]):
            assert_close(a, b, **tol, what="flex gradient")
        assert_close(res["flex"][1], res["math"][1], **tol, what="flex penalty")
        for a, b in zip(res["flex"][2], res["math"][2]):
            assert_close(a, b, **tol, what="flex penalty gradient")


def test_latent_attention_absorbed_path_double_backward():
    """MLA's absorbed path attends with the latent as keys and a view of it as values
    (k = c, v = c[..., :R]): a gradient penalty through it equals the math backend's (the
    fused and tile backends gave 1812 for 489.5 here)."""
    from multihead.latent import LatentAttention

    res = {}
    for backend in ("math", "sdpa", "tiles", "auto"):
        torch.manual_seed(0)
        m = LatentAttention(32, 4, 16, rope_dim=8, causal=True, backend=backend).double()
        q_nope = _rand(2, 4, 6, m.head_dim, seed=30).requires_grad_()
        q_pe = _rand(2, 4, 6, 8, seed=31).requires_grad_()
        latent = _rand(2, 6, 24, seed=32).requires_grad_()
        out, _ = m.attend_absorbed(q_nope, q_pe, latent)
        grads = torch.autograd.grad(out.square().sum(), (q_nope, q_pe, latent), create_graph=True)
        penalty = sum(g.square().sum() for g in grads)
        res[backend] = (grads, penalty, torch.autograd.grad(penalty, (q_nope, q_pe, latent)))
    for backend in ("sdpa", "tiles", "auto"):
        for a, b in zip(res[backend][0], res["math"][0]):
            assert_close(a, b, what=f"{backend} gradient")
        assert_close(res[backend][1], res["math"][1], what=f"{backend} penalty")
        for a, b in zip(res[backend][2], res["math"][2]):
            assert_close(a, b, what=f"{backend} penalty gradient")
