"""inspect's tools leave a model they were handed as it came: `capture`, `summaries` and
`induction_scores` run it in eval mode on multihead's attention and put back every
submodule's train/eval flag, each parameter's requires_grad, the attention implementation
and the hooks, on success and when the call raises. What they compute is the eval-mode
model's (no dropout in the weights), checked against an eval copy run the same way."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import attn_implementation, hooks  # noqa: E402
from multihead.inspect import capture, induction_scores, summaries  # noqa: E402
from multihead.interop.loaders import InspectError, load_model, minilm_path  # noqa: E402
from multihead.model_state import kept_state  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT = "The cat sat on the mat."


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(str(minilm_path()))


def _bert(vocab: int):
    """A small BERT with dropout everywhere (0.5: a train-mode run could not go unnoticed),
    in train mode on sdpa, its first layer in eval and two parameters frozen: a state with
    something to lose at every level."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  vocab_size=vocab, max_position_embeddings=64, attn_implementation="sdpa",
                                  attention_probs_dropout_prob=0.5, hidden_dropout_prob=0.5)
    model = transformers.BertModel(cfg).train()
    model.encoder.layer[0].eval()
    model.embeddings.word_embeddings.weight.requires_grad_(False)
    model.pooler.dense.bias.requires_grad_(False)
    return model


def _state(model) -> tuple:
    return ([m.training for m in model.modules()], [p.requires_grad for p in model.parameters()],
            attn_implementation(model.config), tuple(hooks(m) for m in model.modules()))


def _eval_copy(model):
    return copy.deepcopy(model).eval()


@pytest.mark.parametrize("call", ["capture", "summaries", "induction_scores"])
def test_a_train_mode_model_comes_back_as_it_came(tok, call):
    model = _bert(len(tok))
    before = _state(model)
    assert before[0].count(False) > 0 and before[0].count(True) > 0 and before[2] == "sdpa"
    ref = _eval_copy(model)
    if call == "capture":
        got, want = capture(TEXT, model=(model, tok)).weights, capture(TEXT, model=(ref, tok)).weights
    elif call == "summaries":
        got = summaries((model, tok), TEXT).scores["entropy"]
        want = summaries((ref, tok), TEXT).scores["entropy"]
    else:
        got, want = induction_scores((model, tok), seq_len=6, batch=1), induction_scores((ref, tok), seq_len=6, batch=1)
    assert _state(model) == before
    torch.testing.assert_close(got, want, atol=0, rtol=0)  # the run was the eval-mode model's: no dropout


@pytest.mark.parametrize("call", ["capture", "summaries", "induction_scores"])
def test_a_call_that_raises_leaves_the_model_as_it_came(tok, call):
    """Each raises after the model was loaded (switched to multihead, in eval mode)."""
    model = _bert(len(tok))
    before = _state(model)
    with pytest.raises((InspectError, ValueError)):
        if call == "capture":
            capture(TEXT, model=(model, tok), layers=[5])
        elif call == "summaries":
            summaries((model, tok), TEXT, top_k=-1)
        else:
            induction_scores((model, tok), seq_len=1)
    assert _state(model) == before


def test_a_loaded_model_put_in_train_mode_stays_there(tok):
    """A LoadedModel (already on multihead's attention) whose model the caller trains: the
    summaries are the eval-mode model's, and the caller's model is still training after."""
    lm = load_model((_bert(len(tok)), tok))
    lm.model.train()
    want = summaries(load_model((_eval_copy(lm.model), tok)), TEXT).scores["entropy"]
    got = summaries(lm, TEXT).scores["entropy"]
    assert all(m.training for m in lm.model.modules()) and attn_implementation(lm.model.config) == "multihead"
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_kept_state_restores_what_the_block_changed_and_ignores_what_is_not_a_model(tok):
    model = _bert(len(tok))
    before = _state(model)
    with pytest.raises(RuntimeError, match="inside"), kept_state(model):
        model.eval()
        for p in model.parameters():
            p.requires_grad_(not p.requires_grad)
        model.set_attn_implementation("eager")
        raise RuntimeError("inside")
    assert _state(model) == before
    with kept_state("minilm"), kept_state(None):
        pass
