"""The HTML view in a real browser: headless Chromium driven by Playwright opens the page
from a file:// URL, switches layer and head, hovers tokens, clicks the model view, takes
a screenshot, and sees no console error, no network request and no script from token text.

Skipped when Playwright or Chromium is missing (scripts/setup.sh installs Chromium with
apt; `playwright install` is not used: it downloads browsers)."""

from __future__ import annotations

import io
import os
import shutil
import time

import numpy as np
import pytest

from inspect_synthetic import decode_weights, page_data, synthetic_capture
from multihead.inspect import HeadRole
from multihead.inspect.html import render_html

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ROW = 20  # px per token row in the head view (head_view.js)


def _chromium() -> str | None:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    return found or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    executable = _chromium()
    if executable is None:
        pytest.skip("chromium is not installed (scripts/setup.sh installs it: apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, args=ARGS, headless=True)
        yield b
        b.close()


class Watch:
    """Everything a page did that it should not: console errors, uncaught exceptions,
    requests other than its own URL, dialogs (alert/confirm/prompt)."""

    def __init__(self, page, url: str):
        self.url, self.errors, self.requests, self.dialogs = url, [], [], []
        page.on("console", lambda m: m.type == "error" and self.errors.append(f"console: {m.text}"))
        page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        page.on("request", lambda r: self.requests.append(r.url))
        page.on("dialog", self.on_dialog)

    def on_dialog(self, dialog):
        self.dialogs.append(f"{dialog.type}: {dialog.message}")
        dialog.dismiss()

    def check(self):
        assert self.errors == [], f"errors in the page: {self.errors}"
        assert self.dialogs == [], f"the page opened dialogs: {self.dialogs}"
        foreign = [u for u in self.requests if u != self.url]
        assert foreign == [], f"the page made network requests: {foreign}"


@pytest.fixture
def open_view(browser, tmp_path):
    pages = []

    def _open(html: str, name: str = "view.html"):
        path = tmp_path / name
        path.write_text(html, encoding="utf-8")
        url = path.as_uri()
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        watch = Watch(page, url)
        pages.append((page, watch))
        start = time.perf_counter()
        page.goto(url)
        page.wait_for_selector("html[data-mh-ready='1']", timeout=30_000)
        return page, watch, time.perf_counter() - start

    yield _open
    for page, watch in pages:
        watch.check()
        page.close()


def _lines(page) -> list[dict]:
    return page.eval_on_selector_all(
        "#mh-svg line",
        "ls => ls.map(l => ({y1: +l.getAttribute('y1'), y2: +l.getAttribute('y2'), h: +l.dataset.h,"
        " w: +l.dataset.w, width: +l.getAttribute('stroke-width')}))",
    )


def _y(i: int) -> float:
    return i * ROW + ROW / 2


def _not_blank(png: bytes) -> None:
    try:
        from PIL import Image

        image = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.float32) / 255
    except ImportError:
        from matplotlib.image import imread

        image = imread(io.BytesIO(png), format="png")[..., :3]
    assert image.var() > 0.005, f"screenshot looks blank (pixel variance {image.var():.2e})"
    colours = np.unique((image.reshape(-1, 3) * 255).astype(np.uint8), axis=0)
    assert len(colours) > 50, f"screenshot has only {len(colours)} colours"


