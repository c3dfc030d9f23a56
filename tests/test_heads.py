"""multihead.heads: record / ablate / patch / patch_scan against independent references.

- transformers: every registered architecture (tiny random models of the registry tests)
  on attn_implementation="multihead"; ablation against the same weights in *eager*
  transformers with a hand-written hook zeroing that head's slice of the output
  projection's input; patch_scan against one patched forward per head.
- TransformerLens 4 (when installed): `get_act_patch_attn_head_{out,k,v,pattern}_all_pos`
  on the same GPT-2 weights.
- multihead modules: ablation against the NumPy float64 reference with the head's
  columns of W_o zeroed; lab models' scans against one patched forward per head.
- The model is left exactly as it was: state dict and outputs, after exceptions and nesting.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from conftest import hooks
from multihead import heads
from multihead import reference as R
from multihead.attention import Attention
from multihead.decoder import LabConfig, LabTransformer
from multihead.heads.engine import logits_of
from multihead.latent import LatentAttention

pytestmark = pytest.mark.usefixtures("one_torch_thread")

transformers = pytest.importorskip("transformers")

import multihead.interop.hf  # noqa: E402, F401  (registers "multihead")
from multihead.heads import _prefix, _scan_state  # noqa: E402
from multihead.heads import scan as _scan  # noqa: E402
from test_interop_hf_registry import DECODERS, MODELS, V, build  # noqa: E402


def _inputs(name: str, seed: int = 1, pad: bool = True):
    g = torch.Generator().manual_seed(seed)
    if name == "vit":
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=g)}
    ids = torch.randint(3, V, (2, 9), generator=g)
    keep = torch.ones(2, 9, dtype=torch.long)
    if pad:
        keep[1, :2] = 0
    inputs = {"input_ids": ids, "attention_mask": keep}
    if name in ("bart", "t5"):
        inputs["decoder_input_ids"] = ids[:, :5]
    return inputs


def _metric(logits):
    return logits[:, -1, :7].sum() if logits.dim() == 3 else logits.sum()


def _mh(name: str):
    m = build(name)
    m.set_attn_implementation("multihead")
    return m


def _out_module(model, attn):
    """The output projection module after HF attention `attn` (as a reader finds it by hand)."""
    for n in ("o_proj", "out_proj", "c_proj", "dense", "o"):
        if hasattr(attn, n):
            return getattr(attn, n)
    parent = next(m for m in model.modules() if any(c is attn for c in m.children()))
    return parent.output.dense


def _attention_modules(model, inputs):
    found = []
    hooks = [m.register_forward_pre_hook(lambda mod, a, found=found: found.append(mod) if mod not in found else None)
             for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "config")
             and not any(type(c).__name__.endswith("Attention") for c in m.children())]
    with torch.no_grad():
        model(**inputs)
    for h in hooks:
        h.remove()
    return found


@pytest.mark.parametrize("name", MODELS)
def test_ablation_equals_zeroing_the_out_projection_input_in_eager_transformers(name):
    inputs = _inputs(name, pad=False)
    model = _mh(name)
    pairs = [(0, 1), (1, 0)]
    with heads.ablate(model, pairs), torch.no_grad():
        got = logits_of(model(**inputs))
    eager = build(name)
    eager.set_attn_implementation("eager")
    mods = _attention_modules(eager, inputs)
    rec = heads.record(model, inputs)
    hooks = []
    for layer, head in pairs:
        H, Dv = rec["z", layer].shape[2:]

        def zero(mod, args, head=head, Dv=Dv):
            x = args[0].clone()
            x[..., head * Dv:(head + 1) * Dv] = 0
            return (x, *args[1:])
        hooks.append(_out_module(eager, mods[layer]).register_forward_pre_hook(zero))
    with torch.no_grad():
        want = logits_of(eager(**inputs))
    for h in hooks:
        h.remove()
    diff = (got - want).abs().max().item()
    assert diff < 1e-5, f"{name}: ablated multihead vs zeroed eager, max diff {diff:.2e}"
    with torch.no_grad():
        plain = logits_of(eager(**inputs))
    assert (plain - want).abs().max().item() > 1e-4, "the ablation changed nothing: the check could not fail"


@pytest.mark.parametrize("name", MODELS)
def test_patch_scan_equals_one_patched_forward_per_head(name):
    model = _mh(name)
    clean, corrupted = _inputs(name, 1), _inputs(name, 2)
    for what in ("z", "k", "v", "pattern"):
        scan = heads.patch_scan(model, clean, corrupted, _metric, what=what)
        rec = heads.record(model, clean, what=(what,))
        want = torch.full_like(scan, float("nan"))
        for layer in range(scan.shape[0]):
            for h in range(scan.shape[1]):
                if not torch.isnan(scan[layer, h]):
                    with heads.patch(model, rec, [(layer, h)], what=what), torch.no_grad():
                        want[layer, h] = _metric(logits_of(model(**corrupted)))
        diff = (scan - want).abs().nan_to_num().max().item()
        assert diff < 1e-5, f"{name} {what}: scan vs one patched forward per head, max diff {diff:.2e}"
        if what == "z":  # another cut of the variants into forwards: the same table
            other = heads.patch_scan(model, clean, corrupted, _metric, what=what, variants_per_run=3)
            assert (other - scan).abs().nan_to_num().max() < 1e-5
        with torch.no_grad():
            base = _metric(logits_of(model(**corrupted)))
        assert (scan - base).abs().nan_to_num().max() > 1e-6, f"{name} {what}: no head changed the metric"


def test_the_engine_speaks_the_registrys_keywords():
    """heads.engine spells the registry's keywords itself (it must not import transformers)."""
    from multihead.heads import engine as _engine
    from multihead.interop.hf import registry

    assert (_engine.KEYWORD, _engine.WEIGHTS_KEYWORD) == (registry.INTERVENTION_KEYWORD, registry.REQUEST_KEYWORD)


