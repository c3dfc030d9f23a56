"""`multihead lab induction` (quick): accuracy above chance, head-role scores, inspect."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lab_helpers import assert_png, load_results, numbers
from multihead.lab.induction import InductionConfig, repeated_segments, run_induction


def test_data_has_one_answer_per_prediction():
    cfg = InductionConfig()
    x, y, m = repeated_segments(cfg, 64, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == m.shape == (64, cfg.seq_len - 1)
    for b in range(64):
        seq = torch.cat([x[b], y[b, -1:]])
        for t in m[b].nonzero().flatten().tolist():
            # the current token occurred exactly once before, and what followed it is the target
            earlier = (seq[:t] == seq[t]).nonzero().flatten().tolist()
            assert len(earlier) == 1 and seq[earlier[0] + 1] == y[b, t]
        L = int(m[b].sum()) + 1
        assert cfg.seg_min <= L <= cfg.seg_max


def test_quick_learns_and_scores_heads(tmp_path, one_torch_thread):
    cfg = InductionConfig.quick()
    res = run_induction(cfg, tmp_path, progress=False)
    disk = load_results(tmp_path, required=["evals", "final_accuracy", "previous_token_head", "induction_head",
                                            "phase_change_step", "summary"])
    r = disk["results"]
    chance = r["chance_accuracy"]
    assert chance == 1 / cfg.vocab
    assert r["evals"][0]["accuracy"] < 2 * chance
    # The quick run forms its induction head by about step 150 (100% accuracy); ask for less.
    assert r["final_accuracy"] > 0.5, f"accuracy {r['final_accuracy']:.2f}, chance {chance:.2f}"
    assert r["induction_head"]["score"] > 0.5 and r["previous_token_head"]["score"] > 0.3
    for e in r["evals"]:
        for key in ("previous_token", "induction"):
            scores = torch.tensor(e[key])
            assert scores.shape == (cfg.n_layers, cfg.n_heads)
            assert ((scores >= 0) & (scores <= 1)).all()
    assert r["previous_token_head"]["layer"] == 0 and r["induction_head"]["layer"] == 1
    assert r["phase_change_step"] in [e["step"] for e in r["evals"]]
    assert_png(tmp_path / "induction.png")
    # the checkpoint opens in multihead inspect, with the same role scores
    from multihead.inspect.roles import induction_scores

    final = induction_scores(str(tmp_path), seq_len=cfg.seq_len // 2, seed=3_000_017, batch=cfg.score_sequences)
    torch.testing.assert_close(final, torch.tensor(r["evals"][-1]["induction"]), atol=1e-5, rtol=1e-5)
    assert res["checkpoint"] == "model"


def test_same_seed_same_numbers_and_ctrl_c(tmp_path, one_torch_thread):
    cfg = replace(InductionConfig.quick(), steps=8, eval_every=4, eval_sequences=8, score_sequences=1)
    a = run_induction(cfg, tmp_path / "a", seed=1, progress=False)
    b = run_induction(cfg, tmp_path / "b", seed=1, progress=False)
    assert numbers(a["results"]) == numbers(b["results"])

    def callback(name, step, loss):
        if step == 5:
            raise KeyboardInterrupt

    run_induction(cfg, tmp_path / "c", seed=1, callback=callback, progress=False)
    disk = load_results(tmp_path / "c")
    assert disk["interrupted"] is True and disk["results"]["steps_done"] == 5
    assert [e["step"] for e in disk["results"]["evals"]] == [0, 4]
    assert disk["results"]["loss"] == a["results"]["loss"][:5]


def test_bad_config():
    with pytest.raises(ValueError, match="seg_max"):
        InductionConfig(vocab=16, seg_max=16, seg_min=4, seq_len=40)


# ------------------------------------------------------------------ summaries and the plot


def _evals(cfg, curve, acc, head=0):
    """Synthetic evaluations: the induction score of layer-1 head `head` follows `curve`."""
    out = []
    for k, (c, a) in enumerate(zip(curve, acc)):
        ind = [[0.05] * cfg.n_heads for _ in range(cfg.n_layers)]
        ind[-1][head] = c
        out.append({"step": k * cfg.eval_every, "accuracy": a, "loss": 1.0,
                    "previous_token": [[0.9] + [0.1] * (cfg.n_heads - 1)] * cfg.n_layers, "induction": ind})
    return out


def _analysed(cfg, evals):
    from multihead.lab.induction import _analyse

    res = {"results": {"evals": evals, "steps_done": evals[-1]["step"], "chance_accuracy": 1 / cfg.vocab,
                       "diverged_at": None, "geometry": {}}}
    _analyse(cfg, res)
    return res["results"]


def test_summary_says_nothing_where_nothing_was_measured():
    cfg = replace(InductionConfig.quick(), steps=25, eval_every=25)
    r = _analysed(cfg, _evals(cfg, [0.06, 0.058], [0.03, 0.031]))  # a --quick-sized run: no rise
    text = r["summary"]
    assert "+-" not in text and "half its rise" not in text and "by step 0" not in text, text
    assert "did not rise between steps 0 and 25 (0.06 -> 0.06" in text and "no phase change" in text
    assert "The accuracy did not rise (3.0% -> 3.1%)" in text
    assert r["phase_change_step"] is None and r["induction_half_rise_step"] is None and r["accuracy_jump_step"] is None


def test_summary_names_the_phase_change_when_there_is_one():
    cfg = replace(InductionConfig.quick(), steps=200, eval_every=50)
    r = _analysed(cfg, _evals(cfg, [0.05, 0.1, 0.8, 0.9, 0.92], [0.03, 0.05, 0.7, 0.95, 0.97], head=1))
    assert r["phase_change_step"] == 100 and r["accuracy_jump_step"] == 100 and r["induction_half_rise_step"] == 100
    text = r["summary"]
    assert "rose from 0.05 to 0.92, most sharply just before step 100 (+0.70 in the 50 steps before it)" in text
    assert "half way by step 100" in text and "accuracy jumped most just before step 100 (3.0% -> 97.0%" in text
    one = _analysed(cfg, _evals(cfg, [0.5], [0.5]))
    assert "Only 1 evaluation: no rise can be measured" in one["summary"]


def test_sixteen_heads_get_sixteen_colours_and_legends_cover_no_curve(monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_hex

    import multihead.lab.induction as induction
    from multihead.lab.plots import distinct_colours

    for n in (2, 10, 16, 20, 32):
        assert len({to_hex(c) for c in distinct_colours(n)}) == n
    kept = []
    monkeypatch.setattr(induction, "save_figure", lambda fig, path: kept.append(fig) or "induction.png")  # keeps it
    cfg = replace(InductionConfig.quick(), n_heads=16, d_model=64, steps=200, eval_every=50)
    r = _analysed(cfg, _evals(cfg, [0.05, 0.1, 0.8, 0.9, 0.92], [0.03, 0.05, 0.7, 0.95, 0.97], head=3))
    induction._plot(cfg, {"results": r}, "induction.png")  # the plot alone, from made-up evals: no training run
    fig = kept[0]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        lines = [line for line in ax.get_lines() if line.get_label().startswith("head")]
        if lines:
            assert len({to_hex(line.get_color()) for line in lines}) == 16
        legend = ax.get_legend()
        assert legend is not None
        box, area = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
        assert box.x0 >= area.x1 - 1, "the legend overlaps the plotting area"
    texts = [t for t in fig.axes[2].texts if "phase change" in t.get_text()]
    assert len(texts) == 1
