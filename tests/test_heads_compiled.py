"""The head tools refuse a compiled model by name (their hooks change on every call, which a
compiled forward takes as a recompile each time), and the uncompiled model still runs."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from multihead import heads  # noqa: E402


@pytest.fixture(scope="module")
def llama():
    import multihead.interop.hf  # noqa: F401 (registers "multihead")

    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=50)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("multihead")
    return model


def _compiled_forward(model):
    model = copy.deepcopy(model)
    model.forward = torch.compile(model.forward)
    return model


def _module_compile(model):
    model = copy.deepcopy(model)
    model.compile()
    return model


@pytest.mark.parametrize("make", [torch.compile, _module_compile, _compiled_forward],
                         ids=["torch.compile(model)", "model.compile()", "compiled forward"])
def test_a_compiled_model_is_refused_by_name(llama, make):
    ids = torch.randint(50, (2, 6), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"is compiled \(torch.compile\).*valid: the uncompiled model"):
        heads.record(make(llama), ids)
    with pytest.raises(ValueError, match=r"is compiled \(torch.compile\)"):
        heads.patch_scan(make(llama), ids, ids.flip(0), lambda logits: logits[:, -1, 0].sum())
    heads.record(llama, ids)  # the model it was compiled from is untouched and still runs
