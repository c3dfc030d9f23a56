"""The summaries page (`render_summaries_html`, `save_summaries_html`): what it stores decodes
back to the summaries (patterns on their square-root scale, top-k rows to 1.5e-5), token text
cannot escape its JSON, the page stays under 25 MB at 8,192 tokens x 270 heads, it shares its
shell with the head view, saving is atomic, and (browser, slow) it renders in headless
Chromium without console errors or requests, clicks and hovers included."""

from __future__ import annotations

import base64
import json
import re
from importlib import resources

import numpy as np
import pytest
import torch

from inspect_synthetic import synthetic_capture
from multihead.inspect import HeadRole
from multihead.inspect.html import _asset, render_html
from multihead.inspect.stream import HeadSummaries
from multihead.inspect.summaries_html import render_summaries_html, save_summaries_html


def _synthetic(T: int, L: int, H: int, g: int, k: int = 8, tokens=None, seed: int = 0) -> HeadSummaries:
    gen = torch.Generator().manual_seed(seed)
    names = ("entropy", "mean_distance", "first_token_mass", "previous_token", "induction")
    scores = {n: torch.rand(L, H, generator=gen) for n in names}
    top_w = torch.rand(L, H, T, k, generator=gen).sort(-1, descending=True).values.half()
    top_i = torch.randint(0, T, (L, H, T, k), generator=gen, dtype=torch.int32)
    top_i[:, :, 0, 1:] = -1  # row 0 has one key
    patterns = {(la, h): torch.rand(g, g, generator=gen) ** 4 for la in range(L) for h in range(H)}
    return HeadSummaries(tokens=tokens or [f"t{i}" for i in range(T)], token_ids=list(range(T)), layers=list(range(L)),
                         heads=list(range(H)), n_layers=L, n_heads=H, scores=scores, match_rows={}, top_index=top_i,
                         top_weight=top_w, patterns=patterns, model="synthetic", meta={})


def _data(page: str) -> dict:
    block = re.search(r'<script id="mh-data" type="application/json">(.*?)</script>', page, re.S).group(1)
    return json.loads(block)


def _u(b64: str, dtype) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype=dtype)


def test_page_data_decodes_to_the_summaries():
    s = _synthetic(T=300, L=2, H=3, g=32)
    roles = [HeadRole(layer=1, head=2, scores={}, role="induction", score=0.9),
             HeadRole(layer=0, head=0, scores={}, role="broad", score=0.8)]
    d = _data(render_summaries_html(s, roles=roles, detail=2, coarse=8))
    assert d["detail"]["heads"] == ["1,2", "0,0"]  # best-ranked first
    for key in d["detail"]["heads"]:
        la, h = map(int, key.split(","))
        want = s.patterns[(la, h)].double().numpy().reshape(-1)
        got = (_u(d["detail"]["pattern"][key], np.uint8) / 255.0) ** 2 * d["detail"]["max"][key]
        assert np.abs(got - want).max() <= 2 / 255 * want.max()
        idx = _u(d["detail"]["top_index"][key], "<u2").reshape(300, 8).astype(np.int64)
        ref = s.top_index[la, h].numpy()
        assert np.array_equal(np.where(idx == d["detail"]["none"], -1, idx), ref)
        w = _u(d["detail"]["top_weight"][key], "<u2").reshape(300, 8) / 65535
        assert np.abs(w - s.top_weight[la, h].float().numpy()).max() <= 1 / 65535
    c = d["coarse"]["g"]
    assert c == 8
    coarse = _u(d["coarse"]["data"], np.uint8).reshape(6, c, c)
    i = d["coarse"]["heads"].index("1,0")
    want = s.patterns[(1, 0)].double().reshape(8, 4, 8, 4).sum((1, 3)).numpy()
    got = (coarse[i] / 255.0) ** 2 * d["coarse"]["max"][i]
    assert np.abs(got - want).max() <= 2 / 255 * want.max()
    assert d["values"]["induction"][1][2] == pytest.approx(float(s.scores["induction"][1, 2]), abs=1e-6)


