"""`heads.prune(pad=True)` and the perplexity pruning curve of a grouped-query decoder
(`multihead.heads.prune_curve`): the padded model against the ablated one and against
stock transformers' reload, the curve's units and points against perplexities computed
here from pruned copies, and (slow) `heads prune --curve` of the committed SmolLM2 curve."""

from __future__ import annotations

import copy
import json
import math
import statistics
from pathlib import Path

import pytest
import torch

from conftest import attn_implementation
from multihead import heads
from multihead.cli import main

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parent.parent
CURVE = ROOT / "docs" / "heads" / "prune-curve-smollm2" / "results.json"


def _model(kind: str = "llama", layers: int = 3, H: int = 6, Hkv: int = 3, vocab: int = 60):
    from multihead.interop.hf.registry import register

    register()
    Cfg = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[kind]
    # a hidden size that every pruned head count divides (Llama's config checks hidden % heads)
    cfg = Cfg(hidden_size=4 * H if H % 2 else 8 * H, intermediate_size=64, num_hidden_layers=layers, vocab_size=vocab,
              num_attention_heads=H, num_key_value_heads=Hkv, head_dim=8, max_position_embeddings=64,
              tie_word_embeddings=False)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="multihead").eval()
    if kind == "qwen2":  # non-zero q/k/v biases: the padding must keep the real heads' and zero the inert ones'
        with torch.no_grad():
            for p in m.parameters():
                if p.dim() == 1 and p.abs().sum() == 0:
                    p.normal_(0, 0.1)
    return m


