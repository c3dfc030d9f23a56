"""multihead.reference: the textbook in NumPy float64, against a per-head loop and itself."""

import numpy as np

from multihead import reference as R


def test_reference_equals_a_loop_over_heads():
    """The vectorised textbook against the per-head loop the paper describes."""
    rng = np.random.default_rng(0)
    B, T, C, H = 2, 5, 12, 3
    X = rng.standard_normal((B, T, C))
    W = [rng.standard_normal((C, C)) for _ in range(4)]
    out = R.mha_forward(X, *W, n_heads=H, causal=True)
    D = C // H
    expect = np.zeros_like(out)
    for b in range(B):
        heads = []
        for h in range(H):
            cols = slice(h * D, (h + 1) * D)
            Q, K, V = X[b] @ W[0][:, cols], X[b] @ W[1][:, cols], X[b] @ W[2][:, cols]
            s = Q @ K.T / np.sqrt(D)
            s[np.triu_indices(T, 1)] = -np.inf
            p = np.exp(s - s.max(1, keepdims=True))
            heads.append(p / p.sum(1, keepdims=True) @ V)
        expect[b] = np.concatenate(heads, 1) @ W[3]
    assert np.abs(out - expect).max() < 1e-12


def test_reference_split_combine_round_trip_and_softmax_empty_row():
    x = np.arange(2 * 3 * 8, dtype=float).reshape(2, 3, 8)
    assert R.split_heads(x, 4).shape == (2, 4, 3, 2)
    assert np.array_equal(R.combine_heads(R.split_heads(x, 4)), x)
    assert R.softmax(np.array([[-np.inf, -np.inf], [0.0, 0.0]])).tolist() == [[0.0, 0.0], [0.5, 0.5]]


def test_reference_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, multihead.reference; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_rope_equals_complex_rotation_in_both_pairings():
    """RoPE as the paper defines it: pair (a, b) as a + ib times e^(i pos theta_f)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, 8))
    pos = np.array([0, 3, 7, 100, 100000])
    theta = 500.0 ** (-np.arange(0, 8, 2) / 8)
    turn = np.exp(1j * pos[:, None] * theta[None, :])  # (T, d/2)
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * turn
    inter = np.stack([z.real, z.imag], -1).reshape(x.shape)
    assert np.abs(R.rope(x, pos, 500.0, interleaved=True) - inter).max() < 1e-12
    z = (x[..., :4] + 1j * x[..., 4:]) * turn
    assert np.abs(R.rope(x, pos, 500.0) - np.concatenate([z.real, z.imag], -1)).max() < 1e-12


def test_mla_forward_without_rope_or_norm_is_mha_with_low_rank_kv():
    """With rope_dim 0 and no latent norm, MLA is MHA whose W_k, W_v factor through the latent."""
    rng = np.random.default_rng(2)
    B, T, C, H, Rk, D = 2, 4, 12, 3, 5, 4
    X = rng.standard_normal((B, T, C))
    W_a, W_b = rng.standard_normal((C, Rk)), rng.standard_normal((Rk, H * 2 * D))
    W_q, W_o = rng.standard_normal((C, H * D)), rng.standard_normal((H * D, C))
    cols = W_b.reshape(Rk, H, 2, D)
    W_k = (W_a @ cols[:, :, 0].reshape(Rk, H * D))
    W_v = (W_a @ cols[:, :, 1].reshape(Rk, H * D))
    got = R.mla_forward(X, W_a, W_b, W_o, H, Rk, D, W_q=W_q, causal=True)
    assert np.abs(got - R.mha_forward(X, W_q, W_k, W_v, W_o, n_heads=H, causal=True)).max() < 1e-10
