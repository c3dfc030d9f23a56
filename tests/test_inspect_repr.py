"""Short REPL reprs: a capture shows what it holds in a few lines, never the
weights; save_html returns where it wrote; plan.recommend's result is one line,
and print() gives the text the CLI prints."""

from __future__ import annotations

from inspect_synthetic import synthetic_capture
from multihead import plan
from multihead.inspect.capture_types import AttentionCapture
from multihead.inspect.html import render_html, save_html


def test_capture_repr_is_short_and_says_what_is_captured():
    cap = synthetic_capture(L=6, H=12, T=200)
    text = repr(cap)
    assert len(text) < 400 and text.count("\n") <= 2, text
    assert "model='synthetic'" in text and "200 tokens" in text
    assert "6 layers x 12 heads; captured every head" in text
    assert "weights (6, 12, 200, 200) float32" in text
    assert "tensor(" not in text
    part = AttentionCapture(tokens=cap.tokens, token_ids=cap.token_ids, layers=[0, 1, 2, 5], heads=[3],
                            weights=cap.weights[[0, 1, 2, 5]][:, [3]], n_layers=6, n_heads=12, model="m",
                            meta={"text": "x" * 10_000})
    text = repr(part)
    assert "captured layers 0-2,5 x heads 3" in text and "meta: text" in text and len(text) < 400


def test_save_html_returns_the_path_and_render_html_the_page(tmp_path):
    cap = synthetic_capture()
    out = save_html(cap, tmp_path / "v.html")
    assert out == (tmp_path / "v.html").resolve() and len(repr(out)) < 200
    assert (tmp_path / "v.html").read_text(encoding="utf-8") == render_html(cap)
    assert isinstance(render_html(cap), str)


def test_recommendation_repr_is_one_line_and_str_is_the_cli_text(capsys):
    rec = plan.recommend(plan.Request(params=7_000_000_000, context=32768, batch=16))
    text = repr(rec)
    assert "\n" not in text and len(text) < 300, text
    assert text.startswith("Recommendation(pick=Candidate(GQA-4: 32 heads of 128, 31 layers, 6.89B params, "
                           "KV 31 GiB at 32K x 16, fits on h100-80gb), 9 alternatives")
    assert all(len(repr(c)) < 200 for c in rec.alternatives)
    from multihead.cli import main

    assert main(["plan", "--params", "7B", "--context", "32k", "--batch-size", "16"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == str(rec) == plan.recommendation_text(rec)


def test_account_text_is_the_cli_table(capsys):
    from multihead.cli import main

    assert main(["plan", "--model", "gpt2", "--accelerator", "t4"]) == 0
    table = plan.account_text([plan.account(plan.read_config("gpt2"), device=plan.get_device("t4"))])
    assert capsys.readouterr().out.startswith(table + "\n")  # (the CLI may add lines after the table)



def test_notebook_display_needs_no_view_imported_first():
    # capture_types imports no view module (no circle: tests/test_layering.py); its _repr_html_
    # finds the page through the package's public names. In a fresh process where only the
    # types are loaded, the display is still the page notebook_html draws.
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys\n"
            "from inspect_synthetic import synthetic_capture\n"
            "cap = synthetic_capture(L=2, H=3, T=8)\n"
            "assert 'multihead.inspect.html' not in sys.modules, 'a view was imported with the types'\n"
            "frame = cap._repr_html_()\n"
            "import multihead.inspect as inspect\n"
            "from multihead.inspect.html import notebook_html, render_html\n"
            "from multihead.inspect.roles import head_roles\n"
            "assert inspect.notebook_html is notebook_html\n"
            "assert frame == notebook_html(cap) and frame.startswith('<iframe srcdoc=')\n"
            "import html\n"
            "assert html.escape(render_html(cap, head_roles(cap)), quote=True) in frame\n"
            "print('ok')\n")
    tests = Path(__file__).resolve().parent
    done = subprocess.run([sys.executable, "-c", code], cwd=tests, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(tests), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