def _one_token_changed(name: str, at: int = 5):
    """IOI-style: corrupted is clean with the token at `at` changed (row 1 left-padded)."""
    clean = _inputs(name, 1)
    corrupted = {k: v.clone() for k, v in clean.items()}
    ids = corrupted["input_ids"]
    ids[:, at] = (ids[:, at] - 3 + 7) % (V - 3) + 3
    return clean, corrupted


def _count_skips(monkeypatch) -> list:
    """Calls of the prefix skip's last-block hook: one for its check run, one per scan forward."""
    calls, real = [], _scan_state.unskip
    # the scan reports no count of forwards through the skip: a spy on its hook counts them
    monkeypatch.setattr(_scan_state, "unskip", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("name", DECODERS)
def test_patch_scan_skips_the_shared_prefix_of_a_causal_model_exactly(name, monkeypatch):
    """Clean and corrupted share positions [0, 5): the variants run on [5, T) only and read
    the corrupted keys/values of the prefix. Equal to one full patched forward per head."""
    model = _mh(name)
    clean, corrupted = _one_token_changed(name)
    calls = _count_skips(monkeypatch)
    for what, positions in [("z", None), ("k", None), ("v", None), ("pattern", None), ("z", [2, 6, -1])]:
        calls.clear()
        info = {}
        scan = heads.patch_scan(model, clean, corrupted, _metric, what=what, positions=positions, info=info)
        assert len(calls) > 1, f"{name} {what}: the prefix skip was not taken"
        assert info == {"prefix": 5, "skipped": True, "reason": ""}, info
        rec = heads.record(model, clean, what=(what,))
        want = torch.full_like(scan, float("nan"))
        for layer in range(scan.shape[0]):
            for h in range(scan.shape[1]):
                if not torch.isnan(scan[layer, h]):
                    with heads.patch(model, rec, [(layer, h)], positions=positions, what=what), torch.no_grad():
                        want[layer, h] = _metric(logits_of(model(**corrupted)))
        diff = (scan - want).abs().nan_to_num().max().item()
        assert diff < 1e-5, f"{name} {what}: scan vs one patched forward per head, max diff {diff:.2e}"
        assert (want - want.nan_to_num().mean()).abs().nan_to_num().max() > 1e-6, "every head scored the same"


def test_the_prefix_skip_is_refused_where_it_would_not_be_exact(monkeypatch):
    """Not causal (BERT): no skip. A block input the cut reads wrongly (simulated: the
    sliding-window predicate left top-left aligned): the check run differs from the
    corrupted run, so the full positions run, and the table is still exact."""
    calls = _count_skips(monkeypatch)
    bert = _mh("bert")
    clean, corrupted = _one_token_changed("bert")
    heads.patch_scan(bert, clean, corrupted, _metric)
    assert calls == []
    model = _mh("mistral")
    clean, corrupted = _one_token_changed("mistral")
    right = heads.patch_scan(model, clean, corrupted, _metric)
    assert len(calls) > 1
    real_cut = _prefix.cut
    # a fault injected into the skip's cut (the window's predicate left uncut): no real input reads it wrongly
    monkeypatch.setattr(_prefix, "cut",
                        lambda x, key, T, p: x if isinstance(x, _prefix.MaskMod) else real_cut(x, key, T, p))
    calls.clear()
    fallback = heads.patch_scan(model, clean, corrupted, _metric)
    assert len(calls) == 1, "the check run should have refused the skip"
    assert (fallback - right).abs().max() < 1e-5
    monkeypatch.setattr(_scan, "_SKIP_PREFIX", False)  # no public switch: the whole run, to compare
    calls.clear()
    full = heads.patch_scan(model, clean, corrupted, _metric)
    assert calls == [] and (full - right).abs().max() < 1e-5


def test_the_prefix_skip_is_refused_where_a_mask_lets_the_prefix_see_ahead(monkeypatch):
    """A custom 4-D mask where query 1 also sees key 7 (after the changed position 5): the
    prefix is not the corrupted run's in a variant, so every position runs; exact."""
    model = _mh("llama")
    clean, corrupted = _one_token_changed("llama")
    T = clean["input_ids"].shape[1]
    allowed = torch.ones(T, T).tril().bool()
    assert not _prefix.sees_ahead(torch.zeros(2, 1, T, T).masked_fill(~allowed, float("-inf")), T, 5, 2)
    allowed[1, 7] = True
    mask = torch.zeros(2, 1, T, T).masked_fill(~allowed, float("-inf"))
    assert _prefix.sees_ahead(mask, T, 5, 2) and _prefix.sees_ahead(allowed.expand(2, 1, T, T), T, 5, 2)
    clean, corrupted = ({"input_ids": x["input_ids"], "attention_mask": mask} for x in (clean, corrupted))
    calls = _count_skips(monkeypatch)
    got = heads.patch_scan(model, clean, corrupted, _metric)
    assert calls == []
    rec = heads.record(model, clean)
    for layer, h in [(0, 1), (1, 6)]:
        with heads.patch(model, rec, [(layer, h)]), torch.no_grad():
            assert abs(got[layer, h] - _metric(logits_of(model(**corrupted)))) < 1e-5


def _gpt2_pair():
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=32, vocab_size=V)
    torch.manual_seed(0)
    ours = transformers.GPT2LMHeadModel(cfg).eval()
    theirs = transformers.GPT2LMHeadModel(copy.deepcopy(cfg)).eval()  # TransformerLens sets eager on its config
    theirs.load_state_dict(ours.state_dict())
    ours.set_attn_implementation("multihead")
    return ours, theirs


