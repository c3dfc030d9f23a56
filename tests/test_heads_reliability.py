"""multihead.heads under hostile use: pruning keeps what saving, loading and unpatching
read (and every requires_grad), scans are safe from two threads, shared attention modules
(ALBERT) are refused by name, and mistakes give one clear error instead of a traceback.

References are independent of the code under test: transformers' eager attention with a
head's slice of the output projection's input zeroed by hand, an unpruned copy under
`ablate`, a scan run alone in one thread.
"""

from __future__ import annotations

import threading

import pytest
import torch

from multihead import heads
from multihead.attention import Attention
from multihead.checkpoint import Vocab, load_lab_checkpoint, save_lab_checkpoint
from multihead.decoder import LabConfig, LabTransformer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

transformers = pytest.importorskip("transformers")

import multihead.interop.hf as mhf  # noqa: E402  (registers "multihead")
from test_interop_hf_registry import V, build  # noqa: E402


def _ids(seed: int = 1, B: int = 2, T: int = 9) -> torch.Tensor:
    return torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(seed))


def _metric(logits):
    return logits[:, -1, :7].sum()


def _max_diff(a, b) -> float:
    return float((a - b).abs().max())


# ------------------------------------------------------------------ prune: nothing lost


def _eager_with_zeroed_heads(name: str, removed: list[tuple[int, int]], Dv: int):
    """The unpruned transformers model (eager) with the removed heads' slices of each
    o_proj's input zeroed by hand: what the pruned model must compute."""
    eager = build(name, lm=True)
    eager.set_attn_implementation("eager")
    for layer in {lay for lay, _ in removed}:
        cols = torch.tensor([c for lay, h in removed if lay == layer for c in range(h * Dv, (h + 1) * Dv)])
        eager.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(
            lambda m, a, cols=cols: (a[0].index_fill(-1, cols, 0.0),))
    return eager


def test_prune_of_a_patched_deepseek_is_what_state_dict_save_and_unpatch_give(tmp_path):
    removed = [(0, 1), (0, 3), (1, 0), (1, 2)]
    model = mhf.use_latent_attention(build("deepseek_v2", lm=True))
    ids = _ids()
    want = _eager_with_zeroed_heads("deepseek_v2", removed, model.config.v_head_dim)
    with torch.no_grad():
        want_logits = want(ids).logits
        plain = build("deepseek_v2", lm=True)(ids).logits
    assert _max_diff(plain, want_logits) > 1e-3, "removing these heads changes nothing: the check could not fail"
    heads.prune(model, removed)
    with torch.no_grad():
        live = model(ids).logits
    assert _max_diff(live, want_logits) < 1e-5, f"live pruned model vs zeroed heads: {_max_diff(live, want_logits)}"
    # what state_dict holds is what computes: loaded into a fresh model of the saved config
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert loaded.config.num_attention_heads == 2
    with torch.no_grad():
        saved = loaded(ids).logits
    assert _max_diff(saved, want_logits) < 1e-5, f"saved pruned model vs zeroed heads: {_max_diff(saved, want_logits)}"
    for key, t in model.state_dict().items():
        assert loaded.state_dict()[key].shape == t.shape, key
    mhf.restore_attention(model)
    with torch.no_grad():
        back = model(ids).logits
    assert _max_diff(back, want_logits) < 1e-5, f"unpatched vs zeroed heads: {_max_diff(back, want_logits)}"


def test_prune_of_a_patched_deepseek_refuses_what_its_config_cannot_hold():
    model = mhf.use_latent_attention(build("deepseek_v2", lm=True))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"different head counts \[2, 3\].*same number of heads in every layer"):
        heads.prune(model, [(0, 1), (1, 0), (1, 2)])
    with pytest.raises(ValueError, match=r"would not hold 3 query"):  # hidden size 64 is no multiple of 3 heads
        heads.prune(model, [(0, 1), (1, 0)])
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before) and model.config.num_attention_heads == 4


def _lab(seed: int = 0, **kw) -> LabTransformer:
    torch.manual_seed(seed)
    cfg = LabConfig(**{"vocab_size": 11, "max_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 4, "bias": True,
                       **kw})
    return LabTransformer(cfg).eval()


VOCAB = Vocab("symbols", tuple(str(i) for i in range(11)))