def _logits(m, x):
    with torch.no_grad():
        return m(input_ids=x).logits


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("removed", [
    [(0, 0), (0, 1), (1, 3), (2, 0), (2, 2), (2, 4)],  # uneven groups in every layer
    [(0, 0), (0, 1), (1, 2), (1, 3)],  # whole groups: layer 0 and 1 keep 2, layer 2 keeps 3
    [(0, 0), (0, 1), (1, 2), (1, 3), (2, 4), (2, 5)],  # every layer keeps 2 groups: one count holds, smaller
])
def test_padded_prune_equals_ablation_and_reloads_in_stock_transformers(kind, removed, tmp_path):
    m = _model(kind)
    x = torch.randint(0, 60, (2, 9))
    with heads.ablate(m, removed):
        ref = _logits(m, x)
    full = sum(p.numel() for p in m.parameters())
    heads.prune(m, removed, pad=True)
    torch.testing.assert_close(_logits(m, x), ref, atol=1e-5, rtol=0)
    m.save_pretrained(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # stock: sdpa, not multihead
    assert attn_implementation(back.config) != "multihead"
    torch.testing.assert_close(_logits(back, x), ref, atol=1e-5, rtol=0)
    kept = [[h for h in range(6) if (i, h) not in removed] for i in range(3)]
    Hkv2 = max(len({h // 2 for h in k}) for k in kept)
    G2 = max(sum(h // 2 == j for h in k) for k in kept for j in range(3))
    assert (back.config.num_key_value_heads, back.config.num_attention_heads) == (Hkv2, Hkv2 * G2)
    saved = full - sum(p.numel() for p in back.parameters())
    bias = 8 * ((6 - Hkv2 * G2) + 2 * (3 - Hkv2)) if kind == "qwen2" else 0  # Qwen2's q/k/v biases
    assert saved == 3 * (48 * 8 * (2 * (6 - Hkv2 * G2) + 2 * (3 - Hkv2)) + bias)  # q, o per head; k, v per group


def _gemma3(hidden: int):
    """Gemma 3's attention: one K/V head (MQA), QK-norm, sliding and global layers, post-norms
    (their gains random, so that a wrong head's weights would show)."""
    from multihead.interop.hf.registry import register

    register()
    cfg = transformers.Gemma3TextConfig(vocab_size=60, hidden_size=hidden, intermediate_size=48, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                                        max_position_embeddings=64, sliding_window=4,
                                        layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    torch.manual_seed(0)
    m = transformers.Gemma3ForCausalLM(cfg).double().eval()
    m.set_attn_implementation("multihead")
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    return m


def test_gemma3_pruned_equals_ablated_and_reloads_in_stock_transformers(tmp_path):
    m = _gemma3(hidden=48)
    x = torch.randint(0, 60, (2, 9), generator=torch.Generator().manual_seed(1))  # longer than the window
    removed = [(0, 1), (1, 0), (1, 3), (2, 2)]
    with heads.ablate(m, removed):
        ref = _logits(m, x)
    assert (ref - _logits(m, x)).abs().max() > 0.1  # the removed heads matter
    orig = copy.deepcopy(m)
    heads.prune(m, removed, pad=True)
    assert (m.config.num_attention_heads, m.config.num_key_value_heads) == (3, 1)
    torch.testing.assert_close(_logits(m, x), ref, atol=1e-12, rtol=0)  # float64: equal but for rounding
    # a reloaded Gemma 3 computes its RoPE frequencies in float32 (m's were cast to float64 with
    # the model): the reloaded pruned model is compared with the reloaded unpruned one, ablated
    orig.save_pretrained(tmp_path / "orig")
    m.save_pretrained(tmp_path / "pruned")
    back, orig_back = (transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float64).eval()
                       for name in ("pruned", "orig"))
    assert type(back).__name__ == "Gemma3ForCausalLM" and attn_implementation(back.config) != "multihead"
    orig_back.set_attn_implementation("multihead")
    with heads.ablate(orig_back, removed):
        ref_back = _logits(orig_back, x)
    torch.testing.assert_close(_logits(back, x), ref_back, atol=1e-12, rtol=0)


def test_gemma3_head_count_that_its_config_refuses_is_named():
    """Gemma 3 270M's width 640 holds 1, 2 or 4 heads but not 3: transformers' config refuses it."""
    m = _gemma3(hidden=32)
    before = copy.deepcopy(m.state_dict())
    with pytest.raises(ValueError, match=r"would not hold 3 query / 1 key-value heads .*use multihead.heads.ablate"):
        heads.prune(m, [(0, 1), (1, 0), (2, 2)], pad=True)
    assert m.config.num_attention_heads == 4
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())  # a refusal leaves the model as it was


def test_prune_refuses_uneven_groups_without_pad_and_an_empty_layer_with_it():
    m = _model()
    with pytest.raises(ValueError, match="uneven groups"):
        heads.prune(copy.deepcopy(m), [(0, 0), (1, 3)])
    before = [p.clone() for p in m.parameters()]
    with pytest.raises(ValueError, match="every head of layer 1"):
        heads.prune(m, [(1, h) for h in range(6)] + [(0, 0)], pad=True)
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))  # refused before any change
    with pytest.raises(TypeError, match="pad must be a bool"):
        heads.prune(m, [(0, 0)], pad="yes")


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    from multihead.corpus import split_kjv

    words = sorted(set(split_kjv(20_000)[0].split()))[:58]
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "[PAD]": 1, **{w: i + 2 for i, w in enumerate(words)}},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")


@pytest.fixture(scope="module")
def tiny_curve():
    from multihead.heads import prune_curve as pc

    m, tok = _model(H=9, Hkv=3, layers=3), _tokenizer()
    saved = pc.EVAL_WINDOWS, pc.EVAL_LENGTH, pc.IMP_BATCHES, pc.IMP_BATCH, pc.IMP_LENGTH
    pc.EVAL_WINDOWS, pc.EVAL_LENGTH, pc.IMP_BATCHES, pc.IMP_BATCH, pc.IMP_LENGTH = 2, 24, 1, 2, 16
    try:
        r = pc.prune_curve_lm(m, tok, fractions=(0.0, 0.2, 0.4), say=lambda s: None)
        windows = pc.kjv_windows(tok, 2, 24, held_out=True)
    finally:
        pc.EVAL_WINDOWS, pc.EVAL_LENGTH, pc.IMP_BATCHES, pc.IMP_BATCH, pc.IMP_LENGTH = saved
    return m, r, windows


def _ppl(model, windows) -> float:
    """exp(mean next-token NLL), computed here without the module under test."""
    with torch.no_grad():
        logits = model(input_ids=windows[:, :-1]).logits.double()
    nll = -torch.log_softmax(logits, -1).gather(-1, windows[:, 1:, None]).mean()
    return math.exp(float(nll))


def test_curve_points_equal_the_perplexity_of_the_pruned_model(tiny_curve):
    m, r, windows = tiny_curve
    assert r["base_ppl"] == pytest.approx(_ppl(m, windows), rel=1e-5)
    for unit, c in r["curves"].items():
        assert [p["fraction"] for p in c["importance"]] == [0.0, 0.2, 0.4]
        assert c["importance"][0]["removed"] == [] and c["importance"][0]["val_ppl"] == r["base_ppl"]
        for p in c["importance"][1:]:
            pruned = heads.prune(copy.deepcopy(m), [tuple(h) for h in p["removed"]], pad=True)
            assert p["val_ppl"] == pytest.approx(_ppl(pruned, windows), rel=1e-5), (unit, p["fraction"])
            assert (pruned.config.num_key_value_heads, pruned.config.num_attention_heads) == \
                (p["num_key_value_heads"], p["num_attention_heads"])
            assert p["params"] == sum(q.numel() for q in pruned.parameters())
        for p in c["random"]:
            assert p["val_ppl_median"] == statistics.median(p["val_ppl_seeds"]) and len(p["val_ppl_seeds"]) == 3


def test_curve_units_are_whole_groups_or_equal_counts_per_group(tiny_curve):
    _, r, _ = tiny_curve
    total = 3 * 9
    for unit, c in r["curves"].items():
        previous: set = set()
        for p in c["importance"]:
            gone = {tuple(h) for h in p["removed"]}
            assert len(gone) == p["removed_heads"] == 3 * round(p["fraction"] * total / 3)
            assert previous <= gone  # the points of one order are nested
            previous = gone
            for layer in range(3):
                per_group = [sum((layer, h) in gone for h in range(3 * j, 3 * j + 3)) for j in range(3)]
                if unit == "groups":
                    assert set(per_group) <= {0, 3} and per_group.count(3) < 3
                else:
                    assert len(set(per_group)) == 1 and per_group[0] < 3


def test_random_orders_follow_the_same_rules():
    from multihead.heads.prune_curve import _random_order

    for unit in ("groups", "heads"):
        orders = [_random_order(30, 9, 3, unit, s) for s in range(3)]
        assert len(orders[0]) == 60 and orders[0] != orders[1]  # two of three groups (levels) per layer
        assert orders[0] == _random_order(30, 9, 3, unit, 0)
        gone = {h for u in orders[2] for h in u}
        for layer in range(30):
            per_group = [sum((layer, h) in gone for h in range(3 * j, 3 * j + 3)) for j in range(3)]
            assert sorted(per_group) == ([0, 3, 3] if unit == "groups" else [2, 2, 2])


@pytest.mark.slow
def test_heads_prune_of_a_committed_curve_point_loads_in_stock_transformers(smollm2, tmp_path, capsys):
    """A point of the committed SmolLM2 curve: `heads prune --curve` saves safetensors that stock
    transformers loads, whose logits equal the ablated model's, in fewer bytes than the model."""
    from multihead.interop.loaders import gguf_cache_folder, smollm2_path

    r = json.loads(CURVE.read_text(encoding="utf-8"))
    point = min((p for c in r["curves"].values() for p in c["importance"]), key=lambda p: p["num_attention_heads"])
    unit = next(u for u, c in r["curves"].items() if point in c["importance"])
    out = tmp_path / "pruned"
    code = main(["heads", "prune", "--model", "smollm2", "--curve", str(CURVE), "--at",
                 f"{unit}:{point['fraction']:g}", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert (back.config.num_attention_heads, back.config.num_key_value_heads) == \
        (point["num_attention_heads"], point["num_key_value_heads"])
    # Equal in exact arithmetic, so compared in float64: in float32 the pruned model (narrower
    # matrices, transformers' own attention) and the ablated one (zeroed heads, multihead's)
    # sum 30 layers in different orders, and their logits differ by what that reordering
    # costs on the CPU at hand (8.7e-4 of logits near 24 on an AMD EPYC, under 1e-5 on an Intel
    # Xeon). In float64 the same reordering costs about 2^-29 of that (eps64 / eps32); the
    # bound, 1e-9 of the logits' scale, leaves a thousandfold margin, and a head kept or
    # removed by mistake moves the logits by 1e-2 or more.
    x = smollm2.tokenizer("In the beginning God created the heaven and the earth.", return_tensors="pt")["input_ids"]
    ablated = smollm2.copy().model.double()
    with heads.ablate(ablated, [tuple(h) for h in point["removed"]]):
        ref = _logits(ablated, x)
    got = _logits(back.double(), x)
    scale = ref.abs().max().item()
    assert ref.dtype == got.dtype == torch.float64 and (got - ref).abs().max().item() <= 1e-9 * scale, \
        f"max diff {(got - ref).abs().max().item():.2e}, logits' scale {scale:.1f}"
    from multihead.files import usual_mode

    assert {f.stat().st_mode & 0o777 for f in out.iterdir()} == {usual_mode()}  # not transformers' 0600
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    whole = sum(f.stat().st_size for f in gguf_cache_folder(smollm2_path()).glob("*.safetensors"))
    assert size < whole, (size, whole)


@pytest.mark.parametrize("argv,message", [
    (["--curve", "CURVE"], "needs --at"),
    (["--curve", "CURVE", "--at", "groups:0.25"], "valid: groups:0, groups:0.5, heads:0, heads:0.5"),
    (["--curve", "CURVE", "--at", "layers:0.5"], "is not a point of"),
    (["--curve", "CURVE", "--at", "heads:0.5", "--remove", "0.1"], "not both"),
    (["--remove", "0.1", "--at", "heads:0.5"], "give --curve too"),
    (["--curve", "MISSING", "--at", "heads:0.5"], "not a results.json"),
    ([], "give the heads to remove"),
])
def test_prune_curve_flags_refuse_in_one_line(capsys, tmp_path, argv, message):
    curve = tmp_path / "results.json"
    point = {"removed": [[0, 0]], "fraction": 0.0}
    curve.write_text(json.dumps({"curves": {u: {"importance": [point, {**point, "fraction": 0.5}]}
                                            for u in ("groups", "heads")}}), encoding="utf-8")
    argv = [str(curve) if a == "CURVE" else str(tmp_path / "nothing.json") if a == "MISSING" else a for a in argv]
    code = main(["heads", "prune", "--model", "smollm2", "--out", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
