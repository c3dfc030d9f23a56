"""multihead.heads under hostile use: pruning keeps what saving, loading and unpatching
read (and every requires_grad), scans are safe from two threads, shared attention modules
(ALBERT) are refused by name, and mistakes give one clear error instead of a traceback.

References are independent of the code under test: transformers' eager attention with a
head's slice of the output projection's input zeroed by hand, an unpruned copy under
`ablate`, a scan run alone in one thread.
"""

from __future__ import annotations

import pytest
import torch

from multihead import heads
from multihead.attention import Attention
from multihead.lab.checkpoint import Vocab, load_lab_checkpoint, save_lab_checkpoint
from multihead.lab.models import LabConfig, LabTransformer

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
    model = mhf.patch(build("deepseek_v2", lm=True))
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
    mhf.unpatch(model)
    with torch.no_grad():
        back = model(ids).logits
    assert _max_diff(back, want_logits) < 1e-5, f"unpatched vs zeroed heads: {_max_diff(back, want_logits)}"


def test_prune_of_a_patched_deepseek_refuses_what_its_config_cannot_hold():
    model = mhf.patch(build("deepseek_v2", lm=True))
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
