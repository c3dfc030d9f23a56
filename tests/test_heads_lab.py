"""`lab induction`'s causal check (multihead.lab.ablation): accuracies against hand-written
hooks zeroing o_proj's input slice, and the quick run's results.ablation, summary and plot."""

from __future__ import annotations

import torch

from lab_helpers import assert_png, load_results
from multihead.decoder import LabTransformer
from multihead.lab.ablation import ablation_check
from multihead.lab.induction import InductionConfig, model_config, repeated_segments, run_induction


def _by_hand(model, held_out, ablated):
    x, y, m = held_out
    D = model.cfg.head_dim
    hooks = []
    for layer, h in ablated:
        def zero(mod, args, h=h):
            z = args[0].clone()
            z[..., h * D:(h + 1) * D] = 0
            return (z,)
        hooks.append(model.blocks[layer].attn.o_proj.register_forward_pre_hook(zero))
    with torch.no_grad():
        acc = float((model(x).argmax(-1) == y)[m].float().mean())
    for hk in hooks:
        hk.remove()
    return acc


def test_ablation_check_equals_zeroing_by_hand(one_torch_thread):
    cfg = InductionConfig.quick()
    torch.manual_seed(0)
    model = LabTransformer(model_config(cfg))
    with torch.no_grad():  # sharpen a random model so that heads move the argmax
        for p in model.parameters():
            p.mul_(8)
    held = repeated_segments(cfg, 32, torch.Generator().manual_seed(1))
    r = {"previous_token_head": {"layer": 0, "head": 1}, "induction_head": {"layer": 1, "head": 0},
         "evals": [{"induction": [[0.1, 0.2], [0.9, 0.7]]}]}  # both layer-1 heads score above 0.5
    ab = ablation_check(model, held, r)
    assert ab["induction_heads"] == [[1, 0], [1, 1]]
    assert ab["induction_heads_accuracy"] == _by_hand(model, held, [(1, 0), (1, 1)])
    for layer in range(cfg.n_layers):
        for h in range(cfg.n_heads):
            assert ab["accuracy"][layer][h] == _by_hand(model, held, [(layer, h)])
    assert ab["circuit_accuracy"] == _by_hand(model, held, [(0, 1), (1, 0)])
    assert ab["baseline"] == _by_hand(model, held, [])
    assert len({round(a, 6) for row in ab["accuracy"] for a in row} | {ab["baseline"]}) > 1


def test_quick_induction_reports_the_ablation(tmp_path, one_torch_thread):
    cfg = InductionConfig.quick()
    run_induction(cfg, tmp_path, progress=False)
    r = load_results(tmp_path, required=["ablation", "summary"])["results"]
    ab = r["ablation"]
    assert torch.tensor(ab["accuracy"]).shape == (cfg.n_layers, cfg.n_heads)
    p, i = r["previous_token_head"], r["induction_head"]
    assert ab["circuit"] == [[p["layer"], p["head"]], [i["layer"], i["head"]]]
    # the trained circuit matters: without both named heads the accuracy falls far
    assert ab["circuit_accuracy"] < ab["baseline"] - 0.3, ab
    assert "Ablating heads" in r["summary"]
    assert_png(tmp_path / "ablation.png")
