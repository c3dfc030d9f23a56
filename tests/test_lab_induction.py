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
