"""multihead.inspect.capture on the real model (all-MiniLM-L6-v2), a local HF folder,
a lab checkpoint and a plugged-in source; bad input says what is valid."""

from __future__ import annotations

import dataclasses
import importlib
import json

import pytest
import torch

pytest.importorskip("transformers")

from conftest import assert_close  # noqa: E402
from multihead.inspect import capture  # noqa: E402
from multihead.interop.loaded import LoadedModel  # noqa: E402
from multihead.interop.loaders import (  # noqa: E402
    InspectError,
    TruncationWarning,
    load_model,
    minilm_path,
    register_loader,
)
from multihead.kernels import math as explicit_math  # noqa: E402
from multihead.kernels.registry import BACKENDS  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


TEXT = "The cat sat on the mat."


@pytest.fixture(scope="module")
def minilm():
    return load_model("minilm")  # loaded once per process; later calls reuse it


@pytest.fixture(scope="module")
def eager():
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(minilm_path()), attn_implementation="eager").eval()


def test_capture_all_heads_equals_eager(minilm, eager):
    cap = capture(TEXT)
    assert cap.tokens == ["[CLS]", "the", "cat", "sat", "on", "the", "mat", ".", "[SEP]"]
    assert (cap.n_layers, cap.n_heads, cap.layers, cap.heads) == (6, 12, list(range(6)), list(range(12)))
    assert cap.weights.shape == (6, 12, 9, 9) and cap.weights.dtype == torch.float32
    assert_close(cap.weights.sum(-1), torch.ones(6, 12, 9), atol=1e-5, rtol=0, what="rows sum to 1")
    with torch.no_grad():
        ref = eager(torch.tensor([cap.token_ids]), output_attentions=True).attentions
    d = assert_close(cap.weights, torch.stack([a[0] for a in ref]), atol=1e-5, rtol=0, what="capture vs eager")
    print(f"capture vs eager output_attentions: max |diff| {d:.1e}")
    assert cap.model.startswith("minilm") and cap.meta["model_type"] == "bert" and cap.meta["causal"] is False


def test_layer3_head5_asks_the_kernel_for_that_head_only(minilm, eager, monkeypatch):
    calls, explicit = [], []
    real_pass = explicit_math.weights_pass

    def spy_pass(q, k, mask, causal, scale, heads, **kw):
        calls.append(tuple(heads))
        return real_pass(q, k, mask, causal, scale, heads, **kw)

    monkeypatch.setattr(explicit_math, "weights_pass", spy_pass)  # records the heads each weights pass computes
    # the explicit backends would build every head's (T, S) block: they must not run
    for name in ("math", "chunked"):
        b = BACKENDS[name]

        def spy(*a, _fn=b.fn, _name=name, **k):
            explicit.append(_name)
            return _fn(*a, **k)

        monkeypatch.setitem(BACKENDS, name, dataclasses.replace(b, fn=spy))  # records any call (see above)
    ran = []
    hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: ran.append(i)) for i, layer in enumerate(minilm.layers)]
    try:
        cap = capture(TEXT, layers=[3], heads=[5])
    finally:
        for h in hooks:
            h.remove()
    assert calls == [(5,)], f"weights pass asked for {calls}"
    assert not explicit
    assert ran == [0, 1, 2, 3], f"layers run: {ran} (the forward stops after the last layer asked)"
    assert cap.weights.shape == (1, 1, 9, 9) and (cap.layers, cap.heads) == ([3], [5])
    with torch.no_grad():
        ref = eager(torch.tensor([cap.token_ids]), output_attentions=True).attentions[3][0, 5]
    assert_close(cap.head(3, 5), ref, atol=1e-5, rtol=0, what="layer 3 head 5")


def test_indices_negative_unordered_and_duplicates(minilm):
    cap = capture(TEXT, layers=[-1, 0, 0], heads=5)
    assert cap.layers == [0, 5] and cap.heads == [5]
    assert cap.weights.shape == (2, 1, 9, 9)


def test_truncation_warns_and_records(minilm):
    text = "word " * 600
    with pytest.warns(TruncationWarning, match=r"602 tokens, longer than the model's positions \(512\); "
                                               r"truncated to the first 512"):
        cap = capture(text, layers=0, heads=2)
    assert len(cap.tokens) == 512 and cap.tokens[0] == "[CLS]" and cap.tokens[-1] == "[SEP]"
    assert cap.meta["truncated"] == {"tokens": 602, "kept": 512, "limit": 512, "reason": "the model's positions"}
    assert cap.weights.shape == (1, 1, 512, 512)
    with pytest.warns(TruncationWarning, match=r"longer than max_tokens \(5\)"):
        short = capture(TEXT, max_tokens=5, layers=0, heads=0)
    assert short.tokens == ["[CLS]", "the", "cat", "sat", "[SEP]"]


@pytest.mark.parametrize("kwargs, error, message", [
    ({"text": ""}, InspectError, "text is empty"),
    ({"text": "   \n"}, InspectError, "text is empty"),
    ({"text": None}, TypeError, "^text must be a string; received NoneType$"),
    ({"layers": [6]}, InspectError, r"layer 6 is out of range; valid: 0..5 \(the model has 6 layers\)"),
    ({"layers": [-7]}, InspectError, r"layer -7 is out of range; valid: 0..5"),
    ({"heads": [12]}, InspectError, r"head 12 is out of range; valid: 0..11 \(the model has 12 heads\)"),
    ({"heads": []}, InspectError, r"heads is empty; valid: 0..11"),
    ({"heads": "2"}, TypeError, "^heads must be an int or a list of ints; received '2'$"),
    ({"layers": [1.0]}, TypeError, r"^a layer index must be an int; received 1.0 \(float\)$"),
    ({"max_tokens": 0}, ValueError, "^max_tokens must be an int >= 1 or None; received 0$"),
    ({"max_tokens": 2.5}, TypeError, r"^max_tokens must be an int >= 1 or None; received 2.5 \(float\)$"),
])
def test_bad_input(minilm, kwargs, error, message):
    args = {"text": TEXT, **kwargs}
    with pytest.raises(error, match=message):
        capture(args.pop("text"), **args)