@pytest.mark.parametrize("what", ["z", "k", "v", "pattern"])
def test_patch_scan_equals_transformer_lens(what):
    pytest.importorskip("transformer_lens")
    from tokenizers import Tokenizer, models
    from transformer_lens import patching
    from transformer_lens.model_bridge import TransformerBridge

    ours, theirs = _gpt2_pair()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        {"[UNK]": 0, **{f"w{i}": i for i in range(1, V)}}, unk_token="[UNK]")))
    bridge = TransformerBridge.boot_transformers("gpt2", hf_model=theirs, tokenizer=tok)
    g = torch.Generator().manual_seed(4)
    clean, corrupted = torch.randint(0, V, (3, 12), generator=g), torch.randint(0, V, (3, 12), generator=g)
    _, cache = bridge.run_with_cache(clean)
    fn = {"z": patching.get_act_patch_attn_head_out_all_pos, "k": patching.get_act_patch_attn_head_k_all_pos,
          "v": patching.get_act_patch_attn_head_v_all_pos,
          "pattern": patching.get_act_patch_attn_head_pattern_all_pos}[what]
    want = fn(bridge, corrupted, cache, _metric)
    got = heads.patch_scan(ours, clean, corrupted, _metric, what=what)
    diff = (got - want).abs().max().item()
    assert diff < 1e-4, f"{what}: multihead vs TransformerLens, max diff {diff:.2e}"
    assert (want - want.mean()).abs().max() > 1e-4


