"""`multihead.inspect.summaries` at 8,192 tokens on sliding-window and GQA models: a random
Mistral (sliding window 4,096, 2 query heads on 1 K/V head) and a random Gemma-2 (a local
layer with window 4,096, a global one, softcap 5). The statistics of every row and the top-k
keys of sampled rows equal transformers' eager attention weights (`attn_implementation=
"eager"`, `output_attentions=True`), kept by a hook one layer at a time and reduced in
NumPy float64 (the whole `(2, 8192, 8192)` of a layer, never all layers at once).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from multihead.inspect import summaries  # noqa: E402
from multihead.interop.loaders import minilm_path  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N = 8192
WINDOW = 4096
TOL = 1e-5
ROWS = (0, 1, 1023, 1024, 4095, 4096, 4097, 6000, N - 1)  # rows whose top-k keys are compared


def _model(name: str, vocab: int):
    t = transformers
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, vocab_size=vocab,
                  max_position_embeddings=N, num_attention_heads=2, num_key_value_heads=1)
    if name == "mistral":
        cfg, cls = t.MistralConfig(sliding_window=WINDOW, **common), t.MistralForCausalLM
    else:  # layer 0 local (window), layer 1 global; softcap on the scores
        cfg, cls = t.Gemma2Config(head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=5.0,
                                  **common), t.Gemma2ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # sharp patterns, scores large enough for the softcap to bite
        for name_, p in model.named_parameters():
            if "q_proj.weight" in name_ or "k_proj.weight" in name_:
                p.mul_(8.0)
    return model


def _row_statistics(A: np.ndarray) -> tuple[dict[str, np.ndarray], dict[int, np.ndarray]]:
    """Per-head statistics of one layer's float32 weights `(H, T, T)` in float64, a block of
    rows at a time, and the sampled rows (float64)."""
    H, T, _ = A.shape
    sums = {k: np.zeros(H) for k in ("entropy", "mean_distance", "first_token_mass", "previous_token",
                                     "current_token", "beyond_1k", "beyond_4k")}
    j = np.arange(T)[None, :]
    for t0 in range(0, T, 512):
        a = A[:, t0:t0 + 512].astype(np.float64)  # (H, t, T)
        i = np.arange(t0, t0 + a.shape[1])[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            sums["entropy"] -= np.where(a > 0, a * np.log(np.where(a > 0, a, 1)), 0).sum((-2, -1))
        sums["mean_distance"] += (a * (i - j)).sum((-2, -1))
        sums["first_token_mass"] += a[..., 0].sum(-1)
        rows = np.arange(a.shape[1])
        sums["previous_token"] += a[:, rows[i[:, 0] >= 1], (i[:, 0] - 1)[i[:, 0] >= 1]].sum(-1)
        sums["current_token"] += a[:, rows[i[:, 0] >= 1], i[:, 0][i[:, 0] >= 1]].sum(-1)
        for name, d in (("beyond_1k", 1024), ("beyond_4k", 4096)):
            sums[name] += (a * (j <= i - d)).sum((-2, -1))
    out = {"entropy": sums["entropy"] / T, "mean_distance": sums["mean_distance"] / T,
           "first_token_mass": sums["first_token_mass"] / T, "previous_token": sums["previous_token"] / (T - 1),
           "current_token": sums["current_token"] / (T - 1), "beyond_1k": sums["beyond_1k"] / (T - 1024),
           "beyond_4k": sums["beyond_4k"] / (T - 4096)}
    return out, {r: A[:, r].astype(np.float64) for r in ROWS}


def _eager_statistics(model, ids: torch.Tensor) -> list[tuple[dict, dict]]:
    """Each layer's statistics from transformers' eager weights, each layer's weights dropped
    once reduced."""
    kept: dict[int, tuple[dict, dict]] = {}

    def keep(layer):
        def hook(module, args, output):
            kept[layer] = _row_statistics(output[1][0].numpy())
            return (output[0], None, *output[2:])
        return hook

    handles = [layer.self_attn.register_forward_hook(keep(li)) for li, layer in enumerate(model.model.layers)]
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            model.model(input_ids=ids[None], output_attentions=True)
    finally:
        model.set_attn_implementation("multihead")
        for h in handles:
            h.remove()
    return [kept[li] for li in range(len(model.model.layers))]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_sliding_window_and_gqa_models_at_8192_equal_eager(name):
    tok = transformers.AutoTokenizer.from_pretrained(str(minilm_path()))
    model = _model(name, len(tok))
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.tensor([101]), torch.randint(1000, 6000, (N - 1,), generator=g)])
    got = summaries((model, tok), ids, progress=False)
    assert got.meta["summaries"]["layers_from_weights"] == []  # every layer seen beside the fused kernel
    for layer, (ref, rows) in enumerate(_eager_statistics(model, ids)):
        local = name == "mistral" or layer == 0
        for stat, want in ref.items():
            have = got.scores[stat][layer].double().numpy()
            err = np.abs(have - want).max()
            assert err <= TOL * max(1.0, np.abs(want).max()), f"{name} layer {layer} {stat}: max diff {err:.3g}"
        if local:  # nothing 4,096 or more tokens back: the window is applied
            assert float(got.scores["beyond_4k"][layer].abs().max()) == 0.0
        else:
            assert float(got.scores["beyond_4k"][layer].min()) > 0.0
        for row, A in rows.items():  # A: (H, T), the eager row
            k = min(8, row + 1)
            want = -np.sort(-A, axis=-1)[:, :k]
            have_w = got.top_weight[layer, :, row, :k].double().numpy()
            assert np.allclose(have_w, want, rtol=2e-3, atol=1e-4), f"{name} layer {layer} row {row} top-k weights"
            idx = got.top_index[layer, :, row, :k].numpy().astype(int)
            assert (idx >= 0).all()
            assert np.allclose(np.take_along_axis(A, idx, -1), want, atol=1e-6), f"{name} row {row}: other keys"
            if local:
                assert (row - idx < WINDOW).all(), f"{name} layer {layer} row {row}: a key outside the window"
