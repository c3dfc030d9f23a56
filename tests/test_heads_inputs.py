"""Every head tool that compares a clean and a corrupted run (patch_scan, attribution_scan,
path_patch, path_patch_scan) checks its inputs and metric the same way (`heads._inputs`):
a KV cache in the inputs, lists or arrays for ids, a metric that returns no real scalar and
a wrong `variants_per_run` are refused by name before any forward; and a transformers model
converted to MLA (`convert.to_mla`) is patched, or refused with the true reason."""

from __future__ import annotations

import pytest
import torch

from multihead import heads

pytestmark = pytest.mark.usefixtures("one_torch_thread")

transformers = pytest.importorskip("transformers")

import multihead.interop.hf  # noqa: E402, F401  (registers "multihead")
from multihead.convert import to_mla  # noqa: E402

V = 40
COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, vocab_size=V, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=32, initializer_range=0.25)


def _llama(cls=None, config=None):
    torch.manual_seed(0)
    cls = cls or transformers.LlamaForCausalLM
    config = config or transformers.LlamaConfig
    model = cls(config(**COMMON)).eval()
    model.set_attn_implementation("multihead")
    return model


@pytest.fixture(scope="module")
def llama():
    return _llama()


def _pair(B: int = 2, T: int = 9):
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, V, (B, T), generator=g), torch.randint(3, V, (B, T), generator=g)


def _metric(logits):
    return (logits[:, -1, 3] - logits[:, -1, 4]).mean()


TOOLS = {
    "patch_scan": lambda m, c, x, f, **kw: heads.patch_scan(m, c, x, f, **kw),
    "attribution_scan": lambda m, c, x, f, **kw: heads.attribution_scan(m, c, x, f, **kw),
    "path_patch": lambda m, c, x, f, **kw: heads.path_patch(m, c, x, f, [(0, 1)], [(1, 0)], **kw),
    "path_patch_scan": lambda m, c, x, f, **kw: heads.path_patch_scan(m, c, x, f, [(1, 0)], **kw),
}


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("key", ["past_key_values", "use_cache"])
def test_a_cache_in_the_inputs_is_refused_by_name_and_left_empty(llama, tool, key):
    clean, corrupted = _pair()
    caches = [transformers.DynamicCache(), transformers.DynamicCache()]
    value = (lambda i: caches[i]) if key == "past_key_values" else (lambda i: True)
    with pytest.raises(ValueError, match=f"carries {key}"):
        TOOLS[tool](llama, {"input_ids": clean, key: value(0)}, {"input_ids": corrupted, key: value(1)}, _metric)
    assert all(c.get_seq_length() == 0 for c in caches), "the caller's cache was written"


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("kind", ["list", "numpy"])
def test_ids_that_are_no_tensor_are_refused_naming_what_was_received(llama, tool, kind):
    clean, corrupted = _pair()
    convert = (lambda t: t.tolist()) if kind == "list" else (lambda t: t.numpy())
    name = "list" if kind == "list" else "ndarray"
    with pytest.raises(TypeError, match=f"both be tensors.*received {name} and {name}$"):
        TOOLS[tool](llama, convert(clean), convert(corrupted), _metric)


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("bad, named", [(None, "NoneType"), ("x", "str"), ({"a": 1}, "dict"), (1 + 2j, "complex"),
                                        (torch.tensor(1 + 2j), "complex64")])
def test_a_metric_returning_no_real_scalar_is_refused_naming_it(llama, tool, bad, named):
    clean, corrupted = _pair()
    with pytest.raises(TypeError, match=f"metric must return .*{named}"):
        TOOLS[tool](llama, clean, corrupted, lambda logits: bad)


@pytest.mark.parametrize("tool", ["patch_scan", "path_patch_scan"])
def test_variants_per_run_a_wrong_type_is_type_error_and_a_wrong_value_value_error(llama, tool):
    clean, corrupted = _pair()
    for bad in (1.5, "2", True):
        with pytest.raises(TypeError, match="variants_per_run must be an int"):
            TOOLS[tool](llama, clean, corrupted, _metric, variants_per_run=bad)
    with pytest.raises(ValueError, match=r"variants_per_run must be an int >= 1 or None; received 0"):
        TOOLS[tool](llama, clean, corrupted, _metric, variants_per_run=0)


def test_an_exactly_converted_mla_model_patches_as_the_model_it_came_from(llama):
    """to_mla at full rank (R = Hkv * Dv, every rotary pair kept) computes the model it came
    from, head for head: every tool's table on it equals the original's (float32 rounding of
    the SVD and of the absorbed products, well under 1e-4 of the table's scale)."""
    mla = to_mla(llama, 16, rope_dim=16)
    clean, corrupted = _pair()
    for name, tool in (("patch_scan", lambda m: heads.patch_scan(m, clean, corrupted, _metric)),
                       ("path_patch_scan q", lambda m: heads.path_patch_scan(m, clean, corrupted, _metric, [(2, 1)])),
                       ("path_patch_scan logits",
                        lambda m: heads.path_patch_scan(m, clean, corrupted, _metric, "logits")),
                       ("path_patch", lambda m: torch.tensor(heads.path_patch(m, clean, corrupted, _metric,
                                                                              [(0, 1), (1, 2)], [(2, 0)]))),
                       ("attribution_scan", lambda m: heads.attribution_scan(m, clean, corrupted, _metric))):
        want, got = tool(llama), tool(mla)
        diff = float((got - want).abs().max())
        assert diff < 1e-4 * (1 + float(want.abs().max())), f"{name}: max diff {diff:.2e}"


def test_an_mla_model_whose_latent_the_tools_cannot_see_is_refused_with_that_reason():
    qwen3 = _llama(transformers.Qwen3ForCausalLM, transformers.Qwen3Config)
    mla = to_mla(qwen3, 16, rope_dim=16)
    clean, corrupted = _pair()
    for tool in TOOLS.values():
        with pytest.raises(ValueError, match="without kv_a_proj") as info:
            tool(mla, clean, corrupted, _metric)
        assert "ALBERT" not in str(info.value)