@pytest.mark.parametrize("arch, removed", [
    ({}, [(0, 1), (1, 2)]),  # the same heads left in every layer: the config follows
    ({}, [(0, 1), (0, 2), (1, 3)]),  # different counts per layer: the checkpoint records them
    ({"n_kv_heads": 2}, [(0, 0)]),  # GQA, an uneven group: its key/value head repeated
    ({"attention": "mla", "kv_rank": 8, "rope_dim": 4, "head_dim": 8}, [(0, 1), (1, 0), (1, 3)]),
])
def test_a_pruned_lab_model_saves_and_loads_to_the_same_outputs(tmp_path, arch, removed):
    model = _lab(**arch)
    ids = torch.randint(0, 11, (2, 10), generator=torch.Generator().manual_seed(2))
    with heads.ablate(model, removed), torch.no_grad():
        want = model(ids)
    heads.prune(model, removed)
    save_lab_checkpoint(tmp_path, model, VOCAB, experiment="test")
    loaded, _, meta = load_lab_checkpoint(tmp_path)
    with torch.no_grad():
        got, live = loaded(ids), model(ids)
    assert _max_diff(live, want) < 1e-5, f"pruned vs ablated: {_max_diff(live, want)}"
    assert _max_diff(got, want) < 1e-5, f"loaded vs ablated: {_max_diff(got, want)}"
    counts = [(b.attn.n_heads, getattr(b.attn, "n_kv_heads", b.attn.n_heads)) for b in loaded.blocks]
    assert counts == [(b.attn.n_heads, getattr(b.attn, "n_kv_heads", b.attn.n_heads)) for b in model.blocks]
    if len(set(counts)) == 1:
        assert model.cfg.n_heads == loaded.cfg.n_heads == counts[0][0] and "layer_heads" not in meta
    else:
        assert meta["layer_heads"] == [list(c) for c in counts]


def test_a_lab_checkpoint_with_bad_layer_heads_is_refused(tmp_path):
    model = _lab()
    heads.prune(model, [(0, 1)])
    save_lab_checkpoint(tmp_path, model, VOCAB, experiment="test")
    import json

    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["multihead_lab"]["layer_heads"] = [[3, 2], [4, 4]]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"'layer_heads' must be 2 pairs \[H, Hkv\].*received \[\[3, 2\], \[4, 4\]\]"):
        load_lab_checkpoint(tmp_path)


def _grads(model) -> dict[str, bool]:
    return {n: p.requires_grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["attention", "lab", "lab_mla", "qwen2"])
@pytest.mark.parametrize("frozen", ["all", "weights"])
def test_prune_keeps_requires_grad_of_every_parameter(kind, frozen):
    if kind == "attention":
        model, removed = Attention(32, 4, 2, bias=True), [(0, 0), (0, 1)]
    elif kind == "lab":
        model, removed = _lab(), [(0, 1), (1, 0)]
    elif kind == "lab_mla":
        model, removed = _lab(attention="mla", kv_rank=8, head_dim=8), [(0, 1), (1, 0)]
    else:  # q/k/v carry biases
        model, removed = build("qwen2", lm=True), [(layer, h) for layer in (0, 1) for h in range(2)]  # one KV group
        model.config.head_dim = model.config.hidden_size // model.config.num_attention_heads  # what Qwen2 derives
    for name, p in model.named_parameters():
        p.requires_grad_(frozen == "weights" and not name.endswith("weight"))
    want = _grads(model)
    heads.prune(model, removed)
    got = _grads(model)
    assert got == want, {n: (want[n], got[n]) for n in want if got[n] != want[n]}
    assert set(got.values()) == ({False} if frozen == "all" else {False, True})


# ------------------------------------------------------------------ threads, shared modules


