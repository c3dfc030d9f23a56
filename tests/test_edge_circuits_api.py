"""Faithfulness curves, mean ablation, padding, refusals and hostile inputs of the circuits tools."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from conftest import hooks
from multihead import heads
from multihead.heads.edge_graph import edge_name
from multihead.heads.faithfulness import areas
from test_edge_circuits import Reference, make, metric, pair


@pytest.fixture(scope="module")
def llama():
    model = make("llama")
    model.requires_grad_(False)
    return model


def test_curve_is_edge_patching_of_the_top_edges(llama):
    clean, corrupted = pair(4)
    scores = heads.edge_scores(llama, clean, corrupted, metric, method="eap-ig", steps=2)
    fr = [0.01, 0.1, 0.5, 1.0]
    c = heads.faithfulness_curve(llama, clean, corrupted, metric, scores, fractions=fr)
    E = heads.edges(llama)
    with torch.no_grad():
        lo, hi = float(metric(llama(corrupted).logits)), float(metric(llama(clean).logits))
    assert c["edges_kept"] == [max(1, round(p * len(E))) for p in fr]
    assert c["metric_corrupted"] == pytest.approx(lo, rel=1e-10) and c["metric_clean"] == pytest.approx(hi, rel=1e-10)
    top = [e for e, _ in scores.top(len(E))]
    for n, f in zip(c["edges_kept"], c["faithfulness"]):
        m = heads.edge_patch(llama, clean, corrupted, metric, top[:n])
        assert f == pytest.approx((m - lo) / (hi - lo), rel=1e-9, abs=1e-12)
    assert c["faithfulness"][-1] == pytest.approx(1.0, abs=1e-9)
    # the trapezoids from p = 0, where F = 0, written out
    p, f = [0.0] + fr, [0.0] + c["faithfulness"]
    cpr = sum((p[i + 1] - p[i]) * (f[i] + f[i + 1]) / 2 for i in range(4))
    cmd = sum((p[i + 1] - p[i]) * (abs(1 - f[i]) + abs(1 - f[i + 1])) / 2 for i in range(4))
    assert c["cpr"] == pytest.approx(cpr, rel=1e-12) and c["cmd"] == pytest.approx(cmd, rel=1e-12)
    assert areas([0.5, 1.0], [1.0, 1.0]) == (0.75, 0.25)


def test_bootstrap_intervals_hold_the_estimate(llama):
    clean, corrupted = pair(5)
    scores = heads.edge_scores(llama, clean, corrupted, metric, method="eap")

    def last_diff(logits):  # a mean over rows of this: the per-row form of a last-token logit difference
        return logits[:, -1, 3] - logits[:, -1, 5]
    c = heads.faithfulness_curve(llama, clean, corrupted, lambda lg: last_diff(lg).mean(), scores,
                                 fractions=[0.05, 0.3, 1.0], bootstrap=200, per_row=last_diff)
    lo, hi = c["cpr_interval"]
    assert lo <= hi and c["bootstrap"] == 200
    with pytest.raises(ValueError, match="per_row"):
        heads.faithfulness_curve(llama, clean, corrupted, metric, scores, bootstrap=10)


def test_mean_ablation_equals_the_reference(llama):
    clean, _ = pair(6)
    reference, _ = pair(7)
    ref = Reference(llama)
    _, outs = ref.outputs(reference)
    means = {s: v.mean(dim=(0, 1)).expand(*clean.shape, -1) for s, v in outs.items()}
    E = heads.edges(llama)
    keep = set(E[::3])
    with torch.no_grad():
        want = float(metric(ref.run(clean, ref.input_of(clean), means, keep)[0]))
        m_clean = float(metric(llama(clean).logits))
    got = heads.edge_patch(llama, clean, None, metric, keep, ablation="mean", reference=reference)
    assert got == pytest.approx(want, rel=1e-9)
    assert heads.edge_patch(llama, clean, None, metric, E, ablation="mean", reference=reference) == \
        pytest.approx(m_clean, rel=1e-10)


def test_right_padding_follows_the_attention_mask(llama):
    clean, corrupted = pair(8)
    mask = torch.ones_like(clean)
    mask[0, -2:] = 0

    def first_rows(logits):  # reads only real positions
        return logits[:, 2, 3].mean() - logits[1:, -1, 5].mean()
    with torch.no_grad():
        want = float(first_rows(llama(input_ids=clean, attention_mask=mask).logits))
    got = heads.edge_patch(llama, {"input_ids": clean, "attention_mask": mask},
                           {"input_ids": corrupted, "attention_mask": mask}, first_rows, heads.edges(llama))
    assert got == pytest.approx(want, rel=1e-10)


def test_models_without_the_graph_are_refused_by_name():
    cfg = transformers.GPTNeoXConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                     vocab_size=20, use_parallel_residual=True)
    with pytest.raises(ValueError, match="parallel"):
        heads.edges(transformers.GPTNeoXForCausalLM(cfg))
    with pytest.raises(TypeError, match="transformers decoder"):
        heads.edges(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("extra, words", [({"attention_bias": True}, "attention_bias=True"),
                                          ({"use_bidirectional_attention": True}, "bidirectional")])
def test_gemma_layouts_off_the_graph_are_refused_by_name(extra, words):
    cfg = transformers.Gemma3TextConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=20,
                                        sliding_window=4, **extra)
    with pytest.raises(ValueError, match=words):
        heads.edges(transformers.Gemma3ForCausalLM(cfg))
    assert len(heads.edges(transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=8, vocab_size=20)))) == 4 + 3 + 4  # 2 q, 1 k, 1 v from input; m0 from input, 2 heads; logits from 4


def test_hostile_inputs_name_the_mistake_and_leave_the_model_as_it_was(llama):
    clean, corrupted = pair(9)
    E = heads.edges(llama)
    llama.train()
    llama.lm_head.weight.requires_grad_(True)
    hooks_before = sum(sum(hooks(m)[:2]) for m in llama.modules())
    cases = [
        (ValueError, "not in this model's graph", lambda: heads.edge_patch(llama, clean, corrupted, metric,
                                                                           ["a9.h0->logits"])),
        (ValueError, "not an edge name", lambda: heads.edge_patch(llama, clean, corrupted, metric, ["a0.h0"])),
        (TypeError, "wrap one name", lambda: heads.edge_patch(llama, clean, corrupted, metric, "input->logits")),
        (ValueError, "not in this model's graph", lambda: heads.edge_patch(llama, clean, corrupted, metric,
                                                                           [("input", (0, 9, "q"))])),
        (TypeError, "returned None", lambda: heads.edge_patch(llama, clean, corrupted, lambda lg: None, E)),
        (ValueError, "shape", lambda: heads.edge_patch(llama, clean, corrupted, lambda lg: lg[:, -1, 0], E)),
        (ValueError, "shape", lambda: heads.edge_scores(llama, clean, corrupted, lambda lg: lg[:, -1, 0])),
        (TypeError, "0-d tensor", lambda: heads.edge_scores(llama, clean, corrupted, lambda lg: 1.0)),
        (ValueError, "empty", lambda: heads.edge_patch(llama, clean[:0], corrupted[:0], metric, E)),
        (ValueError, "same shape", lambda: heads.edge_patch(llama, clean, corrupted[:, :-1], metric, E)),
        (ValueError, "past_key_values", lambda: heads.edge_patch(llama, {"input_ids": clean, "past_key_values": 1},
                                                                 corrupted, metric, E)),
        (ValueError, "use_cache", lambda: heads.edge_scores(llama, {"input_ids": clean, "use_cache": True},
                                                            corrupted, metric)),
        (ValueError, "method", lambda: heads.edge_scores(llama, clean, corrupted, metric, method="acdc")),
        (ValueError, "steps", lambda: heads.edge_scores(llama, clean, corrupted, metric, steps=0)),
        (ValueError, "fractions", lambda: heads.faithfulness_curve(llama, clean, corrupted, metric, {},
                                                                   fractions=[0.5, 0.1])),
        (ValueError, "ablation", lambda: heads.edge_patch(llama, clean, corrupted, metric, E, ablation="zero")),
        (ValueError, "reference=", lambda: heads.edge_patch(llama, clean, corrupted, metric, E, ablation="mean")),
        (ValueError, "outside", lambda: heads.edge_patch(llama, clean + 1000, corrupted, metric, E)),
    ]
    for exc, words, call in cases:
        with pytest.raises(exc, match=words):
            call()
    assert llama.training and all(m.training for m in llama.modules())
    assert llama.lm_head.weight.requires_grad and not llama.model.embed_tokens.weight.requires_grad
    assert sum(sum(hooks(m)[:2]) for m in llama.modules()) == hooks_before
    assert llama.lm_head.weight.grad is None
    llama.eval()
    llama.lm_head.weight.requires_grad_(False)


def test_edge_scores_mapping(llama):
    clean, corrupted = pair(10)
    s = heads.edge_scores(llama, clean, corrupted, metric, method="eap")
    E = heads.edges(llama)
    assert len(s) == len(E) and list(s) == E
    (e, v), = s.top(1)
    assert s[edge_name(e)] == v == s[e] and abs(v) == max(abs(s[x]) for x in E)
    j = s.to_json()
    assert j["method"] == "eap" and j["scores"][edge_name(e)] == v and len(j["scores"]) == len(E)
    with pytest.raises(KeyError):
        s[((2, 0), (1, 0, "q"))]  # layer 2 does not reach layer 1


@pytest.mark.slow
def test_cli_circuit_on_smollm2(capsys, tmp_path):
    """`multihead heads circuit --json` on 2 IOI pairs: its curve ends at the clean metric and its
    top edges are `edge_scores`' own."""
    import argparse

    from multihead.heads.circuit_cli import add_circuit_arguments, run_circuit

    parser = argparse.ArgumentParser(prog="multihead heads")
    add_circuit_arguments(parser.add_subparsers(dest="heads_command"))
    png, page = tmp_path / "c.png", tmp_path / "c.html"
    args = parser.parse_args(["circuit", "--n", "2", "--method", "eap", "--top", "5", "--json", "--png", str(png),
                              "--html", str(page)])
    assert run_circuit(args) == 0
    r = json.loads(capsys.readouterr().out)
    c = r["curve"]
    assert c["faithfulness"][-1] == pytest.approx(1.0, abs=1e-5) and len(r["top"]) == 5
    assert r["edges_total"] == 70651 and png.read_bytes()[:4] == b"\x89PNG" and "<svg" in page.read_text()
    from multihead.heads import tasks
    from multihead.interop.loaders import load_model

    lm = load_model("smollm2")
    task = tasks.ioi(2, seed=0, tokenizer=lm.tokenizer)
    s = heads.edge_scores(lm.model, task.clean, task.corrupted, task.metric, method="eap")
    assert [t["edge"] for t in r["top"]] == [edge_name(e) for e, _ in s.top(5)]


def test_qwen3_query_and_key_norms_are_inside_the_receivers():
    """Qwen3 normalizes each head's query and key after the projection: keeping every edge is the
    model's own forward, keeping none its corrupted forward."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=8, vocab_size=50)
    model = transformers.Qwen3ForCausalLM(cfg).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    clean = torch.randint(0, 50, (2, 6))
    corrupted = clean.clone()
    corrupted[:, 2] = (corrupted[:, 2] + 1) % 50
    with torch.no_grad():
        want, base = float(metric(model(clean).logits)), float(metric(model(corrupted).logits))
    assert heads.edge_patch(model, clean, corrupted, metric, heads.edges(model)) == pytest.approx(want, rel=1e-6)
    assert heads.edge_patch(model, clean, corrupted, metric, []) == pytest.approx(base, rel=1e-6)

