"""The data-aware conversions (calibration=): to_mla's keep="rotation" / basis="output" and
to_gqa's init="aligned" on small random transformers models, against independent
computations: the mean rotation of a dropped pair against the scores it averages, the
attention statistics against transformers' own eager attention weights, exactness where
nothing is merged or truncated, and the merge never worse than the mean in the metric it fits."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch

from multihead import convert
from multihead.interop.hf.calibrated import calibration_ids, layer_stats, turn_pairs
from multihead.interop.hf.mla import mla_layers, rope_pair_scores

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB, C, H, HKV, D = 97, 64, 4, 2, 16


def _llama(kind: str = "llama", seed: int = 0, **kw):
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=C, intermediate_size=96, num_hidden_layers=2, num_attention_heads=H,
                  num_key_value_heads=HKV, max_position_embeddings=128, attn_implementation="eager", head_dim=D)
    common.update(kw)
    cfg_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                          "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                          "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[kind]
    model = model_cls(cfg_cls(**common)).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return model


def _cal(seed: int = 1, shape=(3, 24)) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_turn_pairs_is_the_mean_rotation_of_the_scores():
    """sum_d w_d q . R(theta d) k over distances d (RoPE written out with cos/sin per pair)
    equals turn_pairs(q, a) . k for a = sum_d w_d e^{-i theta d}."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(D, generator=g, dtype=torch.float64), torch.randn(D, generator=g, dtype=torch.float64)
    theta = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    w = torch.rand(20, generator=g, dtype=torch.float64)
    w /= w.sum()

    def rope(x, pos):  # half-split: pair f is (f, f + D/2)
        c, s = torch.cos(pos * theta), torch.sin(pos * theta)
        x1, x2 = x[: D // 2], x[D // 2:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s])

    want = sum(float(w[d]) * float(rope(q, 30 + d) @ rope(k, 30)) for d in range(20))  # query d after the key
    a = (w.to(torch.complex128)[:, None] * torch.exp(-1j * torch.arange(20)[:, None] * theta[None])).sum(0)
    got = float(turn_pairs(q.view(1, D), a.view(1, -1)).view(-1) @ k)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_layer_stats_against_transformers_eager_attention():
    """The attention-weighted phasors and the query/key moments from transformers' own
    eager attention weights and projections (output_attentions=True)."""
    model = _llama()
    ids = _cal()
    layers = mla_layers(model)
    stats = layer_stats(model, layers, ids)
    with torch.no_grad():
        out = model(ids, output_attentions=True)
    T = ids.shape[1]
    theta = model.model.rotary_emb.inv_freq.double()
    turn = torch.exp(-1j * torch.arange(T, dtype=torch.float64)[:, None] * theta[None])  # (T, D/2)
    for (name, attn), p in zip(layers, out.attentions):
        st = stats[name]
        dist = torch.zeros(H, T, dtype=torch.float64)
        for i in range(T):
            for j in range(i + 1):
                dist[:, i - j] += p[:, :, i, j].sum(0)
        want = (dist / (ids.shape[0] * T)).to(torch.complex128) @ turn
        # transformers' eager softmax runs in float32 (even for a float64 model): its rounding, ~1e-7
        torch.testing.assert_close(st.phasor, want, rtol=0, atol=1e-6)
        x = st.x
        q = attn.q_proj(x).view(-1, H, D)
        torch.testing.assert_close(st.q2, q.square().mean(0), rtol=1e-10, atol=0)
        assert st.value_scale.shape == (H,) and bool((st.value_scale > 0).all())


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_full_configuration_is_exact_with_calibration(kind):
    """Every pair rotary and the full rank: the output basis loses nothing (float64; sdpa, as
    eager attention takes its softmax in float32)."""
    model = _llama(kind, attn_implementation="sdpa")
    cal = _cal()
    new, report = convert.to_mla(model, HKV * D, rope_dim=HKV * D, calibration=cal, return_report=True)
    assert report.init == "output-pca, rope rotation"
    ids = _cal(7, (2, 11))
    tol = 1e-6 if kind == "qwen3" else 1e-9  # the MLA layer takes Qwen3's q norm in float32, as RMSNorm does
    torch.testing.assert_close(_logits(new, ids), _logits(model, ids), rtol=0, atol=tol)


def test_the_report_names_the_pairs_kept_and_they_carry_most_rotation():
    model = _llama()
    cal = _cal()
    new, report = convert.to_mla(model, 12, rope_dim=8, calibration=cal, return_report=True)
    stats = layer_stats(model, mla_layers(model), cal)
    for row, layer, (name, _) in zip(report.layers, new.model.layers, mla_layers(model)):
        assert row.rope_pairs == tuple(tuple(p) for p in layer.self_attn.rope_pairs.tolist())
        st = stats[name]
        half = D // 2
        for j, kept in enumerate(row.rope_pairs):  # independent of _rotation_scores: per pair, written out
            score = []
            for f in range(half):
                s = 0.0
                for h in range(j * (H // HKV), (j + 1) * (H // HKV)):
                    qn = float(st.q2[h, f] + st.q2[h, f + half])
                    s += float(st.value_scale[h]) * qn * (1 - abs(complex(st.phasor[h, f])) ** 2)
                score.append(s * float(st.k2[j, f] + st.k2[j, f + half]))
            assert set(kept) == set(sorted(range(half), key=lambda f: -score[f])[: len(kept)])
    assert math.isfinite(_logits(new, _cal(3, (1, 9))).sum().item())


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_aligned_merge_keeping_every_head_is_exact(kind):
    model = _llama(kind, num_key_value_heads=H, attn_implementation="sdpa")  # float64 throughout
    new = convert.to_gqa(model, H, calibration=_cal())
    ids = _cal(5, (2, 10))
    torch.testing.assert_close(_logits(new, ids), _logits(model, ids), rtol=0, atol=1e-9)


def _value_error(model, new, ids) -> float:
    """Sum over layers of E||o_proj(values per query head) - original||^2 on `ids` with the
    attention weights held at the original's: the metric the value merge minimises."""
    caught = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda mod, args, kw, i=i: caught.__setitem__(i, kw["hidden_states"]), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    total = 0.0
    for i, (a, b) in enumerate(zip(model.model.layers, new.model.layers)):
        x = caught[i]
        a, b = a.self_attn, b.self_attn

        def per_head(attn, x=x):
            v = attn.v_proj(x).view(*x.shape[:2], -1, D)  # (B, T, Hkv, D)
            v = v.repeat_interleave(H // v.shape[2], dim=2)  # (B, T, H, D)
            wo = attn.o_proj.weight.view(C, H, D)
            return torch.einsum("chd,bthd->bthc", wo, v)

        with torch.no_grad():
            total += float((per_head(a) - per_head(b)).square().sum())
    return total


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_aligned_mqa_values_lose_less_than_the_mean(kind):
    model = _llama(kind)
    cal = _cal(shape=(4, 32))
    ids = cal
    aligned, report = convert.to_gqa(model, 1, calibration=cal, return_report=True)
    mean = convert.to_gqa(model, 1)
    assert report.init == "aligned" and all(0 < e < 1.5 for e in report.errors)
    assert _value_error(model, aligned, ids) < _value_error(model, mean, ids)
    assert aligned.config.num_key_value_heads == 1 and torch.isfinite(_logits(aligned, ids)).all()


def test_calibration_text_needs_the_tokenizer_and_bad_calibration_is_named():
    with pytest.raises(TypeError, match=r"calibration text needs the model's tokenizer"):
        calibration_ids("In the beginning", None)
    ids = calibration_ids("a b " * 300, lambda text: {"input_ids": list(range(len(text.split())))})
    assert ids.shape == (2, 256)
    model = _llama()
    with pytest.raises(ValueError, match=r"init='aligned' fits the merge on calibration tokens"):
        convert.to_gqa(model, 1, init="aligned")
    with pytest.raises(ValueError, match=r"received init='mean' with calibration=given"):
        convert.to_gqa(model, 1, init="mean", calibration=_cal())
    with pytest.raises(ValueError, match=r"keep='rotation' reads the layers on calibration tokens"):
        convert.to_mla(model, 8, rope_dim=4, keep="rotation")
    with pytest.raises(TypeError, match=r"received a torch.float32 tensor"):
        convert.to_gqa(model, 1, calibration=torch.zeros(4))


@pytest.mark.parametrize("bad", [-1, VOCAB])
def test_calibration_ids_outside_the_vocabulary_are_refused_by_name(bad):
    """An id past the embedding raised torch's IndexError from inside the model's forward."""
    model = _llama()
    ids = _cal()
    ids[1, 5] = bad
    want = rf"calibration holds token id {bad}, outside the model's vocabulary; valid: ids in \[0, {VOCAB - 1}\]"
    for call in (lambda: convert.to_gqa(model, 1, calibration=ids),
                 lambda: convert.to_mla(model, 8, rope_dim=4, calibration=ids),
                 lambda: rope_pair_scores(model, calibration=ids),
                 lambda: convert.to_mla(model, 8, rope_dim=4, calibration="a b c", tokenizer=lambda text: {
                     "input_ids": [0, bad, 2]})):
        with pytest.raises(ValueError, match=want):
            call()
    new = convert.to_gqa(model, 1, calibration=ids.clamp(0, VOCAB - 1))
    assert new.config.num_key_value_heads == 1


def test_gemma3_is_refused_by_name():
    """Gemma 3: to_mla explains its QK-norm and two RoPE bases; to_gqa of a one-KV-head model
    (Gemma 3 270M's geometry) says there is nothing to merge."""
    cfg = transformers.Gemma3TextConfig(vocab_size=VOCAB, hidden_size=C, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=H, num_key_value_heads=1, head_dim=D, sliding_window=5,
                                        query_pre_attn_scalar=D, max_position_embeddings=64)
    torch.manual_seed(0)
    gemma = transformers.Gemma3ForCausalLM(cfg).eval()
    with pytest.raises(ValueError, match=r"Gemma 3, which is not converted to MLA: it normalises every query and "
                                         r"key head \(QK-norm"):
        convert.to_mla(gemma, 8, rope_dim=4)
    with pytest.raises(ValueError, match=r"has one key/value head already .*Gemma 3 270M is built so.*no heads to "
                                         r"merge"):
        convert.to_gqa(gemma, 1)
    with pytest.raises(ValueError, match=r"has one key/value head already"):
        convert.to_gqa(gemma, 1, calibration=_cal())


def test_the_docs_quote_the_committed_conversion_table():
    """docs/mla.md quotes the table benchmarks/convert_smollm2.py wrote (docs/lab/uptrain-smollm2/
    conversion.json) verbatim, the table is what the script's code makes of the rows, every
    other number of the section is one of the file's, and the data-aware rows meet the
    targets: MLA at 25,920 B/token within 2x the base, at 10,560 within 5x, MQA within 10x."""
    import importlib.util
    import json
    import re
    from pathlib import Path

    from conftest import json_numbers

    root = Path(__file__).resolve().parent.parent
    committed = root / "docs" / "lab" / "uptrain-smollm2" / "conversion.json"
    if not committed.is_file():
        pytest.skip("no committed conversion table yet")
    res = json.loads(committed.read_text(encoding="utf-8"))
    spec = importlib.util.spec_from_file_location("convert_smollm2", root / "benchmarks" / "convert_smollm2.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.table(res) == res["table"]
    doc = (root / "docs" / "mla.md").read_text(encoding="utf-8")
    start = doc.index("### With calibration text")
    section = doc[start:doc.index("\n### ", start + 1)]
    assert res["table"] in section
    best = {}
    for row in res["rows"]:
        assert row["kv_bytes_per_token"] <= row["budget"], row
        if row["method"] == "multihead":
            best[row["budget"]] = min(best.get(row["budget"], math.inf), row["ratio_to_base"])
    assert best[25_920] <= 2 and best[10_560] <= 5 and best[15_360] <= 10, best

    pool = json_numbers(res)
    rest = re.sub(r"```.*?```", "", section.replace(res["table"], ""), flags=re.S)
    for text in re.findall(r"(?<![\w.])-?\d+(?:,\d{3})+(?:\.\d+)?|(?<![\w.])-?\d+\.\d+", rest):
        value = float(text.replace(",", ""))
        places = len(text.split(".")[1]) if "." in text else 0
        assert any(abs(value - p) <= 0.5 * 10 ** -places for p in pool), f"docs/mla.md quotes {text}, not in the file"


def test_what_a_tokenizer_returns_is_read_as_one_row_of_integer_ids_or_refused_by_name():
    """A tokenizer returning a (1, T) batch gave a 3-D calibration (transformers' unpacking error from
    inside the forward); float ids were truncated to ints; None raised 'not subscriptable'."""
    model = _llama()
    ids = _cal(shape=(24,))
    want = convert.to_gqa(model, 1, calibration=ids)
    for returned in ({"input_ids": ids[None]}, {"input_ids": ids.tolist()}, {"input_ids": [ids.tolist()]}):
        got = convert.to_gqa(model, 1, calibration="a text", tokenizer=lambda text, r=returned: r)
        # the same ids: the same conversion (to rounding: its eigensolver need not sum in one order twice)
        assert all(torch.allclose(a, b, rtol=0, atol=1e-12) for a, b in zip(got.state_dict().values(),
                                                                               want.state_dict().values()))
    cases = [
        (TypeError, r"to_gqa: the tokenizer returned input_ids of torch\.float32; valid: integer token ids",
         {"input_ids": [1.5, 2.0, 3.0]}),
        (TypeError, r"to_gqa: the tokenizer returned NoneType; valid: a mapping with input_ids", None),
        (ValueError, r"to_gqa: the tokenizer returned input_ids of shape \(2, 3\) for one text",
         {"input_ids": [[1, 2, 3], [4, 5, 6]]}),
    ]
    for exc, words, returned in cases:
        with pytest.raises(exc, match=words):
            convert.to_gqa(model, 1, calibration="a text", tokenizer=lambda text, r=returned: r)


@pytest.mark.parametrize("shape", [(1, 3, 8), (), (2, 0), (1,), (3, 1)])
def test_calibration_ids_of_a_wrong_shape_are_a_value_error_naming_it(shape):
    """A rank or a length is a value (ValueError); one position has no distance to attend over, as
    a one-token text (refused already) has none."""
    model = _llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.zeros(shape, dtype=torch.long)
    want = f"calibration must be token ids (T,) or (B, T) with T >= 2; received shape {tuple(shape)}"
    for fn, call in (("to_gqa", lambda: convert.to_gqa(model, 1, calibration=ids)),
                     ("to_mla", lambda: convert.to_mla(model, 8, rope_dim=4, calibration=ids))):
        with pytest.raises(ValueError, match=re.escape(f"{fn}: {want}")):
            call()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("convert_it", [lambda m: convert.to_gqa(m, 1, calibration=_cal()),
                                        lambda m: convert.to_mla(m, 8, rope_dim=4, calibration=_cal())])
def test_a_compiled_model_is_refused_by_name(convert_it):
    """torch.compile(model) is not the transformers model it wraps: to_gqa's refusal named an init
    and a calibration that were not what was given."""
    model = _llama()
    for compiled_model in (torch.compile(model), copy.deepcopy(model)):
        if compiled_model is not model and not hasattr(compiled_model, "_orig_mod"):
            compiled_model.compile()
        with pytest.raises(ValueError, match=r"is compiled \(torch.compile\); .*valid: the uncompiled model"):
            convert_it(compiled_model)


def test_the_deepseek_rope_widths_in_the_docs_are_the_committed_conversions():
    """docs/mla.md's table of what `widen_rope=True` costs on SmolLM2 quotes conversion.json's
    "deepseek_rope" of each data-aware MLA row, and those are what the row's own rotary pairs
    give: each kept frequency (a pair index: SmolLM2 has one RoPE base) as often as the layer
    that keeps it most often, the rule `rope_slots` implements."""
    import collections
    import json
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    committed = root / "docs" / "lab" / "uptrain-smollm2" / "conversion.json"
    if not committed.is_file():
        pytest.skip("no committed conversion table yet")
    res = json.loads(committed.read_text(encoding="utf-8"))
    rows = {(r["kv_rank"], r["rope_dim"]): r for r in res["rows"] if "deepseek_rope" in r}
    assert {(192, 24), (144, 72), (64, 24), (40, 48)} <= set(rows)
    for (rank, rope), row in rows.items():
        need: collections.Counter = collections.Counter()
        for layer in row["rope_pairs"]:
            assert all(len(head) == rope // 2 // len(layer) for head in layer)
            for f, n in collections.Counter(p for head in layer for p in head).items():
                need[f] = max(need[f], n)
        assert row["deepseek_rope"] == {"distinct_frequencies": len(need), "pairs": sum(need.values()),
                                        "rope_dims": 2 * sum(need.values())}, (rank, rope)
    doc = (root / "docs" / "mla.md").read_text(encoding="utf-8")
    quoted = re.findall(r"^\s*\| ([\d +()a-z]+?) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \((\d+)\) \|$", doc, flags=re.M)
    assert len(quoted) == 3, quoted
    for label, pairs_per_head, distinct, pairs, dims, instead in quoted:
        rank, rope = (int(x) for x in re.match(r"(\d+) \+ (\d+)", label).groups())
        d = rows[(rank, rope)]["deepseek_rope"]
        assert (int(distinct), int(pairs), int(dims), int(instead)) == (d["distinct_frequencies"], d["pairs"],
                                                                        d["rope_dims"], rope)
        assert int(pairs_per_head) == rope // 2 // 3  # SmolLM2's 3 key heads
        also = re.search(r"and (\d+) \+ (\d+)", label)
        if also:  # a second conversion that keeps the same widths
            assert rows[tuple(int(x) for x in also.groups())]["deepseek_rope"] == d