def _pair(seed: int = 1, at: int = 5):
    """IOI-style: corrupted is clean with the token at `at` changed."""
    clean = _ids(seed)
    corrupted = clean.clone()
    corrupted[:, at] = (corrupted[:, at] - 3 + 7) % (V - 3) + 3
    return clean, corrupted


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_two_threads_scanning_one_model_get_the_tables_of_a_scan_alone(name):
    """Each thread's hooks act only in its own thread: two scans at once (different pairs,
    one with the prefix skip, one without) give exactly the tables each gives alone, and a
    plain forward in a third thread sees no intervention."""
    model = build(name, lm=True)
    model.set_attn_implementation("multihead")
    jobs = [_pair(1), (_ids(2), _ids(3))]  # a shared prefix of 5; none
    alone = [heads.patch_scan(model, c, k, _metric) for c, k in jobs]
    with torch.no_grad():
        plain = model(jobs[0][1]).logits
    got, errors, seen = {}, [], []
    start = threading.Barrier(3)

    def scan(i):
        try:
            start.wait()
            for r in range(3):
                got[i, r] = heads.patch_scan(model, *jobs[i], _metric)
        except Exception as err:  # noqa: BLE001 (reported below, with the thread's error)
            errors.append(repr(err))

    def forward():
        start.wait()
        for _ in range(6):
            with torch.no_grad():
                seen.append(_max_diff(model(jobs[0][1]).logits, plain))

    threads = [threading.Thread(target=scan, args=(i,)) for i in range(2)] + [threading.Thread(target=forward)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for (i, r), table in got.items():
        assert torch.equal(table.nan_to_num(), alone[i].nan_to_num()), (i, r, _max_diff(table, alone[i]))
    assert max(seen) == 0.0, f"a plain forward in another thread saw the scan's hooks: {max(seen)}"
    assert _max_diff(alone[0], alone[1]) > 1e-3, "the two jobs give the same table: the check could not fail"


def _albert():
    cfg = transformers.AlbertConfig(vocab_size=V, embedding_size=32, hidden_size=64, num_hidden_layers=3,
                                    num_attention_heads=4, intermediate_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.AlbertModel(cfg).eval()
    model.set_attn_implementation("multihead")
    return model


def test_one_attention_module_run_by_several_layers_is_refused_by_name():
    """ALBERT runs one attention module for its 3 layers: every tool says so, rather than
    recording 1 layer or failing in the scan's batch bookkeeping."""
    model = _albert()
    ids = _ids()
    message = r"AlbertModel runs one attention module \(AlbertAttention, layer 0\) more than once in a forward"
    with pytest.raises(ValueError, match=message):
        heads.record(model, ids)
    with pytest.raises(ValueError, match=message):
        heads.patch_scan(model, ids, ids.flip(0), lambda out: out.sum())
    with pytest.raises(ValueError, match=message):
        with heads.ablate(model, [(0, 1)]), torch.no_grad():
            model(ids)
    with torch.no_grad():  # the hooks are gone: the model runs as before
        assert model(ids).last_hidden_state.shape == (2, 9, 64)


def test_a_recomputed_forward_is_not_a_second_layer():
    """Gradient checkpointing runs a block's forward again inside the backward: importance
    still works, equal to the scores without checkpointing."""
    model = build("llama", lm=True)
    model.set_attn_implementation("multihead")
    ids = _ids()

    def loss(m, batch):
        return m(batch, labels=batch).loss

    want = heads.importance(model, [ids], loss)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    try:
        got = heads.importance(model, [ids], loss)
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
    assert _max_diff(got, want) < 1e-5


# ------------------------------------------------------------------ clear errors


@pytest.fixture(scope="module")
def llama():
    model = build("llama", lm=True)
    model.set_attn_implementation("multihead")
    return model


def test_scan_inputs_of_different_lengths_or_kinds_are_named(llama):
    ids = _ids()
    with pytest.raises(ValueError, match=r"same shape .*received input_ids of shape \(2, 9\) and \(2, 7\)"):
        heads.patch_scan(llama, ids, ids[:, :7], _metric)
    with pytest.raises(ValueError, match=r"same shape .*received attention_mask of shape \(2, 9\) and \(2, 8\)"):
        heads.patch_scan(llama, {"input_ids": ids, "attention_mask": torch.ones(2, 9)},
                         {"input_ids": ids, "attention_mask": torch.ones(2, 8)}, _metric)
    with pytest.raises(ValueError, match=r"same keywords; received \['input_ids'\] and \['attention_mask', 'input"):
        heads.patch_scan(llama, {"input_ids": ids}, {"input_ids": ids, "attention_mask": torch.ones(2, 9)}, _metric)
    with pytest.raises(TypeError, match="or both mappings of keyword arguments; received Tensor and dict"):
        heads.patch_scan(llama, ids, {"input_ids": ids}, _metric)
    with pytest.raises(ValueError, match=r"same shape .*received input_ids of shape \(2, 9\) and \(2, 7\)"):
        heads.attribution_scan(llama, ids, ids[:, :7], _metric)


@pytest.mark.parametrize("extra, shown", [({"labels": None}, None), ({"use_cache": False}, None),
                                          ({"labels": "ids"}, r"labels \(a tensor of shape \(2, 9\)\)"),
                                          ({"use_cache": True}, r"use_cache \(True\)")])
def test_scan_inputs_with_labels_or_a_cache_are_refused(llama, extra, shown):
    clean, corrupted = _pair()
    extra = {k: clean if v == "ids" else v for k, v in extra.items()}
    c, k = {"input_ids": clean, **extra}, {"input_ids": corrupted, **extra}
    if shown is None:  # harmless values run, and give the plain table
        assert torch.equal(heads.patch_scan(llama, c, k, _metric), heads.patch_scan(llama, clean, corrupted, _metric))
    else:
        with pytest.raises(ValueError, match=rf"clean carries {shown}; valid: inputs without it"):
            heads.patch_scan(llama, c, k, _metric)


def test_positions_must_exist_in_every_layer_of_an_encoder_decoder():
    model = build("t5")
    model.set_attn_implementation("multihead")
    ids = _ids()
    clean = {"input_ids": ids, "decoder_input_ids": ids[:, :5]}
    corrupted = {"input_ids": ids.flip(0), "decoder_input_ids": ids[:, :5]}
    for bad in ([7], [-6]):  # valid for the encoder's 9 positions, not the decoder's 5
        with pytest.raises(ValueError, match=r"out of range at layer \d \(T5Attention\), whose z has 5 positions; "
                                             r"valid: positions in \[-5, 5\)"):
            heads.patch_scan(model, clean, corrupted, lambda out: out.sum(), positions=bad)
    got = heads.patch_scan(model, clean, corrupted, lambda out: out.sum(), positions=[-5, 4])
    assert not torch.isnan(got).all()


@pytest.mark.parametrize("returns, error, message", [
    (lambda logits: None, TypeError, "metric must return a scalar tensor .or a number.; on the corrupted run it "
                                     "returned NoneType"),
    (lambda logits: "0.5", TypeError, "returned str"),
    (lambda logits: logits[:, -1, 0], ValueError, r"on the corrupted run it returned shape \(2,\)"),
])
def test_a_metric_that_returns_no_scalar_is_named(llama, returns, error, message):
    clean, corrupted = _pair()
    with pytest.raises(error, match=message):
        heads.patch_scan(llama, clean, corrupted, returns)
    with pytest.raises(error, match=message):
        heads.attribution_scan(llama, clean, corrupted, returns)


def test_a_metric_returning_a_number_scans_and_attribution_asks_for_a_tensor(llama):
    clean, corrupted = _pair()
    want = heads.patch_scan(llama, clean, corrupted, _metric)
    assert torch.equal(heads.patch_scan(llama, clean, corrupted, lambda x: float(_metric(x))), want)
    with pytest.raises(TypeError, match="attribution differentiates it.; received float"):
        heads.attribution_scan(llama, clean, corrupted, lambda x: float(_metric(x)))


def test_gradient_tools_under_inference_mode_say_so(llama):
    ids = _ids()
    with torch.inference_mode():
        with pytest.raises(ValueError, match=r"importance differentiates .* inside torch.inference_mode\(\)"):
            heads.importance(llama, [ids], lambda m, b: m(b).logits.sum())
        with pytest.raises(ValueError, match=r"attribution_scan differentiates .* inside torch.inference_mode\(\)"):
            heads.attribution_scan(llama, ids, ids.flip(0), _metric)
    with torch.no_grad():  # turned on inside: works, as outside
        inside = heads.importance(llama, [ids], lambda m, b: m(b).logits.sum())
    assert torch.equal(inside, heads.importance(llama, [ids], lambda m, b: m(b).logits.sum()))
    with pytest.raises(TypeError, match="loss must return a scalar tensor; received NoneType"):
        heads.importance(llama, [ids], lambda m, b: None)
    with pytest.raises(ValueError, match="returned a tensor without a gradient"):
        heads.importance(llama, [ids], lambda m, b: torch.tensor(1.0))


def test_a_recording_or_reference_with_fewer_heads_is_named(llama):
    """A recording of a model with 4 query / 1 key-value heads per layer, used on one with 8 / 2."""
    small = build("llama", lm=True)
    heads.prune(small, [(layer, h) for layer in (0, 1) for h in range(4)])
    small.set_attn_implementation("multihead")
    ids = _ids()
    rec = heads.record(small, ids, what=("z", "k", "v", "pattern"))
    for what, pair, message in [("z", (0, 3), r"recorded z of layer 0 has 4 heads \(shape \(2, 9, 4, 8\)\) but this "
                                               r"model's layer 0 has 8"),
                                ("k", (0, 0), "recorded k of layer 0 has 1 heads"),
                                ("v", (1, 0), "recorded v of layer 1 has 1 heads"),
                                ("pattern", (0, 3), r"recorded pattern of layer 0 is \(2, 4, 9, 9\); this run needs "
                                                    r"\(2, 8, 9, 9\)")]:
        with pytest.raises(ValueError, match=message):
            with heads.patch(llama, rec, [pair], what=what), torch.no_grad():
                llama(ids)
    for how, message in [("mean", "mean z of layer 0 is over 4 heads of width 8 but this model's layer 0 has 8"),
                         ("resample", "reference z of layer 0 has 4 heads")]:
        with pytest.raises(ValueError, match=message):
            with heads.ablate(llama, [(0, 3)], how=how, reference=rec), torch.no_grad():
                llama(ids)


def test_one_pair_as_a_1d_tensor_is_one_pair(llama):
    ids = _ids()
    for one in (torch.tensor([1, 3]), torch.tensor([[1, 3]]), (1, 3)):
        with heads.ablate(llama, one), torch.no_grad():
            got = llama(ids).logits
        with heads.ablate(llama, [(1, 3)]), torch.no_grad():
            want = llama(ids).logits
        assert torch.equal(got, want)
    with torch.no_grad():
        assert _max_diff(llama(ids).logits, want) > 1e-4
    with pytest.raises(ValueError, match=r"one \(layer, head\) pair of shape \(2,\) or pairs of shape \(N, 2\); "
                                         r"received shape \(3,\)"):
        heads.ablate(llama, torch.tensor([0, 1, 2])).__enter__()
    with pytest.raises(ValueError, match=r"pairs of non-negative ints; received \[0.0, 1.0\]"):
        heads.ablate(llama, torch.tensor([0.0, 1.0])).__enter__()


# ------------------------------------------------------------------ the prefix skip's decision, visible


def test_the_scan_says_whether_it_skipped_the_prefix_and_why_not(monkeypatch):
    from multihead.heads import _prefix
    from multihead.heads import scan as _scan

    model = build("llama", lm=True)
    model.set_attn_implementation("multihead")
    clean, corrupted = _pair(at=5)
    info = {}
    taken = heads.patch_scan(model, clean, corrupted, _metric, info=info)
    assert info == {"prefix": 5, "skipped": True, "reason": ""}
    monkeypatch.setattr(_scan, "_SKIP_PREFIX", False)  # no public switch: the whole run, to compare
    info = {}
    full = heads.patch_scan(model, clean, corrupted, _metric, info=info)
    assert info == {"prefix": 5, "skipped": False, "reason": "the prefix skip is turned off"}
    assert (full - taken).abs().max() < 1e-5  # the same table either way
    monkeypatch.setattr(_scan, "_SKIP_PREFIX", True)  # on again, whatever the default
    first = _pair(at=0)
    heads.patch_scan(model, *first, _metric, info=info)
    assert info == {"prefix": 0, "skipped": False, "reason": "clean and corrupted differ at position 0: no shared "
                                                             "prefix"}
    bert = build("bert")
    bert.set_attn_implementation("multihead")
    heads.patch_scan(bert, clean, corrupted, lambda out: out.sum(), info=info)
    assert info == {"prefix": 5, "skipped": False, "reason": "attention layer 0 does not say is_causal=True"}
    # a block input the cut reads wrongly (the sliding-window predicate read top-left)
    mistral = build("mistral", lm=True)
    mistral.set_attn_implementation("multihead")
    right = heads.patch_scan(mistral, clean, corrupted, _metric, info=info)
    assert info["skipped"] is True
    real_cut = _prefix.cut
    # a fault injected into the skip's cut (the window's predicate read top-left, its query rows taken as
    # positions from 0: wrong once the rows are cut): no real input reads it wrongly
    monkeypatch.setattr(_prefix, "cut", lambda x, key, T, p: _prefix.MaskMod(x.fn, x.name, top_left=True)
                        if isinstance(x, _prefix.MaskMod) else real_cut(x, key, T, p))
    fallback = heads.patch_scan(mistral, clean, corrupted, _metric, info=info)
    assert info["skipped"] is False and info["reason"].startswith("the corrupted run through the skip differs from "
                                                                  "its own logits by")
    assert (fallback - right).abs().max() < 1e-5

    def no_cut(x, key, T, p):
        if key == "position_ids":
            raise _prefix.NoCut(key)
        return real_cut(x, key, T, p)
    monkeypatch.setattr(_prefix, "cut", no_cut)  # a cut that refuses a keyword, injected as above
    heads.patch_scan(model, clean, corrupted, _metric, info=info)
    assert info["skipped"] is False and info["reason"].startswith("a block takes keyword 'position_ids', which holds")
    with pytest.raises(TypeError, match="info must be None or a dict to fill; received list"):
        heads.patch_scan(model, clean, corrupted, _metric, info=[])
