"""The HF attention function's decode step reads `config.output_attentions` per call without
transformers' attribute machinery where the config's class allows it: held against
transformers' own attribute read, on real config classes, on configs whose flag is not
transformers' plain property, and across a change of the module's config between calls."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_close

transformers = pytest.importorskip("transformers")
from multihead.interop.hf import registry  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _qkv(B=1, H=6, Hkv=2, T=1, S=11, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, D, generator=g), torch.randn(B, Hkv, S, D, generator=g),
            torch.randn(B, Hkv, S, D, generator=g))


def _weights(q, k, scale):
    """softmax(q k^T scale) with the K heads repeated (float64), as eager attention computes it."""
    G = q.shape[1] // k.shape[1]
    return torch.softmax(q.double() @ k.double().repeat_interleave(G, dim=1).transpose(-2, -1) * scale, dim=-1)


class _Layer(torch.nn.Module):
    is_causal = True

    def __init__(self, config):
        super().__init__()
        self.config = config


_CONFIGS = [transformers.LlamaConfig, transformers.GPT2Config, transformers.BertConfig, transformers.T5Config]


@pytest.mark.parametrize("cls", _CONFIGS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("flag", [False, True])
def test_config_flag_equals_transformers_read(cls, flag):
    config = cls(output_attentions=flag)
    layer = _Layer(config)
    # the registry's own read of the flag, white-box: compile needs it to be a read dynamo can trace
    assert registry._config_output_attentions(layer) == config.output_attentions == flag
    q, k, v = _qkv()
    out, w = registry.attention_forward(layer, q, k, v, None, scaling=0.3)
    assert (w is not None) == flag
    if flag:
        assert_close(w, _weights(q, k, 0.3).float(), atol=1e-6, rtol=0, what=f"{cls.__name__} weights")
    ref, _ = registry.attention_forward(_Layer(None), q, k, v, None, scaling=0.3)
    assert torch.equal(out, ref)


def test_a_changed_config_is_seen_at_the_next_call():
    q, k, v = _qkv()
    layer = _Layer(transformers.LlamaConfig())
    for flag in (False, True, False, True):
        layer.config = transformers.LlamaConfig(output_attentions=flag)
        _, w = registry.attention_forward(layer, q, k, v, None, scaling=0.3)
        assert (w is not None) == flag
    layer.config.__dict__["_output_attentions"] = False  # the field itself, changed on the same config
    assert registry.attention_forward(layer, q, k, v, None, scaling=0.3)[1] is None


class _AlwaysWeights(transformers.LlamaConfig):
    """A config whose flag is its own property, not the field transformers' property reads."""

    @property
    def output_attentions(self):
        return True

    @output_attentions.setter
    def output_attentions(self, value):
        self._output_attentions = value


class _Renamed(transformers.LlamaConfig):
    attribute_map = {"output_attentions": "want_weights"}
    want_weights = False

    def __init__(self, want_weights=False, **kwargs):
        super().__init__(**kwargs)
        self.want_weights = want_weights


class _PlainFlag:
    def __init__(self, flag):
        self.output_attentions = flag


@pytest.mark.parametrize("config, flag", [(_AlwaysWeights(), True), (_Renamed(want_weights=True), True),
                                          (_Renamed(want_weights=False), False), (_PlainFlag(True), True),
                                          (_PlainFlag(False), False), (object(), False)],
                         ids=["own property", "renamed, on", "renamed, off", "plain attribute, on",
                              "plain attribute, off", "no flag"])
def test_configs_of_other_kinds_are_read_as_written(config, flag):
    layer = _Layer(config)
    # the registry's own read of the flag, white-box, as above
    assert registry._config_output_attentions(layer) == getattr(config, "output_attentions", False) == flag
    q, k, v = _qkv()
    _, w = registry.attention_forward(layer, q, k, v, None, scaling=0.3)
    assert (w is not None) == flag


def test_the_keyword_wins_over_the_config():
    q, k, v = _qkv()
    on, off = _Layer(transformers.LlamaConfig(output_attentions=True)), _Layer(transformers.LlamaConfig())
    assert registry.attention_forward(on, q, k, v, None, scaling=0.3, output_attentions=False)[1] is None
    w = registry.attention_forward(off, q, k, v, None, scaling=0.3, output_attentions=True)[1]
    assert_close(w, _weights(q, k, 0.3).float(), atol=1e-6, rtol=0, what="weights by keyword")