# ------------------------------------------------------------------ multihead modules


def _w(lin):
    return lin.weight.detach().double().numpy().T


@pytest.mark.parametrize("n_kv", [4, 2, 1])
def test_ablation_of_an_attention_module_equals_the_float64_reference(n_kv):
    torch.manual_seed(0)
    m = Attention(32, 4, n_kv, causal=True, bias=False).double()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    with heads.ablate(m, [(0, 1), (0, 3)]):
        got = m(x)
    W_o = _w(m.o_proj).copy()  # (H*D, C)
    D = m.head_dim
    for h in (1, 3):
        W_o[h * D:(h + 1) * D] = 0
    want = R.gqa_forward(x.numpy(), _w(m.q_proj), _w(m.k_proj), _w(m.v_proj), W_o, 4, n_kv, causal=True)
    np.testing.assert_allclose(got.detach().numpy(), want, atol=1e-12)
    rec = heads.record(m, x, what=("z", "result"))
    full = R.gqa_forward(x.numpy(), _w(m.q_proj), _w(m.k_proj), _w(m.v_proj), _w(m.o_proj), 4, n_kv, causal=True)
    np.testing.assert_allclose(rec["result", 0].sum(2).numpy(), full, atol=1e-12)  # heads' shares add up


def test_ablation_of_a_latent_attention_module_equals_the_float64_reference():
    torch.manual_seed(0)
    m = LatentAttention(32, 4, 8, head_dim=8, rope_dim=4, causal=True).double()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    with heads.ablate(m, [(0, 2)]):
        got = m(x)
    W_o = _w(m.o_proj).copy()
    W_o[2 * m.v_head_dim:3 * m.v_head_dim] = 0
    want = R.mla_forward(x.numpy(), _w(m.kv_a_proj), _w(m.kv_b_proj), W_o, 4, 8, 8, 4, W_q=_w(m.q_proj),
                         g_kv=m.kv_a_norm.weight.detach().double().numpy(), eps=m.kv_a_norm.eps, causal=True)
    np.testing.assert_allclose(got.detach().numpy(), want, atol=1e-12)


LAB = {"mha": dict(), "gqa_rope": dict(n_kv_heads=2, positions="rope", bias=True),
       "mla": dict(attention="mla", kv_rank=8, rope_dim=4)}


@pytest.mark.parametrize("kind", sorted(LAB))
def test_lab_model_scans_equal_one_patched_forward_per_head(kind):
    torch.manual_seed(0)
    m = LabTransformer(LabConfig(vocab_size=50, max_len=16, n_layers=2, n_heads=4, **LAB[kind])).eval()
    g = torch.Generator().manual_seed(1)
    clean, corrupted = torch.randint(0, 50, (3, 10), generator=g), torch.randint(0, 50, (3, 10), generator=g)
    for what in ("z", "k", "v", "pattern"):
        scan = heads.patch_scan(m, clean, corrupted, _metric, what=what, positions=[7, 8, 9] if what == "z" else None)
        rec = heads.record(m, clean, what=(what,))
        want = torch.zeros_like(scan)
        for layer in range(scan.shape[0]):
            for h in range(scan.shape[1]):
                with heads.patch(m, rec, [(layer, h)], what=what, positions=[7, 8, 9] if what == "z" else None), \
                        torch.no_grad():
                    want[layer, h] = _metric(m(corrupted))
        assert (scan - want).abs().max() < 1e-5, f"{kind} {what}: max diff {(scan - want).abs().max():.2e}"
        if what in ("k", "v") and kind == "gqa_rope":
            assert scan.shape == (2, 2)  # per KV head