def test_token_text_cannot_leave_the_data_block():
    evil = ["</script><script>alert(1)</script>", "<!--", "&amp;", "\u2028"]
    s = _synthetic(T=4, L=1, H=1, g=4, tokens=evil)
    page = render_summaries_html(s, detail=1, title="</title><script>x</script>")
    assert "<script>alert(1)" not in page and "<script>x" not in page
    assert page.count("<script") == 2  # the data block and the page's own script
    assert _data(page)["tokens"] == evil


def test_page_at_8k_tokens_and_270_heads_stays_under_25_mb():
    s = _synthetic(T=8192, L=30, H=9, g=256)
    roles = [HeadRole(layer=la, head=h, scores={}, role="broad", score=1 - (la * 9 + h) / 270)
             for la in range(30) for h in range(9)]
    page = render_summaries_html(s, roles=roles)
    size = len(page.encode("utf-8"))
    assert size <= 25e6, f"{size / 1e6:.1f} MB"
    d = _data(page)
    assert len(d["coarse"]["heads"]) == 270
    # as many best-ranked heads' top-k rows as fit (60 of 270 here), and at least 16 full patterns
    top = d["detail"]["top_index"]
    assert 16 <= len(top) < 270 and list(top) == [f"{la},{h}" for la in range(30) for h in range(9)][:len(top)]
    assert len(d["detail"]["pattern"]) >= 16


def test_every_head_gets_its_top_k_rows_when_they_fit():
    s = _synthetic(T=1024, L=30, H=9, g=64)
    page = render_summaries_html(s)
    assert len(page.encode("utf-8")) <= 25e6
    d = _data(page)
    assert len(d["detail"]["top_index"]) == 270 and len(d["detail"]["pattern"]) == 270
    la, h = 29, 8  # the last head's rows decode to its top-k
    idx = _u(d["detail"]["top_index"][f"{la},{h}"], "<u2").reshape(1024, 8).astype(np.int64)
    assert np.array_equal(np.where(idx == d["detail"]["none"], -1, idx), s.top_index[la, h].numpy())
    assert "every head" in d["notes"][1]
    small = render_summaries_html(s, max_bytes=1_000_000)  # too small: still 16 heads
    assert len(_data(small)["detail"]["top_index"]) == 16
    with pytest.raises(ValueError, match="max_bytes must be an int >= 1; received 0"):
        render_summaries_html(s, max_bytes=0)


def test_bad_arguments():
    s = _synthetic(T=8, L=1, H=2, g=8)
    with pytest.raises(TypeError, match="takes a HeadSummaries; received dict"):
        render_summaries_html({})
    with pytest.raises(ValueError, match=r"detail heads \[\(3, 3\)\] have no pattern"):
        render_summaries_html(s, detail=[(3, 3)])
    with pytest.raises(ValueError, match="coarse must be an int >= 1; received 0"):
        render_summaries_html(s, coarse=0)
    with pytest.raises(TypeError, match=r"coarse must be an int >= 1; received 8.0 \(float\)"):
        render_summaries_html(s, coarse=8.0)
    with pytest.raises(TypeError, match=r"max_bytes must be an int >= 1; received True \(bool\)"):
        render_summaries_html(s, max_bytes=True)


