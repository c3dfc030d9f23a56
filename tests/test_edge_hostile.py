"""The circuits tools (edges, edge_patch, edge_scores, faithfulness_curve) against inputs a hostile user
gives: each either computes what the model computes (checked against the model's own forward or
against the same call written the accepted way) or refuses with an error that names what it received."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from conftest import hooks
from multihead import heads
from multihead.heads.edge_graph import Graph, edge_name
from test_edge_circuits import make, metric, pair

V = 40


@pytest.fixture(scope="module")
def llama():
    model = make("llama")
    model.requires_grad_(False)
    return model


def _tiny_llama(**kw):
    torch.manual_seed(0)
    return transformers.LlamaConfig(**{"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
                                       "num_attention_heads": 2, "vocab_size": V, **kw})


def test_curve_reads_scores_keyed_by_names_as_by_pairs(llama):
    """A mapping keyed by 'sender->receiver' names ranked every edge as 0 (its keys were looked up as pairs)."""
    clean, corrupted = pair(11)
    s = heads.edge_scores(llama, clean, corrupted, metric, method="eap")
    fr = [0.02, 0.1, 1.0]
    want = heads.faithfulness_curve(llama, clean, corrupted, metric, s, fractions=fr)
    named = heads.faithfulness_curve(llama, clean, corrupted, metric, {edge_name(e): v for e, v in s.items()},
                                     fractions=fr)
    pairs = heads.faithfulness_curve(llama, clean, corrupted, metric, dict(s), fractions=fr)
    assert named["faithfulness"] == pytest.approx(want["faithfulness"], rel=1e-12, abs=1e-15)
    assert pairs["faithfulness"] == pytest.approx(want["faithfulness"], rel=1e-12, abs=1e-15)
    E = heads.edges(llama)
    cases = [
        (ValueError, "not in this model's graph", {**dict(s), ("input", (9, 0, "q")): 5.0}),
        (ValueError, "another graph", heads.edge_scores(make("gpt2"), clean, corrupted, metric, method="eap")),
        (ValueError, "no edge", {}),
        (TypeError, r"real number; received 'x' \(str\)", {E[0]: "x"}),
        (ValueError, "twice", {E[0]: 1.0, edge_name(E[0]): 2.0}),
    ]
    for exc, words, scores in cases:
        with pytest.raises(exc, match=words):
            heads.faithfulness_curve(llama, clean, corrupted, metric, scores, fractions=[1.0])


def test_mean_ablation_refuses_references_it_cannot_average(llama):
    clean, corrupted = pair(12)
    E = heads.edges(llama)[:5]
    for bad in (torch.full((2, 7), V + 5), torch.full((2, 7), -1)):
        with pytest.raises(ValueError, match=r"reference holds token ids outside \[0, 40\)"):
            heads.edge_patch(llama, clean, None, metric, E, ablation="mean", reference=bad)
    with pytest.raises(ValueError, match="every position as padding"):
        heads.edge_patch(llama, clean, None, metric, E, ablation="mean",
                         reference={"input_ids": clean, "attention_mask": torch.zeros_like(clean)})


@pytest.mark.parametrize("value", [lambda lg: lg[:, -1, 0].mean() * (1 + 1j), lambda lg: lg.sum() > 0])
def test_complex_and_bool_metrics_are_refused_by_name(llama, value):
    clean, corrupted = pair(13)
    with pytest.raises(TypeError, match=r"returned a torch\.(complex128|bool) tensor"):
        heads.edge_patch(llama, clean, corrupted, value, heads.edges(llama))
    with pytest.raises(TypeError, match=r"returned a torch\.(complex128|bool) tensor"):
        heads.edge_scores(llama, clean, corrupted, value, method="eap")


def test_counts_are_ints_of_the_right_type_and_numpy_ints_count(llama):
    clean, corrupted = pair(14)
    s = heads.edge_scores(llama, clean, corrupted, metric, method="eap-ig", steps=np.int64(2),
                          batch_size=np.int64(2))
    ref = heads.edge_scores(llama, clean, corrupted, metric, method="eap-ig", steps=2, batch_size=2)
    assert torch.equal(s.matrix, ref.matrix) and s.top(np.int64(3)) == ref.top(3)
    for call in (lambda: heads.edge_scores(llama, clean, corrupted, metric, steps=1.5),
                 lambda: heads.edge_scores(llama, clean, corrupted, metric, steps=True),
                 lambda: heads.edge_scores(llama, clean, corrupted, metric, batch_size=1.0),
                 lambda: s.top("3"),
                 lambda: heads.faithfulness_curve(llama, clean, corrupted, metric, s, bootstrap=1.5)):
        with pytest.raises(TypeError, match=r"must be an int >= \d .*received .* \((float|bool|str)\)"):
            call()
    with pytest.raises(ValueError, match=r"steps must be an int >= 1 .*received 0"):
        heads.edge_scores(llama, clean, corrupted, metric, steps=0)
    assert "bogus" not in s and 5 not in s and heads.edges(llama)[0] in s


def test_bootstrap_seed_none_draws_and_a_float_seed_is_refused(llama):
    clean, corrupted = pair(15)
    s = heads.edge_scores(llama, clean, corrupted, metric, method="eap")

    def per_row(lg):
        return lg[:, -1, 3] - lg[:, -1, 5]
    state = torch.random.get_rng_state()
    c = heads.faithfulness_curve(llama, clean, corrupted, lambda lg: per_row(lg).mean(), s, fractions=[0.5, 1.0],
                                 bootstrap=20, per_row=per_row, seed=None)
    assert torch.equal(state, torch.random.get_rng_state())  # the caller's generator untouched
    lo, hi = c["cpr_interval"]
    assert lo <= hi
    for seed in (1.5, True, "0"):
        with pytest.raises(TypeError, match="seed must be an int or None"):
            heads.faithfulness_curve(llama, clean, corrupted, metric, s, bootstrap=5, per_row=per_row, seed=seed)


def test_fractions_take_numbers_only(llama):
    clean, corrupted = pair(16)
    s = heads.edge_scores(llama, clean, corrupted, metric, method="eap")
    for bad in ([True], ["0.5"]):
        with pytest.raises(TypeError, match=r"fractions must be numbers in \(0, 1\]; received"):
            heads.faithfulness_curve(llama, clean, corrupted, metric, s, fractions=bad)
    a = heads.faithfulness_curve(llama, clean, corrupted, metric, s, fractions=np.array([0.1, 1.0]))
    b = heads.faithfulness_curve(llama, clean, corrupted, metric, s, fractions=[0.1, 1.0])
    assert a["faithfulness"] == b["faithfulness"]


def test_keep_refuses_nodes_it_would_round_and_names_one_bare_edge(llama):
    clean, corrupted = pair(17)
    one = ("input", (1, 0, "q"))
    want = heads.edge_patch(llama, clean, corrupted, metric, [one, ("input", "logits")])
    assert heads.edge_patch(llama, clean, corrupted, metric, [("input", (np.int64(1), 0, "q")),
                                                              "input->logits"]) == want
    for node in ((1.0, 0, "q"), (True, 0, "q"), (1, 0, "x")):
        with pytest.raises(TypeError, match="a node is"):
            heads.edge_patch(llama, clean, corrupted, metric, [("input", node)])
    with pytest.raises(TypeError, match="wrap it in a list"):
        heads.edge_patch(llama, clean, corrupted, metric, one)
    with pytest.raises(ValueError, match="is not a node name"):  # a non-ASCII digit is no layer number
        heads.edge_patch(llama, clean, corrupted, metric, ["input->a\u0661.h0<q>"])


def test_cache_keywords_that_ask_for_nothing_are_accepted(llama):
    clean, corrupted = pair(18)
    E = heads.edges(llama)[::4]
    want = heads.edge_patch(llama, clean, corrupted, metric, E)
    got = heads.edge_patch(llama, {"input_ids": clean, "use_cache": False, "past_key_values": None},
                           {"input_ids": corrupted, "use_cache": False}, metric, E)
    assert got == want
    with pytest.raises(ValueError, match=r"'past_key_values' \(DynamicCache\)"):
        heads.edge_patch(llama, {"input_ids": clean, "past_key_values": transformers.DynamicCache()}, corrupted,
                         metric, E)


def test_models_off_the_graph_are_named():
    cfg = _tiny_llama()
    cases = [
        (TypeError, "LlamaModel has no LM head", transformers.LlamaModel(cfg)),
        (TypeError, "LlamaForSequenceClassification has no LM head",
         transformers.LlamaForSequenceClassification(_tiny_llama(pad_token_id=0))),
        (ValueError, "has no layers", transformers.LlamaForCausalLM(_tiny_llama(num_hidden_layers=0))),
    ]
    for exc, words, model in cases:
        with pytest.raises(exc, match=words):
            heads.edges(model)
    odd = transformers.LlamaForCausalLM(_tiny_llama(num_key_value_heads=3))  # transformers' own forward fails too
    with pytest.raises(ValueError, match="2 query heads and 3 key/value heads"):
        heads.edges(odd)


def test_gpt2_refuses_more_positions_than_it_learned():
    model = make("gpt2")
    ids = torch.randint(1, V, (1, 17))
    with pytest.raises(ValueError, match="clean has 17 positions; this model reads at most 16 .GPT-2.s learned"):
        heads.edge_patch(model, ids, ids, metric, [])


def test_compiled_model_gives_the_uncompiled_numbers(llama):
    clean, corrupted = pair(19)
    E = heads.edges(llama)[::3]
    compiled = torch.compile(llama)  # the edge forward reads weights: nothing is compiled or run through dynamo
    assert heads.edges(compiled) == heads.edges(llama)
    assert heads.edge_patch(compiled, clean, corrupted, metric, E) == heads.edge_patch(llama, clean, corrupted,
                                                                                        metric, E)


def test_hooks_the_edge_forward_would_skip_are_refused_and_called_ones_kept():
    model = make("llama")
    clean, corrupted = pair(20)
    E = heads.edges(model)
    h = model.model.layers[0].self_attn.o_proj.register_forward_hook(lambda m, a, out: out * 0)
    with pytest.raises(ValueError, match=r"forward hook on model\.layers\.0\.self_attn\.o_proj"):
        heads.edge_patch(model, clean, corrupted, metric, E)
    h.remove()
    h = model.model.layers[0].mlp.register_forward_hook(lambda m, a, out: out * 0.5)  # the MLP is called: kept
    with torch.no_grad():
        want = float(metric(model(clean).logits))
    assert heads.edge_patch(model, clean, corrupted, metric, E) == pytest.approx(want, rel=1e-10)
    h.remove()
    # transformers' own output-capturing hooks (installed once a forward asks for hidden states or
    # attentions) record and change nothing: the tools run beside them
    with torch.no_grad():
        model(clean, output_hidden_states=True, output_attentions=True)
        clean_metric = float(metric(model(clean).logits))
    assert any(hooks(layer)[0] for layer in model.model.layers)
    assert heads.edge_patch(model, clean, corrupted, metric, E) == pytest.approx(clean_metric, rel=1e-10)


def test_scores_that_are_not_finite_are_refused_not_returned(llama):
    """A metric whose gradient is infinite (as a float16 model's overflowing backward gives) made every
    score NaN or inf: faithfulness_curve then refused them and to_json wrote NaN, which is not JSON."""
    clean, corrupted = pair(1)
    with pytest.raises(ValueError, match=r"\d+ of 190 edge scores are not finite: .* torch\.float64"):
        heads.edge_scores(llama, clean, corrupted, lambda lg: lg[:, -1, 3].mean() * float("inf"), method="eap")


def test_a_keep_mask_with_entries_off_the_graph_is_refused(llama):
    """A True where a receiver reads no such sender (a later layer's) was ignored: the edge does not exist."""
    clean, corrupted = pair(2)
    g = Graph(3, 4, 2)
    assert g.edges == heads.edges(llama)
    mask = torch.zeros(len(g.receivers), len(g.senders), dtype=torch.bool)
    mask[0, -1] = True  # a0.h0<q> from the last MLP
    with pytest.raises(ValueError, match=r"marks 1 \(receiver, sender\) pair\(s\) that are no edge .*receiver 0 "):
        heads.edge_patch(llama, clean, corrupted, metric, mask)
    full = torch.zeros_like(mask)
    for r, n in enumerate(g.prefix):
        full[r, :n] = True
    assert heads.edge_patch(llama, clean, corrupted, metric, full) == heads.edge_patch(llama, clean, corrupted, metric,
                                                                                       heads.edges(llama))


def test_a_model_converted_to_mla_is_refused_and_one_converted_to_gqa_runs():
    """to_mla's latent attention has no per-head k/v projections: edges() raised AttributeError
    ('no attribute q_proj'). to_gqa's model is a stock Llama: all edges give its clean logits."""
    from multihead import convert

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=V, head_dim=8)).double().eval()
    with pytest.raises(ValueError, match=r"layer 0's attention \(LatentLlamaAttention\) has no q_proj"):
        heads.edges(convert.to_mla(model, 8, rope_dim=4))
    mqa = convert.to_gqa(model, 1)
    clean, corrupted = pair(3)
    with torch.no_grad():
        want = float(metric(mqa(clean).logits))
    # the stock RMSNorm rounds through float32 (6e-8) and the two forwards sum heads in different orders:
    # a few float32 roundings over 2 layers, far under 1e-6
    assert heads.edge_patch(mqa, clean, corrupted, metric, heads.edges(mqa)) == pytest.approx(want, rel=1e-6)
