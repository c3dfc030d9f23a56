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
