"""transformers' own model tests that lean hardest on the attention registry, for Llama,
Qwen2, Mistral, GPT-2 and Gemma 3 (tiny random configs, `hf_tiny`): eager, sdpa and
multihead against eager in float64 on a left-padded batch; packed sequences under a custom
4-D mask (bool and additive float) equal to each sequence alone; greedy generate, dynamic
and static cache, left-padded, equal to sdpa's tokens and logits; gradient checkpointing's
gradients equal to the plain backward's and to sdpa's. The compiled cases are in
test_hf_compile.py."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_close

pytest.importorskip("transformers")
from hf_tiny import MODELS, WINDOW, batch, build, real_rows  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# float32 logits of width-64 models whose logits are O(1): kernels that sum in another
# order differ by a few float32 ulps per layer; against float64, the float32 rounding itself
ATOL = 2e-5


def _logits(model, impl, inputs, **kw):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(**inputs, **kw).logits


def _alone_float64(model, inputs) -> torch.Tensor:
    """The reference: each row's real tokens alone (no padding, their own positions), by
    transformers' eager attention in float64, concatenated as `real_rows` orders them.
    (Not the padded batch in float64: eager gives its padded rows NaN there, which their
    keys then hand every row through a 0 weight.)"""
    model.double()
    rows = []
    for ids, keep in zip(inputs["input_ids"], inputs["attention_mask"].bool()):
        pos = torch.arange(len(ids))[keep][None]
        rows.append(_logits(model, "eager", {"input_ids": ids[keep][None], "position_ids": pos})[0])
    model.float()
    return torch.cat(rows)


@pytest.mark.parametrize("name", MODELS)
def test_eager_sdpa_multihead_equal_float64_eager(name):
    model = build(name)
    inputs = batch()
    keep = inputs["attention_mask"]
    ref = _alone_float64(model, inputs)
    worst = {}
    for impl in ("eager", "sdpa", "multihead"):
        got = real_rows(_logits(model, impl, inputs), keep)
        worst[impl] = assert_close(got, ref, atol=ATOL, rtol=0, what=f"{name} {impl} vs float64 eager")
    with torch.no_grad():
        model.lm_head.weight.mul_(1.01)  # the test can fail: a 1% change of the head is seen
    assert (real_rows(_logits(model, "multihead", inputs), keep) - ref).abs().max() > 10 * ATOL
    print(name, ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))


def _packed(dtype):
    """Two sequences of 5 and 4 tokens (no longer than the window) packed in one row: ids
    `(1, 9)`, position ids restarting at 0, and the 4-D mask `(1, 1, 9, 9)` letting each
    token see its own sequence's past only (bool, or 0 / finfo.min added to the scores)."""
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(3, 101, (1, WINDOW), generator=g), torch.randint(3, 101, (1, 4), generator=g)
    ids = torch.cat([a, b], dim=1)
    pos = torch.cat([torch.arange(WINDOW), torch.arange(4)])[None]
    seq = torch.tensor([0] * WINDOW + [1] * 4)
    allowed = (seq[:, None] == seq[None, :]) & (torch.arange(9)[:, None] >= torch.arange(9)[None, :])
    mask = allowed if dtype == torch.bool else torch.zeros(9, 9).masked_fill(~allowed, torch.finfo(dtype).min)
    return a, b, ids, pos, mask[None, None]


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32], ids=["bool", "float"])
@pytest.mark.parametrize("name", MODELS)
def test_custom_4d_mask_packs_sequences(name, dtype):
    model = build(name)
    a, b, ids, pos, mask = _packed(dtype)
    packed = _logits(model, "multihead", {"input_ids": ids, "attention_mask": mask, "position_ids": pos})
    alone = torch.cat([_logits(model, "multihead", {"input_ids": a}), _logits(model, "multihead", {"input_ids": b})],
                      dim=1)
    d = assert_close(packed, alone, atol=ATOL, rtol=0, what=f"{name} packed vs each alone")
    sdpa = _logits(model, "sdpa", {"input_ids": ids, "attention_mask": mask, "position_ids": pos})
    assert_close(packed, sdpa, atol=ATOL, rtol=0, what=f"{name} packed vs sdpa")
    print(f"{name} {dtype}: packed vs alone {d:.1e}")


@pytest.mark.parametrize("cache", [None, "static"], ids=["dynamic", "static"])
@pytest.mark.parametrize("name", MODELS)
def test_greedy_generate_left_padded_equals_sdpa(name, cache):
    """A static cache hands the prefill more key slots than tokens and every decode step the
    whole cache under a mask; generate builds those masks ahead of the forward."""
    model = build(name)
    inputs = batch()
    out = {}
    for impl in ("sdpa", "multihead"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            out[impl] = model.generate(**inputs, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                                       cache_implementation=cache, pad_token_id=0, output_logits=True,
                                       return_dict_in_generate=True)
    assert torch.equal(out["multihead"].sequences, out["sdpa"].sequences), \
        f"{name} {cache}: {out['multihead'].sequences} vs {out['sdpa'].sequences}"
    assert_close(torch.stack(out["multihead"].logits), torch.stack(out["sdpa"].logits), atol=ATOL, rtol=0,
                 what=f"{name} {cache} generate logits")


def _grads(model, impl, inputs, checkpointing):
    model.set_attn_implementation(impl)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    model.zero_grad()
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    model(**inputs, labels=labels).loss.backward()
    model.eval()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", MODELS)
def test_gradient_checkpointing_gradients_equal(name):
    model = build(name)
    inputs = batch()
    plain = _grads(model, "multihead", inputs, False)
    checked = _grads(model, "multihead", inputs, True)
    sdpa = _grads(model, "sdpa", inputs, True)
    assert plain.keys() == checked.keys() == sdpa.keys() and len(plain) > 10
    attn = [n for n in plain if any(s in n for s in ("q_proj", "c_attn"))]
    assert attn and all(plain[n].abs().max() > 0 for n in attn), f"{name}: no gradient reached the attention"
    worst = 0.0
    for n in plain:
        scale = plain[n].abs().max().item() + 1e-3  # gradients of different sizes: float32 error relative to each
        worst = max(worst, assert_close(checked[n] / scale, plain[n] / scale, atol=1e-5, rtol=0,
                                        what=f"{name} {n} checkpointed"))
        assert_close(sdpa[n] / scale, plain[n] / scale, atol=1e-4, rtol=0, what=f"{name} {n} sdpa")
    print(f"{name}: checkpointed vs plain, relative {worst:.1e}")