def test_mla_record_holds_per_head_keys_and_values_through_the_up_projection():
    torch.manual_seed(0)
    m = LatentAttention(32, 4, 8, head_dim=8, rope_dim=4, v_head_dim=6, causal=True)
    x = torch.randn(2, 5, 32)
    rec = heads.record(m, x, what=("k", "v", "z"))
    c = m.kv_a_norm(m.kv_a_proj(x)[..., :8])
    kv = m.kv_b_proj(c).view(2, 5, 4, 14)
    torch.testing.assert_close(rec["k", 0], kv[..., :8])
    torch.testing.assert_close(rec["v", 0], kv[..., 8:])
    assert rec["z", 0].shape == (2, 5, 4, 6)


# ------------------------------------------------------------------ restoring the model


def test_ablate_and_patch_leave_the_model_exactly_as_before_also_on_errors_and_nesting():
    model = _mh("llama")
    inputs = _inputs("llama")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        before = logits_of(model(**inputs))
    rec = heads.record(model, _inputs("llama", 3), what=("z",))
    with heads.ablate(model, [(0, 0)]), torch.no_grad():
        one = logits_of(model(**inputs))
        with heads.patch(model, rec, [(1, 3)]):
            two = logits_of(model(**inputs))
        again = logits_of(model(**inputs))
    assert (one - before).abs().max() > 1e-4 and (two - one).abs().max() > 1e-4
    torch.testing.assert_close(again, one, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="boom"), heads.ablate(model, [(1, 2)], how="mean", reference=rec):
        raise RuntimeError("boom")
    with pytest.raises(ValueError, match="out of range"), heads.ablate(model, [(0, 99)]), torch.no_grad():
        model(**inputs)
    with torch.no_grad():
        after = logits_of(model(**inputs))
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert not any(any(hooks(m)[:2]) for m in model.modules())


def test_mean_and_resample_ablation_write_the_reference_values():
    torch.manual_seed(0)
    m = Attention(16, 2, causal=True)
    x, other = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    ref = heads.record(m, other)
    seen = {}
    for how in ("mean", "resample"):
        with heads.ablate(m, [(0, 1)], how=how, reference=ref):
            seen[how] = heads.record(m, x)["z", 0]  # recorded inside: after the edit
    torch.testing.assert_close(seen["mean"][:, :, 1], ref["z", 0][:, :, 1].mean((0, 1)).expand(2, 5, 8))
    torch.testing.assert_close(seen["resample"][:, :, 1], ref["z", 0][:, :, 1])
    torch.testing.assert_close(seen["mean"][:, :, 0], heads.record(m, x)["z", 0][:, :, 0])


def test_mean_ablation_excludes_padding():
    model = _mh("gpt2")
    inputs = _inputs("gpt2")  # row 1 has two padded positions
    ref = heads.record(model, inputs)
    z = ref["z", 0][:, :, 2]  # (B, T, Dv)
    keep = inputs["attention_mask"].bool()
    want = z[keep].mean(0)
    with heads.ablate(model, [(0, 2)], how="mean", reference=ref):
        inside = heads.record(model, inputs)["z", 0][:, :, 2]
    torch.testing.assert_close(inside[0, 0], want)
    assert (want - z.flatten(0, 1).mean(0)).abs().max() > 1e-6


def test_errors_name_what_was_received():
    m = Attention(16, 2)
    x = torch.randn(1, 3, 16)
    with pytest.raises(ValueError, match="how must be one of"):
        with heads.ablate(m, [(0, 0)], how="gone"):
            pass
    with pytest.raises(TypeError, match="needs reference="):
        with heads.ablate(m, [(0, 0)], how="mean"):
            pass
    with pytest.raises(ValueError, match=r"\(layer, head\) pairs"):
        with heads.ablate(m, [(0,)]):
            pass
    with pytest.raises(ValueError, match="what must be one of"):
        heads.record(m, x, what="q")
    with pytest.raises(ValueError, match="no multihead Attention"):
        heads.record(torch.nn.Linear(3, 3), x)
    with pytest.raises(KeyError, match="was not recorded"):
        heads.record(m, x)["k", 0]
    gpt2, _ = _gpt2_pair()
    ids = torch.zeros(1, 3, dtype=torch.long)
    for bad in ([3], [-4]):  # was an IndexError from deep inside the scan
        with pytest.raises(ValueError, match=r"positions must lie in \[-3, 3\) for inputs of 3 positions"):
            heads.patch_scan(gpt2, ids, ids + 1, _metric, positions=bad)
    gpt2.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="set_attn_implementation"):
        heads.record(gpt2, ids)