def test_save_writes_the_page_render_returns(tmp_path):
    s = _synthetic(T=40, L=2, H=2, g=8)
    roles = [HeadRole(layer=1, head=0, scores={}, role="induction", score=0.9)]
    path = tmp_path / "view.html"
    assert save_summaries_html(s, str(path), roles, detail=1) == path.resolve()  # roles by position
    assert path.read_text(encoding="utf-8") == render_summaries_html(s, roles, detail=1)
    assert save_summaries_html(s, path, roles=roles, coarse=4) == path.resolve()  # or by keyword
    assert path.read_text(encoding="utf-8") == render_summaries_html(s, roles=roles, coarse=4)
    with pytest.raises(ValueError, match="coarse must be an int >= 1; received 0"):  # before the file is touched
        save_summaries_html(s, path, coarse=0)
    assert path.read_text(encoding="utf-8") == render_summaries_html(s, roles=roles, coarse=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["view.html"]
    with pytest.raises(TypeError, match="path"):  # one return type: render never writes
        render_summaries_html(s, path=tmp_path / "other.html")


def test_both_pages_share_one_shell():
    pages = {"head view": render_html(synthetic_capture()),
             "summaries": render_summaries_html(_synthetic(T=8, L=1, H=2, g=8))}
    opening, closing = _asset("page_open.html"), _asset("page_close.html")
    for view in ("head_view", "summaries_view"):
        template = _asset(f"{view}.html")
        assert template.startswith(opening) and template.endswith(closing), view
        assert _asset(f"{view}.css").startswith(_asset("page.css")), view
        own = {ext: resources.files("multihead.inspect").joinpath(f"{view}.{ext}").read_text(encoding="utf-8")
               for ext in ("html", "css", "js")}  # what the view's files hold themselves
        for ext, shared in (("html", "<!DOCTYPE"), ("html", "<script"), ("css", "\nbody {"), ("css", "--ink:"),
                            ("js", "function el("), ("js", "function bytes("), ("js", "JSON.parse(")):
            assert shared not in own[ext], f"{view}.{ext} repeats the shared {shared!r}"
    for name, page in pages.items():
        assert "include:" not in page, name
        js = re.search(r"<script>(.*?)</script>", page, re.S).group(1)
        # page.js is inside the view's closure, indented as its marker
        assert js.count("\n  function el(tag, cls, text) {\n") == 1 and js.count("function bytes(") == 1, name
        assert page.count("body { margin: 0;") == 1 and page.count("<!DOCTYPE html>") == 1, name


@pytest.mark.slow
@pytest.mark.browser
def test_page_renders_in_chromium(tmp_path):
    import os
    import shutil

    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    exe = shutil.which("chromium") or shutil.which("chromium-browser") or (
        "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
    if exe is None:
        pytest.skip("chromium is not installed")
    s = _synthetic(T=2048, L=6, H=4, g=256)
    roles = [HeadRole(layer=la, head=h, scores={}, role="induction" if h == 1 else "broad", score=0.5 + 0.01 * h)
             for la in range(6) for h in range(4)]
    roles.sort(key=lambda r: (-r.score, r.layer, r.head))  # ranked, as head_roles returns them
    path = save_summaries_html(s, tmp_path / "view.html", roles=roles, detail=4)
    errors, requests = [], []
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=["--headless", "--no-sandbox", "--disable-gpu"], headless=True)
        page = b.new_page(viewport={"width": 1400, "height": 900})
        page.on("console", lambda m: m.type == "error" and errors.append(m.text))
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: r.url != path.as_uri() and requests.append(r.url))
        page.goto(path.as_uri())
        assert page.locator("#mh-grid td").count() == 24
        first = page.locator("#mh-head-title").text_content()
        assert first.startswith("Layer 0, head 3")  # the best-ranked detail head
        box = page.locator("#mh-pattern").bounding_box()
        page.mouse.move(box["x"] + 10, box["y"] + box["height"] * 0.5)
        assert page.locator("#mh-row-title").text_content().startswith("query 1024:")
        assert page.locator("#mh-top tr").count() == 9  # header + 8 keys
        page.select_option("#mh-field", "induction")
        page.locator("#mh-grid td").nth(5).click()
        assert page.locator("#mh-head-title").text_content().startswith("Layer 1, head 1")
        page.locator("#mh-grid td").nth(0).click()
        page.mouse.move(box["x"] + 10, box["y"] + 3)
        page.screenshot(path=str(tmp_path / "view.png"), full_page=True)
        b.close()
    assert not errors and not requests, (errors, requests)
    shutil.copy(tmp_path / "view.png", os.environ.get("MH_SCREENSHOT", tmp_path / "kept.png"))
