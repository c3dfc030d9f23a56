"""`multihead inspect` on any model the attention registry reaches.

Tiny random-weight models from transformers' config classes, paired with the bundled
MiniLM tokenizer: the captured weights equal transformers' eager `output_attentions`
of the same layers, including the decoder's cross-attention of an encoder-decoder;
a model whose attention bypasses the registry (Falcon) is refused with the reason.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import assert_close, attn_implementation  # noqa: E402
from multihead.inspect import capture  # noqa: E402
from multihead.interop.loaders import InspectError, minilm_path  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT = "The cat sat on the mat."


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(str(minilm_path()))


def _model(name: str, vocab: int):
    t = transformers
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=vocab,
                  max_position_embeddings=64)
    if name == "gemma2":
        cfg, cls = t.Gemma2Config(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
                                  attn_logit_softcapping=5.0, **common), t.Gemma2Model
    elif name == "qwen3":
        cfg, cls = t.Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=16, **common), t.Qwen3Model
    elif name == "gpt_neox":
        cfg, cls = t.GPTNeoXConfig(num_attention_heads=4, rotary_pct=0.25, **common), t.GPTNeoXModel
    elif name == "deepseek_v2":
        cfg, cls = t.DeepseekV2Config(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24,
                                      qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4,
                                      num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                      moe_intermediate_size=32, **common), t.DeepseekV2Model
    elif name == "bart":
        cfg, cls = t.BartConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=vocab,
                                max_position_embeddings=64), t.BartModel
    elif name == "t5":
        cfg, cls = t.T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=vocab), t.T5Model
    else:
        raise KeyError(name)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    if name == "gemma2":  # scores large enough for the softcap to bite
        with torch.no_grad():
            for layer in model.layers:
                layer.self_attn.q_proj.weight.mul_(12.0)
                layer.self_attn.k_proj.weight.mul_(12.0)
    return model


def _eager_attentions(model, ids) -> list[torch.Tensor]:
    """transformers' eager weights of every attention call, in call order."""
    model.set_attn_implementation("eager")
    inputs = {"input_ids": ids}
    if model.config.is_encoder_decoder:
        inputs["decoder_input_ids"] = ids
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    if not model.config.is_encoder_decoder:
        return list(out.attentions)
    dec = [a for pair in zip(out.decoder_attentions, out.cross_attentions) for a in pair]  # self, cross per layer
    return list(out.encoder_attentions) + dec


@pytest.mark.parametrize("name", ["gemma2", "qwen3", "gpt_neox", "deepseek_v2", "bart", "t5"])
def test_capture_equals_eager(name, tok):
    model = _model(name, len(tok))
    was = attn_implementation(model.config)
    cap = capture(TEXT, model=(model, tok))
    assert was != "multihead" and attn_implementation(model.config) == was  # run on multihead, handed back as it came
    ref = _eager_attentions(model, torch.tensor([cap.token_ids]))
    assert cap.n_layers == len(ref)
    d = assert_close(cap.weights, torch.stack([a[0] for a in ref]), atol=1e-5, rtol=0, what=f"{name} capture")
    if name in ("bart", "t5"):
        assert cap.meta["layer_kinds"] == ["self", "self", "self", "cross", "self", "cross"]
        cross = "layers.0.encoder_attn" if name == "bart" else "block.0.layer.1.EncDecAttention"
        assert cap.meta["layer_names"][3].endswith(cross)
    print(f"{name}: capture vs eager {d:.1e}")


def test_capture_chosen_cross_attention_head(tok):
    model = _model("bart", len(tok))
    cap = capture(TEXT, model=(model, tok), layers=[3], heads=[2])
    ref = _eager_attentions(model, torch.tensor([cap.token_ids]))[3][0, 2]
    assert cap.weights.shape == (1, 1, len(cap.tokens), len(cap.tokens))
    assert_close(cap.head(3, 2), ref, atol=1e-5, rtol=0, what="cross-attention layer 3 head 2")


def test_falcon_is_refused_with_the_reason(tok):
    # Some transformers releases refuse to switch Falcon's implementation, others switch it and
    # the probe forward then sees no registry call: both paths must give the same reason.
    model = transformers.FalconModel(transformers.FalconConfig(hidden_size=64, num_hidden_layers=2,
                                                               num_attention_heads=4, vocab_size=len(tok)))
    with pytest.raises(InspectError, match="does not go through the attention registry"):
        capture(TEXT, model=(model, tok))


def test_falcon_folder_is_refused(tmp_path, tok):
    model = transformers.FalconModel(transformers.FalconConfig(hidden_size=64, num_hidden_layers=1,
                                                               num_attention_heads=4, vocab_size=len(tok)))
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.raises(InspectError, match="Falcon does not"):
        capture(TEXT, model=str(tmp_path))
