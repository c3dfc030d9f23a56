"""torch.compile through the registry: `torch.compile(model.forward, fullgraph=True)` on
attn_implementation="multihead" for Llama, Qwen2, Mistral, GPT-2 and Gemma 3 (tiny random
configs, `hf_tiny`: windows shorter than the input, Gemma 3's sliding and global layers).

dynamo's graph breaks are counted by `torch._dynamo.explain` (zero, on a left-padded batch
and with no mask); the compiled logits equal the compiled sdpa model's, a static-cache
greedy generate with the forward compiled gives sdpa's tokens; output_attentions=True
compiles; multihead's own keywords (a WeightsRequest, the heads tools' hooks) are refused by
name inside a compiled forward and run uncompiled where dynamo may fall back. A graph break
put into the attention function (the config read this suite was written after, among
others) fails the check. dynamo runs with backend="eager" (its graph, no code generation:
fast, and fullgraph=True still fails on any break); one case compiles with inductor. All
compile tests live in this one file, so `--dist loadfile` keeps them in one worker."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_close

pytest.importorskip("transformers")
from hf_tiny import MODELS, batch, build, real_rows  # noqa: E402
from multihead.interop.hf import WeightsRequest, registry  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ATOL = 2e-5  # float32 logits O(1), as in test_hf_model_suite


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every model of this file runs the same transformers code objects: their compiled
    entries would pile up to dynamo's recompile limit (a hard failure under fullgraph)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled(model, backend: str = "eager"):
    """`model` with its forward compiled whole (fullgraph: a graph break raises)."""
    model.forward = torch.compile(model.forward, fullgraph=True, backend=backend)
    return model


def explained(model, **inputs) -> tuple[int, list[str], torch.Tensor]:
    """(graph breaks, their reasons' first lines, the logits) of `model(**inputs)` under
    `torch._dynamo.explain` (the logits come back through a list the traced call appends to)."""
    out = []
    with torch.no_grad():
        ex = torch._dynamo.explain(lambda **kw: out.append(model(**kw).logits))(**inputs)
    return ex.graph_break_count, sorted({r.reason.splitlines()[0] for r in ex.break_reasons}), out[0]


@pytest.mark.parametrize("name", MODELS)
def test_forward_compiles_whole_and_equals_compiled_sdpa(name):
    inputs = batch()
    keep = inputs["attention_mask"]
    breaks, reasons, mine = explained(build(name), **inputs)
    assert breaks == 0, f"{name}: {breaks} graph breaks: {reasons}"
    with torch.no_grad():
        ref = compiled(build(name, "sdpa"))(**inputs).logits
        eager = build(name)(**inputs).logits
    d = assert_close(real_rows(mine, keep), real_rows(ref, keep), atol=ATOL, rtol=0, what=f"{name} compiled vs sdpa")
    assert_close(real_rows(mine, keep), real_rows(eager, keep), atol=ATOL, rtol=0, what=f"{name} compiled vs not")
    print(f"{name}: 0 graph breaks, compiled multihead vs compiled sdpa {d:.1e}")


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_forward_without_a_mask_compiles_whole(name):
    """No padding: the prefill is causality alone (the kernel's plain call; Mistral's window
    from transformers' mask builder)."""
    ids = batch()["input_ids"]
    breaks, reasons, mine = explained(build(name, layers=1), input_ids=ids)
    assert breaks == 0, f"{name}: {breaks} graph breaks: {reasons}"
    with torch.no_grad():
        ref = build(name, "sdpa", layers=1)(input_ids=ids).logits
    assert_close(mine, ref, atol=ATOL, rtol=0, what=f"{name} no mask")


def _generate(model, inputs):
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                              cache_implementation="static", pad_token_id=0, output_logits=True,
                              return_dict_in_generate=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_static_cache_generate_compiled_gives_sdpa_tokens(name):
    """The prefill's graph and the decode step's (the whole static cache under a mask), each
    compiled whole: a break in either raises."""
    inputs = batch()
    got = _generate(compiled(build(name)), inputs)
    ref = _generate(build(name, "sdpa"), inputs)
    assert torch.equal(got.sequences, ref.sequences), f"{name}: {got.sequences} vs {ref.sequences}"
    assert_close(torch.stack(got.logits), torch.stack(ref.logits), atol=ATOL, rtol=0, what=f"{name} generate logits")


@pytest.mark.slow
def test_inductor_static_cache_generate_equals_sdpa():
    """One case through inductor's code generation (slow on a CPU: a C++ compile for each of
    the prefill's and the decode step's graphs), against compiled sdpa."""
    inputs = batch()
    got = _generate(compiled(build("llama"), backend="inductor"), inputs)
    want = _generate(compiled(build("llama", "sdpa"), backend="inductor"), inputs)
    assert torch.equal(got.sequences, want.sequences), f"{got.sequences} vs {want.sequences}"
    assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=ATOL, rtol=0, what="inductor logits")


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_output_attentions_compiles(name):
    inputs = batch()
    keep = inputs["attention_mask"].bool()
    model = build(name)
    with torch.no_grad():
        ref = build(name, "eager")(**inputs, output_attentions=True)
        # transformers installs its output-capturing hooks on the first forward that asks for
        # attentions, under a lock dynamo cannot enter (so on every implementation): once, uncompiled
        model(**inputs, output_attentions=True)
        got = compiled(model)(**inputs, output_attentions=True)
    assert len(got.attentions) == len(ref.attentions) == 2
    for i, (a, b) in enumerate(zip(got.attentions, ref.attentions)):
        for row in range(a.shape[0]):  # real query rows (eager gives padded rows a uniform row, multihead zeros)
            assert_close(a[row][:, keep[row]], b[row][:, keep[row]], atol=1e-6, rtol=0, what=f"{name} weights {i}")


def _old_read(module):  # the config read that broke compile: a config's instance dict through object's own lookup
    config = getattr(module, "config", None)
    return False if config is None else object.__getattribute__(config, "__dict__").get("_output_attentions", False)


def _breaking_attend(*args, **kwargs):
    torch._dynamo.graph_break()
    return _real_attend(*args, **kwargs)


_real_attend = registry.attend


def test_a_graph_break_in_the_attention_function_fails(monkeypatch):
    """The config read this file was written after, put back: explain counts its breaks. Any
    other break (`torch._dynamo.graph_break()` in the kernel's call): a whole compile raises."""
    inputs = {"input_ids": batch()["input_ids"]}
    with monkeypatch.context() as m:
        m.setattr(registry, "_config_output_attentions", _old_read)  # the old read back, to show the check bites
        breaks, reasons, _ = explained(build("llama", layers=1), **inputs)
    assert breaks >= 1, f"old config read: {breaks} graph breaks ({reasons}); the check above would not fail"
    torch._dynamo.reset()
    monkeypatch.setattr(registry, "attend", _breaking_attend)  # a graph break injected into the kernel's call
    with pytest.raises(torch._dynamo.exc.Unsupported), torch.no_grad():
        compiled(build("llama", layers=1))(**inputs)


def _request(model):
    return WeightsRequest({model.model.layers[1].self_attn: [0, 3]})


def test_multihead_keywords_refused_inside_a_whole_compile():
    """fullgraph: the registry's ValueError, as dynamo hands it on (inside its Unsupported)."""
    from multihead import heads

    model = compiled(build("llama"))
    inputs = batch()
    with torch.no_grad():
        with pytest.raises(Exception, match=r"multihead_weights= \(a WeightsRequest\) cannot run inside torch.compile"):
            model(**inputs, multihead_weights=_request(model))
        torch._dynamo.reset()
        with pytest.raises(ValueError, match=r"is compiled \(torch.compile\).*valid: the uncompiled model"):
            heads.record(model, inputs)  # the head tools refuse a compiled model before any forward
        torch._dynamo.reset()
        model(**inputs)  # the same compiled model, asked nothing of multihead's: runs


@pytest.mark.slow
def test_multihead_keywords_run_uncompiled_where_dynamo_falls_back():
    """Without fullgraph, dynamo runs the refused frame eagerly: a WeightsRequest's answer is the
    uncompiled model's (and stays so past dynamo's recompile limit, lowered to 2 here); the head
    tools refuse the compiled model by name up front."""
    from multihead import heads

    inputs = batch()
    plain = build("llama")
    # dynamo's own patch, not monkeypatch: monkeypatch's undo deletes a config entry (the config
    # module keeps its values outside its __dict__), and every later compile then fails.
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=2):
        req = _request(plain)
        req.run(plain, **inputs)
        model = build("llama")
        model.forward = torch.compile(model.forward, backend="eager")
        with pytest.raises(ValueError, match=r"is compiled \(torch.compile\)"):
            heads.record(model, inputs, what=("z", "pattern"))
        for _ in range(torch._dynamo.config.recompile_limit + 1):
            mine = _request(model)
            mine.run(model, **inputs)
    assert torch.equal(mine.get(model.model.layers[1].self_attn), req.get(plain.model.layers[1].self_attn))
