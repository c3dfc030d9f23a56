"""plan's labels say what they count: attention-only FLOPs, max context capped at
the model's positions, one memory figure for the "why" and KV lines, "did you mean" for a
device family."""

from __future__ import annotations

import json
import re

from multihead import plan
from multihead.cli import main
from multihead.plan.devices import DEVICES, RESERVE
from multihead.plan.units import fmt_bytes


def run(capsys, *argv):
    code = main(["plan", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_flops_rows_say_attention_and_count_only_attention(capsys):
    code, out, _ = run(capsys, "--model", "llama-3-8b", "--context", "8k")
    assert code == 0
    assert re.search(r"^attention FLOPs/token, prefill @ 8K\s+4.83 GFLOP$", out, re.M), out
    assert "attention FLOPs/token, decode @ 8K" in out
    # the figure is attention's alone: 2 * weights per token (projections) + the scores,
    # far below the 2 * 8.03B FLOPs per token of the whole model
    model = plan.read_config("llama-3-8b")
    fl = plan.attention_flops(model, 8192)
    a = model.attention
    scores = 32 * 2 * a.n_heads * (a.head_dim + a.v_head_dim) * (8192 * 8193 // 2)
    assert fl.prefill_total == 32 * 2 * a.weights * 8192 + scores
    assert fl.prefill_per_token < 2 * plan.model_params(model) / 2


def test_max_context_is_capped_at_the_models_positions_and_says_so(capsys):
    code, out, _ = run(capsys, "--model", "llama-3-8b", "--accelerator", "a100-80gb", "--context", "8k",
                       "--batch-size", "4")
    line = next(line for line in out.splitlines() if line.startswith("max context @ batch"))
    memory = json.loads(run(capsys, "--model", "llama-3-8b", "--accelerator", "a100-80gb", "--context", "8k",
                            "--batch-size", "4", "--json")[1])["models"][0]
    longest = memory["device"]["max_context_at_batch"]
    assert longest > 8192  # memory alone would allow more than the model was built for
    assert line.split(None, 4)[4] == f"8,192 (its positions; memory: {longest:,})"
    assert memory["geometry"]["max_positions"] == 8192
    # every layer windowed: the cache stops growing, the positions still cap the context
    out = run(capsys, "--model", "mistral-7b-v0.1", "--accelerator", "a100-80gb")[1]
    assert "32,768 (its positions; memory: unbounded)" in out
    # below the positions: the plain number
    out = run(capsys, "--model", "llama-3-8b", "--accelerator", "t4", "--batch-size", "8")[1]
    line = next(line for line in out.splitlines() if line.startswith("max context @ batch"))
    assert "positions" not in line and int(line.split()[-1].replace(",", "")) < 8192


def test_why_and_kv_lines_quote_one_memory_figure(capsys):
    code, out, _ = run(capsys, "--params", "7B", "--context", "32k", "--batch-size", "16", "--accelerator", "h100-80gb")
    assert code == 0
    usable = fmt_bytes(int((1 - RESERVE) * DEVICES["h100-80gb"].memory))
    why = out[out.index("\nwhy "):out.index("\nKV cache ")]
    kv = next(line for line in out.splitlines() if line.startswith("KV cache "))
    assert f"{usable} usable on h100-80gb" in " ".join(why.split()) and f"{usable} usable" in kv
    figures = set(re.findall(r"([\d.]+ GiB) (?:free|left|usable)", " ".join(why.split()) + " " + kv))
    assert figures == {usable}, figures
    # and the arithmetic each line shows adds up
    m = re.search(r"GQA-4 needs ([\d.]+) GiB \+ ([\d.]+) GiB = ([\d.]+) GiB", " ".join(why.split()))
    assert m and abs(float(m[1]) + float(m[2]) - float(m[3])) < 0.11


def test_why_lines_are_wrapped(capsys):
    out = run(capsys, "--params", "7B", "--context", "32k", "--batch-size", "16")[1]
    wrapped = [line for line in out.splitlines() if line.startswith(("why ", "biases ", " " * 10))]
    assert len(wrapped) >= 4 and max(map(len, wrapped)) <= 100, wrapped


def test_a_device_family_gets_did_you_mean(capsys):
    code, _, err = run(capsys, "--params", "7B", "--accelerator", "h100")
    assert code == 2 and "unknown device 'h100' (did you mean h100-80gb or h100-pcie?)" in err
    code, _, err = run(capsys, "--params", "7B", "--accelerator", "rtx4090")
    assert code == 2 and "did you mean rtx-4090" in err
    code, _, err = run(capsys, "--params", "7B", "--accelerator", "zzz")
    assert code == 2 and "did you mean" not in err and "valid: h100-80gb" in err


def test_the_check_says_how_long_it_takes(capsys):
    out = run(capsys, "--params", "7B", "--context", "32k", "--batch-size", "16")[1]
    flat = " ".join(out.split())
    assert "about 15 minutes on one CPU core for 16 heads of 128" in flat
    data = json.loads(run(capsys, "--params", "7B", "--json")[1])
    assert "minutes" in data["check"]["takes"] and "--quick" in data["check"]["takes"]
