"""Gemma 3 270M on attn_implementation="multihead": 5 of every 6 layers attend through a
512-token sliding window, the 6th globally; one KV head for 4 query heads of width 256;
QK-norm. At 700, 2,048 and 8,192 tokens (past the window, so both kinds of layer differ from
plain causal attention) the logits equal transformers' eager attention as closely as its
own sdpa does; the windowed layers reach the kernel as a mask predicate (block-sparse,
no dense (T, S) mask) and the global ones as plain causality; greedy generate past the
window gives sdpa's tokens.

The bound: eager and sdpa are two float32 computations of the same model whose attention
sums in different orders; multihead is a third. Its distance to eager may be a small
multiple of sdpa's (each is a float32 rounding of the same sums) plus float32's relative
error on the logits' scale (2^-23 per operation, over the model's 18 layers of sums of
thousands of terms: 1e-5 of the largest logit leaves that room). Slow: loads the model
(~35 s from the float32 cache) and runs ~10 forwards of up to 2,048 tokens and three of
8,192 (about 3 minutes on one thread; eager's (T, T) weights are 1 GiB a layer there).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

KEEP = 32  # logits at the last 32 positions (the full (T, 262144) logits would be 2 GB at 2,048 tokens)


@pytest.fixture(scope="module")
def gemma():
    from multihead.interop.loaders import InspectError, load_model

    try:
        return load_model("gemma3")
    except InspectError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def kjv_ids(gemma):
    from multihead.corpus import split_kjv

    _, held = split_kjv()
    return gemma.tokenizer(held[:40_000], return_tensors="pt")["input_ids"]  # <bos> first, as the model reads text


def _run(model, implementation: str, ids: torch.Tensor, **kwargs):
    """(last hidden states `(T, C)`, the last KEEP positions' logits) on `implementation`; the model
    is put back on multihead after."""
    model.set_attn_implementation(implementation)
    try:
        with torch.no_grad():
            out = model(ids, logits_to_keep=KEEP, output_hidden_states=True, use_cache=False, **kwargs)
    finally:
        model.set_attn_implementation("multihead")
    return out.hidden_states[-1][0], out.logits[0]


class _Masks:
    """An observer (`multihead_observer=`): what each layer's kernel is given for its mask."""

    def __init__(self):
        self.calls = []

    def observe(self, module, query, key, *, mask, causal, **_):
        self.calls.append((module.layer_idx, type(mask).__name__, causal, tuple(query.shape), tuple(key.shape)))


@pytest.mark.parametrize("T", [700, 2048, 8192])
def test_logits_equal_eager_attention_as_closely_as_sdpa(gemma, kjv_ids, T):
    """At 8,192 tokens the hidden states are compared at the positions whose logits are read:
    over all positions the maximum is one token's (position 5,173 of this text amplifies any
    rounding of the first global layer 100- to 300-fold by the last layer, sdpa's and multihead's
    alike), so a maximum over all 8,192 rows compares where each kernel's rounding happened to
    fall on that token, not how exact the kernels are."""
    model = gemma.model
    ids = kjv_ids[:, :T]
    assert ids[0, 0] == gemma.tokenizer.bos_token_id
    seen = _Masks()
    hidden, logits = _run(model, "multihead", ids, multihead_observer=seen)
    e_hidden, e_logits = _run(model, "eager", ids)
    s_hidden, s_logits = _run(model, "sdpa", ids)
    sdpa_err, ours = (s_logits - e_logits).abs().max().item(), (logits - e_logits).abs().max().item()
    scale = e_logits.abs().max().item()
    bound = 4 * sdpa_err + 1e-5 * scale
    assert ours <= bound, f"T={T}: multihead vs eager {ours:.3g}, sdpa vs eager {sdpa_err:.3g}, bound {bound:.3g}"
    rows = slice(-KEEP, None) if T > 2048 else slice(None)
    hidden, e_hidden, s_hidden = hidden[rows], e_hidden[rows], s_hidden[rows]
    h_bound = 4 * (s_hidden - e_hidden).abs().max().item() + 1e-5 * e_hidden.abs().max().item()
    assert (hidden - e_hidden).abs().max().item() <= h_bound
    assert torch.equal(logits.argmax(-1), e_logits.argmax(-1))
    # 18 layers; the windowed ones (5 of 6) get a predicate, the global ones plain causality: no dense mask
    kinds = model.config.layer_types
    assert [c[0] for c in seen.calls] == list(range(18)) and kinds.count("sliding_attention") == 15
    for layer, mask, causal, q, k in seen.calls:
        assert q == (1, 4, T, 256) and k == (1, 1, T, 256)  # MQA: one KV head, no copies
        if kinds[layer] == "sliding_attention":
            assert (mask, causal) == ("MaskMod", False), (layer, mask, causal)
        else:
            assert (mask, causal) == ("NoneType", True), (layer, mask, causal)


def test_a_sliding_layers_predicate_is_the_window(gemma, kjv_ids):
    """The predicate the windowed layers get sees exactly the 512 keys up to each query."""
    model = gemma.model
    ids = kjv_ids[:, :600]
    seen = {}

    class Keep:
        def observe(self, module, query, key, *, mask, causal, **_):
            seen.setdefault(module.layer_idx, mask)

    with torch.no_grad():
        model(ids, logits_to_keep=1, use_cache=False, multihead_observer=Keep())
    window = model.config.sliding_window
    dense = seen[0].to_dense(1, 1, 600, 600, device=torch.device("cpu"))[0, 0]
    q, k = torch.arange(600)[:, None], torch.arange(600)[None, :]
    assert torch.equal(dense, (k <= q) & (q - k < window))


def test_greedy_generate_past_the_window_gives_sdpas_tokens(gemma, kjv_ids):
    model = gemma.model
    prompt = kjv_ids[:, :600]  # past the 512-token window: the windowed layers' cache must cut it
    with torch.no_grad():
        ours = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
        model.set_attn_implementation("sdpa")
        try:
            theirs = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                    do_sample=False)
        finally:
            model.set_attn_implementation("multihead")
    assert torch.equal(ours, theirs), (ours[0, 600:], theirs[0, 600:])