def test_head_view_and_model_view(open_view, tmp_path):
    cap = synthetic_capture(L=2, H=3, T=8, prev_head=(0, 1))
    roles = [HeadRole(0, 1, {"previous_token": 0.98}, "previous_token", 0.98)]
    html = render_html(cap, roles)
    w = decode_weights(page_data(html))  # (L, H, T, T) as the page stores them
    page, watch, _ = open_view(html)

    assert page.locator("#mh-left .mh-tok").count() == 8 and page.locator("#mh-right .mh-tok").count() == 8
    assert page.locator("#mh-left .mh-tok").nth(2).text_content() == "tok2"
    assert "previous token 0.98" in page.locator("button.mh-head[data-h='1']").text_content()
    assert "All 8 weights of each row are kept." in page.locator("#mh-note").text_content()
    assert page.get_attribute("#mh-svg", "data-mode") == "idle"
    assert int(page.get_attribute("#mh-svg", "data-lines")) > 0

    # Hover a query token with every head on: one line per (head, key) with a weight > 0.
    page.hover("#mh-left .mh-tok >> nth=3")
    assert page.get_attribute("#mh-svg", "data-mode") == "q:3"
    assert "mh-hover" in page.get_attribute("#mh-left .mh-tok >> nth=3", "class")
    lines = _lines(page)
    assert len(lines) == int((w[0, :, 3] > 0).sum())
    for line in lines:
        key = round((line["y2"] - ROW / 2) / ROW)
        assert line["y1"] == _y(3)
        assert line["w"] == pytest.approx(w[0, line["h"], 3, key], abs=1e-3)
        assert line["width"] == pytest.approx(0.6 + 6 * line["w"], abs=0.01)  # thickness by weight

    # Only the previous-token head: token 3 has one thick line, to token 2.
    page.click("#mh-none")
    page.click("button.mh-head[data-h='1']")
    assert page.get_attribute("button.mh-head[data-h='1']", "aria-pressed") == "true"
    assert page.get_attribute("button.mh-head[data-h='0']", "aria-pressed") == "false"
    page.hover("#mh-left .mh-tok >> nth=3")
    assert [(line["y1"], line["y2"], line["width"]) for line in _lines(page)] == [(_y(3), _y(2), 6.6)]
    bg = page.eval_on_selector("#mh-right .mh-tok >> nth=2", "e => e.style.backgroundColor")
    assert bg, "the attended token is not highlighted"
    # ... and the key side: who attends to token 2? Only token 3.
    page.hover("#mh-right .mh-tok >> nth=2")
    assert page.get_attribute("#mh-svg", "data-mode") == "k:2"
    assert [(line["y1"], line["y2"]) for line in _lines(page)] == [(_y(3), _y(2))]

    # Switch layer: the lines follow layer 1's weights, the layer-0 badge is gone.
    page.select_option("#mh-layer", "1")
    assert page.get_attribute("#mh-svg", "data-layer") == "1"
    assert page.locator("button.mh-head[data-h='1'] .mh-badge").count() == 0
    page.hover("#mh-left .mh-tok >> nth=5")
    lines = _lines(page)
    assert len(lines) == int((w[1, 1, 5] > 0).sum()) and {line["h"] for line in lines} == {1}
    heaviest = max(lines, key=lambda line: line["w"])
    assert heaviest["y2"] == _y(int(w[1, 1, 5].argmax()))

    # Model view: a cell per (layer, head); clicking one focuses it in both views.
    assert page.locator("button.mh-cell").count() == 6
    page.click("button.mh-cell[data-l='0'][data-h='2']")
    assert page.input_value("#mh-layer") == "0"
    pressed = page.eval_on_selector_all("button.mh-head", "bs => bs.map(b => b.getAttribute('aria-pressed'))")
    assert pressed == ["false", "false", "true"]
    assert page.locator("#mh-focus-title").text_content() == "Layer 0 head 2"
    assert "mh-focused" in page.get_attribute("button.mh-cell[data-l='0'][data-h='2']", "class")
    page.hover("#mh-focus", position={"x": 10, "y": 10})
    assert page.locator("#mh-readout").text_content().startswith('"tok0" (0) \u2192 "tok0" (0): ')

    _not_blank(page.screenshot(full_page=True))
    watch.check()


def test_token_text_runs_nothing(open_view):
    tokens = ["<script>alert(1)</script>", "<img src=x onerror=alert(2)>", "</script><script>alert(3)</script>", "ok"]
    cap = synthetic_capture(L=1, H=2, T=4, tokens=tokens, prev_head=None, model="<b>m</b>")
    page, watch, _ = open_view(render_html(cap))
    for i, token in enumerate(tokens):
        cell = page.locator("#mh-left .mh-tok").nth(i)
        assert cell.text_content() == token and cell.is_visible()
    page.hover("#mh-left .mh-tok >> nth=0")
    page.hover("#mh-right .mh-tok >> nth=1")
    assert page.locator("img").count() == 0 and page.locator("b").count() == 0
    assert page.evaluate("document.scripts.length") == 2
    assert "<b>m</b>" in page.locator("#mh-summary").text_content()
    page.wait_for_timeout(200)  # an injected onerror would fire by now
    watch.check()  # no dialog, no request for "x"


def test_512_tokens_72_heads_is_usable(open_view):
    cap = synthetic_capture(L=6, H=12, T=512, sharpness=3.0, prev_head=(5, 11))
    html = render_html(cap)
    page, watch, seconds = open_view(html, "big.html")
    assert seconds < 15, f"a {len(html) / 1e6:.1f} MB page took {seconds:.1f} s to load and draw"
    assert page.locator("button.mh-cell").count() == 72
    page.hover("#mh-left .mh-tok >> nth=500")
    assert page.get_attribute("#mh-svg", "data-mode") == "q:500"
    assert 12 <= int(page.get_attribute("#mh-svg", "data-lines")) <= 12 * 32
    page.click("button.mh-cell[data-l='5'][data-h='11']")
    page.hover("#mh-left .mh-tok >> nth=300")
    assert [(line["y1"], line["y2"]) for line in _lines(page)] == [(_y(300), _y(299))]
    assert "Kept the top 32 of 512 weights" in page.locator("#mh-note").text_content()
    _not_blank(page.screenshot())
    watch.check()
