"""A sliding-window layer's decode step on attn_implementation="multihead": where the window
holds every key of the layer's cache (transformers' sliding-window cache keeps just the
window) and nothing is padded, the mask builder hands the attention function no mask, so
the step takes the kernel's plain path; where a key is hidden (padding), the mask stays.
Held against transformers' sdpa on a tiny random Gemma 3 (MQA, QK-norm, two windowed
layers and one global), prompts longer than the window."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_close

transformers = pytest.importorskip("transformers")
from multihead.interop import hf  # noqa: E402, F401  (registers "multihead")
from multihead.interop.hf import registry  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = 6


def _gemma():
    cfg = transformers.Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, sliding_window=WINDOW, vocab_size=101, max_position_embeddings=128, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(cfg).eval()


def _spy(monkeypatch) -> list:
    """Records (layer, T, S, the mask the attention function received) of every call."""
    seen = []
    real = registry.attention_forward

    def spy(module, query, key, value, attention_mask, *args, **kwargs):
        seen.append((module.layer_idx, query.shape[2], key.shape[2], attention_mask))
        return real(module, query, key, value, attention_mask, *args, **kwargs)

    # the mask the kernel receives is observable only inside the registered attention function
    monkeypatch.setattr(registry, "attention_forward", spy)
    hf.register("multihead_spied")  # a partial of the spy, registered now
    return seen


def _generate(model, impl: str, ids, mask=None, new=6):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)


def test_decode_steps_in_a_full_window_get_no_mask_and_sdpas_tokens(monkeypatch):
    model = _gemma()
    ids = torch.randint(3, 101, (1, 3 * WINDOW), generator=torch.Generator().manual_seed(1))
    ref = _generate(model, "sdpa", ids)
    seen = _spy(monkeypatch)
    got = _generate(model, "multihead_spied", ids)
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.logits, ref.logits):
        assert_close(a, b, atol=1e-5, rtol=0, what="decode logits, window layers without a mask")
    decode = [(layer, S, m) for layer, T, S, m in seen if T == 1]
    assert len(decode) == 3 * 5  # 3 layers x the 5 forwards after the prompt's
    assert all(m is None for _, _, m in decode)
    assert {S for layer, S, _ in decode if layer < 2} == {WINDOW}  # the windowed cache holds the window only
    assert max(S for layer, S, _ in decode if layer == 2) == 3 * WINDOW + 5


def test_a_prefill_no_longer_than_the_window_is_plain_causal(monkeypatch):
    model = _gemma()
    ids = torch.randint(3, 101, (1, WINDOW), generator=torch.Generator().manual_seed(2))
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        ref = model(ids).logits
    seen = _spy(monkeypatch)
    model.set_attn_implementation("multihead_spied")
    with torch.no_grad():
        got = model(ids).logits
    assert_close(got, ref, atol=1e-5, rtol=0, what="prefill of one window")
    assert [m for *_, m in seen] == [None, None, None]


def test_padded_decode_steps_keep_their_mask_while_the_window_holds_a_pad(monkeypatch):
    """Row 2 is left-padded at positions 0 and 1 of a 5-token prompt: the windowed layers'
    first two steps (queries at 5 and 6, windows from 0 and 1) see a pad and keep their mask,
    the next two (windows from 2 and 3) hold none and get no mask."""
    model = _gemma()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 101, (2, WINDOW - 1), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    ids[1, :2] = 0
    ref = _generate(model, "sdpa", ids, mask, new=5)
    seen = _spy(monkeypatch)
    got = _generate(model, "multihead_spied", ids, mask, new=5)
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.logits, ref.logits):
        assert_close(a, b, atol=1e-5, rtol=0, what="padded decode logits")
    steps = [m for layer, T, S, m in seen if T == 1 and layer == 0]
    assert len(steps) == 4
    assert all(isinstance(m, torch.Tensor) and not bool(m.all()) for m in steps[:2])
    assert steps[2:] == [None, None]


@pytest.mark.parametrize("q_length, kv_length, offset, plain", [
    (1, WINDOW, WINDOW, True),  # a step whose window holds every cached key
    (1, WINDOW + 1, WINDOW, False),  # a key older than the window stays in the cache: hidden
    (WINDOW, WINDOW, 0, True),  # a prefill of one window: causality alone
    (WINDOW - 2, WINDOW - 2, 0, True),
])
def test_the_builder_drops_only_a_mask_that_hides_nothing_but_the_future(q_length, kv_length, offset, plain):
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    fn = sliding_window_causal_mask_function(WINDOW)
    kv_offset = offset + q_length - kv_length if q_length == 1 else 0
    args = dict(batch_size=1, q_length=q_length, kv_length=kv_length, q_offset=offset, kv_offset=kv_offset,
                mask_function=fn, local_size=WINDOW)
    got = registry.multihead_mask(**args)
    ref = sdpa_mask(**args)
    if plain:
        assert got is None
        if ref is not None:  # what it stands for: one query sees every key, or the lower triangle
            expect = torch.ones(q_length, kv_length, dtype=torch.bool).tril(kv_length - q_length)
            assert torch.equal(ref[0, 0], expect)
    else:
        assert torch.equal(got, ref) and not bool(ref.all())