def test_deepseek_v2_with_latent_attention_records_ablates_and_scans():
    """`multihead.interop.hf.use_latent_attention` swaps DeepSeek-V2's attention for LatentAttention: the
    heads are reached through it (z, per-head k/v through kv_b_proj, patterns)."""
    import multihead.interop.hf as mhf

    model = build("deepseek_v2", lm=True)
    mhf.use_latent_attention(model)
    eager = build("deepseek_v2", lm=True)
    eager.set_attn_implementation("eager")
    clean, corrupted = _inputs("deepseek_v2", 1, pad=False), _inputs("deepseek_v2", 2, pad=False)
    with heads.ablate(model, [(1, 2)]), torch.no_grad():
        got = model(**clean).logits
    o_proj = eager.model.layers[1].self_attn.o_proj
    Dv = eager.config.v_head_dim
    hook = o_proj.register_forward_pre_hook(lambda m, a: (a[0].index_fill(-1, torch.arange(2 * Dv, 3 * Dv), 0.0),))
    with torch.no_grad():
        want = eager(**clean).logits
    hook.remove()
    assert (got - want).abs().max() < 1e-4, f"max diff {(got - want).abs().max():.2e}"
    for what in ("z", "k", "v", "pattern"):
        scan = heads.patch_scan(model, clean, corrupted, _metric, what=what)
        rec = heads.record(model, clean, what=(what,))
        for layer, h in [(0, 1), (1, 3)]:
            with heads.patch(model, rec, [(layer, h)], what=what), torch.no_grad():
                one = _metric(model(**corrupted).logits)
            assert abs(scan[layer, h] - one) < 1e-5, (what, layer, h)


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "bart"])
def test_results_add_up_to_the_output_projection(name):
    """rec["result"] (each head's share after the output projection) summed over heads, plus
    the projection's bias, is what transformers' own output projection returns."""
    model = _mh(name)
    inputs = _inputs(name, pad=False)
    mods = _attention_modules(model, inputs)
    outs = {}
    hooks = [_out_module(model, m).register_forward_hook(lambda mod, a, o, i=i: outs.setdefault(i, o))
             for i, m in enumerate(mods)]
    rec = heads.record(model, inputs, what=("result",))
    for h in hooks:
        h.remove()
    for i in range(len(mods)):
        proj = _out_module(model, mods[i])
        bias = 0 if getattr(proj, "bias", None) is None else proj.bias
        torch.testing.assert_close(rec["result", i].sum(2) + bias, outs[i], rtol=1e-5, atol=1e-5)
    assert ("z", 0) not in rec


def test_mla_latent_scan_equals_swapping_kv_a_projs_output_by_hand():
    """what="latent": MLA's shared latent (kv_a_proj's output, before its norm and RoPE) as
    one "head" per layer; the reference writes the clean output with a plain torch hook."""
    torch.manual_seed(0)
    m = LabTransformer(LabConfig(vocab_size=50, max_len=16, n_layers=2, n_heads=4, attention="mla", kv_rank=8,
                                 rope_dim=4)).eval()
    g = torch.Generator().manual_seed(1)
    clean, corrupted = torch.randint(0, 50, (3, 10), generator=g), torch.randint(0, 50, (3, 10), generator=g)
    scan = heads.patch_scan(m, clean, corrupted, _metric, what="latent")
    assert scan.shape == (2, 1)
    for layer in range(2):
        proj = m.blocks[layer].attn.kv_a_proj
        with torch.no_grad():
            kept = {}
            h = proj.register_forward_hook(lambda mod, a, o, kept=kept: kept.setdefault("c", o))
            m(clean)
            h.remove()
            h = proj.register_forward_hook(lambda mod, a, o, kept=kept: kept["c"])
            want = _metric(m(corrupted))
            h.remove()
        assert abs(scan[layer, 0] - want) < 1e-5
    with pytest.raises(ValueError, match="MLA latents"):
        heads.patch_scan(Attention(16, 2), torch.randn(1, 3, 16), torch.randn(1, 3, 16), lambda y: y.sum(),
                         what="latent")
