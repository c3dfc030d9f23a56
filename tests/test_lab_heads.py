"""`multihead lab heads` (quick): learning, results schema, plot, determinism, Ctrl-C."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from lab_helpers import assert_png, load_results, numbers
from multihead.lab.heads import HeadsConfig, conclusion, run_heads

# Chance is ln(16) = 2.77 nats; the quick run gets ~0.015. Below 0.5 means it copies.
LEARNED = 0.5


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("heads")
    res = run_heads(HeadsConfig.quick(), out, seed=0, progress=False)
    torch.set_num_threads(old)
    return out, res


def test_quick_learns_and_validates(quick):
    out, res = quick
    disk = load_results(out, required=["runs", "by_heads", "table", "conclusion"])
    assert disk == json.loads(json.dumps(res))
    assert not disk["interrupted"] and disk["experiment"] == "heads"
    cfg = HeadsConfig.quick()
    assert [r["n_heads"] for r in disk["results"]["by_heads"]] == list(cfg.head_counts)
    for run in disk["results"]["runs"]:
        assert run["loss"][0] > 2.0, "training starts near chance"
        assert run["final_loss"] < LEARNED, f"H={run['n_heads']} seed {run['seed']}: loss {run['final_loss']:.3f}"
        assert run["final_accuracy"] > 0.9
    assert_png(out / "loss.png")
    assert disk["checkpoint"] == "model" and (out / "model" / "model.safetensors").is_file()
    assert "n_heads = " in disk["results"]["conclusion"]


def test_same_seed_same_numbers(tmp_path, one_torch_thread):
    cfg = replace(HeadsConfig.quick(), head_counts=(2,), n_seeds=1, steps=15)
    a = run_heads(cfg, tmp_path / "a", seed=3, progress=False)
    b = run_heads(cfg, tmp_path / "b", seed=3, progress=False)
    c = run_heads(cfg, tmp_path / "c", seed=4, progress=False)
    assert numbers(a["results"]) == numbers(b["results"])
    assert numbers(a["results"]) != numbers(c["results"])


def test_ctrl_c_keeps_what_finished(tmp_path, one_torch_thread):
    cfg = replace(HeadsConfig.quick(), head_counts=(1, 2), n_seeds=1, steps=12)

    def callback(name, step, loss):
        if "H=2" in name and step == 5:
            raise KeyboardInterrupt

    res = run_heads(cfg, tmp_path, callback=callback, progress=False)
    disk = load_results(tmp_path)
    assert disk["interrupted"] is True and res["interrupted"] is True
    runs = disk["results"]["runs"]
    assert [(r["n_heads"], r["interrupted"], r["steps_done"]) for r in runs] == [(1, False, 12), (2, True, 5)]
    assert [r["n_heads"] for r in disk["results"]["by_heads"]] == [1], "only finished runs are summarised"
    assert_png(tmp_path / "loss.png")


def test_conclusion_is_read_off_the_numbers():
    cfg = HeadsConfig()
    row = dict(seeds=3, final_loss_std=0.0, final_accuracy_mean=1.0, reached_threshold=3,
               steps_to_threshold_min=0, steps_to_threshold_max=0)
    rising = [dict(row, n_heads=h, head_dim=64 // h, final_loss_mean=0.01 * (i + 1), final_loss_min=0.01 * (i + 1),
                   final_loss_max=0.01 * (i + 1), steps_to_threshold_mean=100.0 + 10 * i)
              for i, h in enumerate((1, 2, 4))]
    text = conclusion(cfg, rising)
    assert "n_heads = 1 (head_dim 64) reached the lowest" in text and "rises steadily" in text
    falling = [dict(r, final_loss_mean=0.1 - 0.01 * i, final_loss_min=0.1 - 0.01 * i, final_loss_max=0.1 - 0.01 * i)
               for i, r in enumerate(rising)]
    assert "falls steadily" in conclusion(cfg, falling)
    flat = [dict(r, final_loss_mean=0.05, final_loss_min=0.0, final_loss_max=0.1) for r in rising]
    assert "no difference larger than the seeds' spread" in conclusion(cfg, flat)
    assert "nothing to conclude" in conclusion(cfg, [])


def test_cli_quick(tmp_path, capsys, one_torch_thread):
    from multihead.cli import main

    rc = main(["lab", "heads", "--quick", "--head-counts", "4", "--seeds", "1", "--steps", "10",
               "--out", str(tmp_path), "--no-progress", "--threads", "1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "results in" in out and "multihead inspect --model" in out
    assert load_results(tmp_path)["config"]["steps"] == 10


def test_quick_runs_on_one_thread_by_default(tmp_path):
    """lab heads --quick waited at OpenMP barriers on 2 threads of a loaded 2-core machine
    (118 s vs 17 s on one thread at load 8; 6 s idle): tiny models run on one thread."""
    import torch

    from multihead.cli import main

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert main(["lab", "heads", "--quick", "--no-progress", "--steps", "2", "--out", str(tmp_path / "q")]) == 0
        assert load_results(tmp_path / "q")["machine"]["torch_threads"] == 1
    finally:
        torch.set_num_threads(before)


def test_results_say_which_machine_and_the_load_at_the_start_and_end(tmp_path):
    """results.json's "machine": the CPU model, the L2 and L3 the kernels read, and the load
    average when the run started and when it last wrote its results (its end)."""
    import os

    from multihead.cli import main
    from multihead.kernels.machine import read_caches

    assert main(["lab", "heads", "--quick", "--no-progress", "--steps", "2", "--out", str(tmp_path / "m")]) == 0
    m = load_results(tmp_path / "m")["machine"]
    assert isinstance(m["cpu"], str) and m["cpu"]
    assert (m["l2_bytes"], m["l3_bytes"]) == (read_caches() or (None, None))
    if hasattr(os, "getloadavg"):
        assert len(m["loadavg_start"]) == 3 and len(m["loadavg_end"]) == 3
        assert all(x >= 0 for x in m["loadavg_start"] + m["loadavg_end"])