def test_bad_model_specs(tmp_path):
    with pytest.raises(InspectError, match=r"model '.*nope' not found: no such folder\. valid: 'minilm'"):
        capture(TEXT, model=str(tmp_path / "nope"))
    with pytest.raises(InspectError, match="is not a model folder: it has no config.json"):
        capture(TEXT, model=str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InspectError, match="config.json does not parse"):
        capture(TEXT, model=str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(InspectError, match="not a Hugging Face model folder: its config.json has no model_type"):
        capture(TEXT, model=str(tmp_path))
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(InspectError, match="is a file; give the model's folder"):
        capture(TEXT, model=str(tmp_path / "notes.txt"))
    with pytest.raises(TypeError, match="model must be a name or a path; received int"):
        capture(TEXT, model=3)


def test_local_hf_folder_causal_model(tmp_path, minilm):
    """A Llama (GQA) saved to a folder with a tokenizer: captured causal weights equal eager."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    tok = minilm.tokenizer
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=16)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.warns(TruncationWarning, match=r"longer than the model's positions \(16\)"):
        cap = capture("one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen",
                      model=str(tmp_path))
    assert cap.weights.shape == (2, 4, 16, 16) and cap.meta["causal"] is True and cap.meta["n_kv_heads"] == 2
    assert (cap.weights.triu(1) == 0).all()
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        attns = ref(torch.tensor([cap.token_ids]), output_attentions=True).attentions
    assert_close(cap.weights, torch.stack([a[0] for a in attns]), atol=1e-5, rtol=0, what="llama folder")


def test_model_tokenizer_pair(minilm):
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = minilm.tokenizer
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=32, vocab_size=len(tok)))
    cap = capture("a b c", model=(model, tok))
    assert cap.weights.shape == (1, 2, 5, 5) and cap.meta["model_type"] == "gpt2"
    with pytest.raises(InspectError, match="not a Hugging Face tokenizer"):
        capture("a b c", model=(model, "tokenizer"))


def test_lab_checkpoint(tmp_path):
    from multihead.checkpoint import Vocab, save_lab_checkpoint
    from multihead.decoder import LabConfig, LabTransformer

    torch.manual_seed(0)
    model = LabTransformer(LabConfig(vocab_size=12, max_len=8, d_model=32, n_layers=2, n_heads=4, mlp=False))
    vocab = Vocab("symbols", tuple(str(i) for i in range(11)) + ("SEP",))
    save_lab_checkpoint(tmp_path / "model", model, vocab, experiment="induction")
    with pytest.warns(TruncationWarning, match=r"longer than the model's positions \(8\)"):
        cap = capture("1 2 3 SEP 1 2 3 SEP 4", model=str(tmp_path), heads=[1, 3])  # an output folder
    assert cap.tokens == ["1", "2", "3", "SEP", "1", "2", "3", "SEP"] and cap.weights.shape == (2, 2, 8, 8)
    assert cap.meta["model_type"] == "multihead-lab/induction" and cap.meta["causal"] is True
    with torch.no_grad():
        _, ref = model(torch.tensor([cap.token_ids]), return_weights=True, heads=[1, 3])
    assert_close(cap.weights, torch.stack([ref[0][0], ref[1][0]]), atol=1e-6, rtol=0, what="lab capture")
    with pytest.raises(InspectError, match="does not know: 'x'"):
        capture("1 x", model=str(tmp_path))


class Diagonal(LoadedModel):
    """A plugged-in source: every head attends to the current token."""

    name, n_layers, n_heads, max_positions, causal, special_tokens = "diag", 2, 3, 10, True, ()
    meta = {"causal": True}

    def encode(self, text, max_length=None):
        ids = [len(w) for w in text.split()]
        return ids[:max_length] if max_length else ids

    def tokens(self, ids):
        return [str(i) for i in ids]

    def attention(self, ids, heads):
        T = ids.shape[1]
        return {layer: torch.eye(T).expand(ids.shape[0], len(h), T, T) for layer, h in heads.items()}


def test_register_loader(tmp_path, monkeypatch):
    loaders = importlib.import_module("multihead.interop.loaders")
    monkeypatch.setattr(loaders, "_LOADERS", [])  # this test's loader goes away after it
    (tmp_path / "config.json").write_text(json.dumps({"diag": True}))
    register_loader(lambda folder, config: Diagonal() if config.get("diag") else None)
    cap = capture("a bb ccc", model=str(tmp_path), layers=1)
    assert cap.tokens == ["1", "2", "3"] and cap.weights.shape == (1, 3, 3, 3)
    assert torch.equal(cap.weights[0, 0], torch.eye(3))
    assert capture("a", model=Diagonal()).weights.shape == (2, 3, 1, 1)


def test_loading_shows_no_weight_loading_bar_and_restores_the_setting(capfd):
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()
    load_model()
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "it/s" not in err, err[-300:]
    assert hf_logging.is_progress_bar_enabled()  # the user's setting is left as it was
