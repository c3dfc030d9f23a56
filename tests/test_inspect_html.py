"""The self-contained HTML view: data round-trip through the quantised format, what the
page says was dropped, escaping of hostile token text, no network, bounded size."""

from __future__ import annotations

import base64
import hashlib
import html
import math
import re
import time

import numpy as np
import pytest
import torch

from inspect_synthetic import decode_indices, decode_weights, page_data, synthetic_capture
from multihead.inspect import HeadRole
from multihead.inspect.html import _asset, _choose_k, render_html, save_html

STEP = 1 / 255  # the quantisation step the page promises at most half of (relative to the row max)


def _check_close(decoded: np.ndarray, original: np.ndarray, what: str) -> None:
    rowmax = original.max(axis=-1, keepdims=True)
    err = np.abs(decoded - original)
    bound = 0.5 * STEP * rowmax + 1e-6
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), f"{what}: max |decoded - original| {err.max():.3e} at {worst} > 0.5/255 of the row max"
    assert err.max() <= STEP, f"{what}: error {err.max():.3e} above one quantisation step"


def test_dense_round_trip():
    cap = synthetic_capture(L=2, H=3, T=8)
    data = page_data(render_html(cap))
    assert data["dense"] and data["k"] == 8 and data["idx"] is None
    assert data["tokens"] == cap.tokens and data["token_ids"] == cap.token_ids
    assert (data["layers"], data["heads"], data["n_layers"], data["n_heads"]) == ([0, 1], [0, 1, 2], 2, 3)
    _check_close(decode_weights(data), cap.weights.double().numpy(), "dense")
    assert data["note"][0] == "All 8 weights of each row are kept."
    assert data["dropped"]["min_mass"] == pytest.approx(1.0) and data["dropped"]["largest_dropped_weight"] == 0.0


def test_top_k_round_trip_and_dropped_note():
    T, k = 40, 5
    cap = synthetic_capture(L=2, H=3, T=T, sharpness=1.5)
    data = page_data(render_html(cap, top_k=k))
    w = cap.weights.double().numpy()  # (L, H, T, T)
    assert not data["dense"] and data["k"] == k and data["idx_bytes"] == 1

    # The kept entries are each row's top k, largest first; everything else decodes to 0.
    idx = decode_indices(data)
    top = np.argsort(-w, axis=-1, kind="stable")[..., :k]
    kept_w = np.take_along_axis(w, idx, axis=-1)
    assert np.allclose(np.sort(kept_w, axis=-1), np.sort(np.take_along_axis(w, top, axis=-1), axis=-1))
    assert (np.diff(kept_w, axis=-1) <= 1e-12).all(), "entries of a row are not largest first"
    truncated = np.zeros_like(w)
    np.put_along_axis(truncated, idx, kept_w, axis=-1)
    _check_close(decode_weights(data), truncated, "top-k")

    # What the page says was dropped matches the float weights.
    mass = kept_w.sum(-1) / w.sum(-1)  # (L, H, T)
    li, hi, ti = np.unravel_index(np.argmin(mass), mass.shape)
    dropped = data["dropped"]
    assert dropped["top_k"] == k and dropped["of"] == T
    assert dropped["min_mass"] == pytest.approx(mass.min(), abs=1e-6)
    assert dropped["mean_mass"] == pytest.approx(mass.mean(), abs=1e-6)
    assert dropped["min_at"] == [li, hi, ti]
    assert dropped["largest_dropped_weight"] == pytest.approx(np.sort(w, axis=-1)[..., -k - 1].max(), abs=1e-6)
    floor_pct = f"{math.floor(mass.min() * 1000) / 10:.1f}%"
    note = data["note"][0]
    assert note.startswith(f"Kept the top {k} of {T} weights of each row (dropped {T - k} per row, drawn as 0)")
    assert f">= {floor_pct} of each row's mass" in note
    assert f"layer {li} head {hi} token {ti} 'tok{ti}'" in note
    # The page shows the note (JS puts it in #mh-note); it is in the data block, escaped.
    assert "Kept the top 5 of 40 weights" in render_html(cap, top_k=k)


def test_previous_token_head_survives_top_k():
    cap = synthetic_capture(L=2, H=3, T=24, prev_head=(1, 2))
    decoded = decode_weights(page_data(render_html(cap, top_k=3)))
    argmax = decoded[1, 2].argmax(-1)
    assert argmax.tolist() == [0] + list(range(23)), f"previous-token head decoded as {argmax.tolist()}"
    assert np.allclose(decoded[1, 2].max(-1), 1.0)


def test_uint16_indices_past_256_tokens():
    cap = synthetic_capture(L=1, H=2, T=300, prev_head=(0, 0))
    data = page_data(render_html(cap, top_k=4))
    assert data["idx_bytes"] == 2
    idx = decode_indices(data)
    assert idx.max() > 255
    assert idx[0, 0, 1:, 0].tolist() == list(range(299)), "previous-token keys lost in uint16 packing"


def test_default_k_bounds_the_page():
    assert _choose_k(2 * 3 * 64, 64, None) == 64  # small: every weight
    assert _choose_k(72 * 128, 128, None) == 128  # 1.2M entries still fit
    assert _choose_k(72 * 512, 512, None) == 32  # 6 layers x 12 heads x 512 tokens
    assert _choose_k(144 * 512, 512, None) == 16
    assert _choose_k(10_000 * 512, 512, None) == 8  # never below 8
    assert _choose_k(10, 10, 100) == 10 and _choose_k(10, 10, 3) == 3


HOSTILE = [
    "<script>alert(1)</script>",
    "</script><script>alert(2)</script>",
    "<!--",
    "<img src=x onerror=alert(3)>",
    "&amp; \"quoted\" 'single'",
    "line\u2028sep",
    "__MH_JS__",
]


def test_token_text_is_escaped():
    cap = synthetic_capture(L=1, H=2, T=len(HOSTILE), tokens=list(HOSTILE), model="</script><b>model</b>")
    page = render_html(cap, title="<script>alert(4)</script>")
    # Only the two script elements of the template: the JSON data block and the code.
    assert len(re.findall(r"<script", page, re.I)) == 2
    assert len(re.findall(r"</script", page, re.I)) == 2
    assert "<img" not in page and "<!--" not in page and "<b>" not in page
    assert "<title>&lt;script&gt;alert(4)&lt;/script&gt;</title>" in page
    data = page_data(page)
    assert data["tokens"] == HOSTILE and data["model"] == "</script><b>model</b>"
    assert data["title"] == "<script>alert(4)</script>"


@pytest.mark.parametrize("name", ["head_view.js", "summaries_view.js"])
def test_script_reaches_the_dom_only_through_text(name):
    source = _asset(name)  # the view's script with the shared page.js it includes
    assert "include:" not in source
    source = re.sub(r"^\s*//.*$", "", source, flags=re.M)  # the header comment names the sinks it avoids
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in source, f"{name} uses {sink}"


def test_page_is_self_contained():
    page = render_html(synthetic_capture())
    for pattern in (
        r"\bsrc\s*=",
        r"\bhref\s*=",
        r"url\(",
        r"@import",
        r"<link",
        r"<iframe",
        r"fetch\(",
        r"XMLHttp",
        r"WebSocket",
    ):
        assert not re.search(pattern, page, re.I), f"page contains {pattern!r}"
    urls = re.findall(r"https?://[^\s\"')]+", page)
    assert set(urls) <= {"http://www.w3.org/2000/svg"}, f"page names URLs: {set(urls)}"

    # The CSP forbids every fetch and allows exactly the inline script, by its hash.
    csp = html.unescape(re.search(r'http-equiv="Content-Security-Policy" content="([^"]*)"', page).group(1))
    assert "default-src 'none'" in csp and "unsafe-inline" not in csp.split("script-src")[1].split(";")[0]
    script = re.search(r"<script>(.*?)</script>", page, re.S).group(1)
    digest = base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode()
    assert f"'sha256-{digest}'" in csp


def test_page_size_bound_at_512_tokens_72_heads():
    cap = synthetic_capture(L=6, H=12, T=512, sharpness=3.0, prev_head=(0, 2))
    start = time.perf_counter()
    page = render_html(cap)
    seconds = time.perf_counter() - start
    size = len(page.encode("utf-8"))
    assert size < 8_000_000, f"512 tokens x 72 heads page is {size / 1e6:.2f} MB, bound is 8 MB"
    assert seconds < 20, f"render_html took {seconds:.1f} s"
    data = page_data(page)
    assert data["k"] == 32 and data["idx_bytes"] == 2
    assert data["note"][0].startswith("Kept the top 32 of 512 weights of each row")


def test_max_tokens_truncates_and_says_so():
    cap = synthetic_capture(L=1, H=2, T=20)
    data = page_data(render_html(cap, max_tokens=12))
    assert (data["T"], data["T_captured"]) == (12, 20)
    assert data["tokens"] == cap.tokens[:12]
    assert data["note"][0].startswith("Showing the first 12 of 20 tokens")
    assert decode_weights(data).shape == (1, 2, 12, 12)


def test_roles_of_captured_heads_become_badges(tmp_path):
    cap = synthetic_capture(L=2, H=3, T=8)
    roles = [
        HeadRole(0, 1, {"previous_token": 0.98, "entropy": 0.1}, "previous_token", 0.98),
        HeadRole(5, 0, {"induction": 0.9}, "induction", 0.9),  # not captured: ignored
    ]
    path = tmp_path / "view.html"
    written = save_html(cap, path, roles)  # writing returns where it wrote, not the page
    assert written == path.resolve()
    page = path.read_text(encoding="utf-8")
    assert page == render_html(cap, roles)
    assert page_data(page)["roles"] == [
        {
            "layer": 0,
            "head": 1,
            "role": "previous_token",
            "score": 0.98,
            "scores": {"previous_token": 0.98, "entropy": 0.1},
        }
    ]


def test_save_html_writes_the_page_render_html_returns(tmp_path):
    cap = synthetic_capture(L=2, H=3, T=20)
    roles = [HeadRole(1, 2, {"induction": 0.7}, "induction", 0.7)]
    options = {"max_tokens": 12, "top_k": 3, "title": "a <title>"}
    path = tmp_path / "view.html"
    assert save_html(cap, str(path), roles, **options) == path.resolve()
    assert path.read_text(encoding="utf-8") == render_html(cap, roles, **options)
    assert page_data(path.read_text(encoding="utf-8"))["T"] == 12
    with pytest.raises(TypeError, match="max_tokens"):  # refused before the file is touched
        save_html(cap, tmp_path / "other.html", max_tokens=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["view.html"]
    with pytest.raises(TypeError, match="path"):  # one return type: render_html never writes
        render_html(cap, path=tmp_path / "other.html")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"max_tokens": 0}, ValueError, r"^max_tokens must be an int >= 1; received 0$"),
        ({"max_tokens": True}, TypeError, r"^max_tokens must be an int >= 1; received True \(bool\)$"),
        ({"max_tokens": 2.0}, TypeError, r"^max_tokens must be an int >= 1; received 2.0 \(float\)$"),
        ({"top_k": 0}, ValueError, r"^top_k must be an int >= 1 or None; received 0$"),
        ({"top_k": 2.5}, TypeError, r"^top_k must be an int >= 1 or None; received 2.5 \(float\)$"),
        ({"top_k": "4"}, TypeError, r"^top_k must be an int >= 1 or None; received '4' \(str\)$"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        render_html(synthetic_capture(), **kwargs)


def test_weights_must_be_finite():
    cap = synthetic_capture()
    cap.weights[1, 2, 3, 4] = float("nan")
    with pytest.raises(ValueError, match=r"must be finite; received nan at \[layer, head, t, s\] = \[1, 2, 3, 4\]"):
        render_html(cap)


def test_not_a_capture():
    with pytest.raises(TypeError, match="capture must be an AttentionCapture; received Tensor"):
        render_html(torch.zeros(1, 1, 2, 2))


# --- long texts, metadata, the opening head, notebooks --------------------------------


LONG = "In the beginning God created the heaven and the earth. " * 64  # 3,520 characters


def _long_capture():
    cap = synthetic_capture(L=2, H=3, T=8)
    cap.meta.update(text=LONG, special_tokens=["[CLS]", "[SEP]"], causal=False,
                    truncated={"tokens": 700, "kept": 512, "limit": 512, "reason": "the model's positions"})
    return cap


def test_long_title_and_metadata_are_cut_with_the_full_text_kept():
    from multihead.inspect.html import META_CHARS, TITLE_CHARS

    page = render_html(_long_capture())
    data = page_data(page)
    assert len(data["title"]) <= TITLE_CHARS and data["title"].endswith("\u2026")
    assert data["title_full"] == f"synthetic: {LONG}"
    head_title = re.search(r"<title>(.*?)</title>", page, re.S).group(1)
    h1 = re.search(r'<h1 id="mh-title">(.*?)</h1>', page, re.S).group(1)
    assert html.unescape(head_title) == html.unescape(h1) == data["title"]
    assert all(len(v) <= META_CHARS for v in data["meta_short"].values())
    assert data["meta"]["text"] == LONG  # on demand, in full


def test_metadata_is_text_not_python_reprs():
    data = page_data(render_html(_long_capture()))
    assert data["meta"]["special_tokens"] == "[CLS], [SEP]"
    assert data["meta"]["causal"] == "no"
    assert data["meta"]["truncated"] == "tokens 700, kept 512, limit 512, reason the model's positions"
    for value in data["meta"].values():
        assert not re.search(r"\['|\{'|': |\bTrue\b|\bFalse\b|\bNone\b", value), value


def test_the_page_opens_on_the_top_ranked_head():
    cap = synthetic_capture(L=3, H=4, T=8)
    cap.layers, cap.heads = [1, 3, 5], [0, 2, 4, 6]
    roles = [HeadRole(5, 4, {"previous_token": 0.9}, "previous_token", 0.9),
             HeadRole(1, 0, {"first_token": 0.5}, "first_token", 0.5)]
    assert page_data(render_html(cap, roles))["start"] == {"l": 2, "h": 2}  # layer 5 head 4, by position
    assert page_data(render_html(cap))["start"] == {"l": 0, "h": 0}
    uncaptured = [HeadRole(0, 1, {}, "broad", 0.9), *roles]  # ranked first but not captured: skipped
    assert page_data(render_html(cap, uncaptured))["start"] == {"l": 2, "h": 2}


def test_notebook_display_is_the_page_in_a_sandboxed_frame():
    from multihead.inspect import head_roles

    cap = synthetic_capture(L=2, H=3, T=8)
    frame = cap._repr_html_()  # Jupyter's display hook, called as a notebook calls it
    m = re.fullmatch(r'<iframe srcdoc="([^"]*)" sandbox="allow-scripts" title="multihead head view" '
                     r'style="width: 100%; height: \d+px; border: 0"></iframe>', frame)
    assert m, frame[:300]
    inner = html.unescape(m.group(1))
    assert inner == render_html(cap, head_roles(cap))  # the same self-contained page, roles included
    urls = re.findall(r"https?://[^\s\"')&]+", inner)
    assert set(urls) <= {"http://www.w3.org/2000/svg"} and " src=" not in frame, urls  # offline
    assert page_data(inner)["roles"], "the notebook view shows the role badges"


# --- in a browser (skipped without Playwright or Chromium) ------------------------------

# The browser fixtures of test_inspect_browser.py (they skip without Playwright/Chromium).
from test_inspect_browser import browser, open_view  # noqa: E402,F401


@pytest.mark.browser
@pytest.mark.slow
def test_page_features_in_a_browser(open_view):  # noqa: F811
    cap = _long_capture()
    roles = [HeadRole(1, 2, {"previous_token": 0.9}, "previous_token", 0.9)]
    page, watch, _ = open_view(render_html(cap, roles))
    # The title is one line; the full text is behind a <details>.
    assert len(page.locator("#mh-title").text_content()) <= 120
    assert page.locator("#mh-title").bounding_box()["height"] < 60
    assert not page.locator("#mh-full").get_attribute("open")
    page.click("#mh-full-summary")
    assert LONG.strip() in page.locator("#mh-full-body").text_content()
    summary = page.locator("#mh-summary").text_content()
    assert "special_tokens: [CLS], [SEP]" in summary and "causal: no" in summary and LONG not in summary
    # Opens on the top-ranked head: layer 1 in the head view, L1 H2 in focus.
    assert page.input_value("#mh-layer") == "1"
    assert page.locator("#mh-focus-title").text_content().startswith("Layer 1 head 2")
    assert "mh-focused" in page.get_attribute("button.mh-cell[data-l='1'][data-h='2']", "class")
    # The large heatmap's axes carry the tokens, each at its row / column.
    ys = page.locator("#mh-ylabels span")
    assert ys.count() == 8 and ys.nth(3).text_content() == cap.tokens[3]
    assert page.locator("#mh-xlabels span").nth(5).text_content() == cap.tokens[5]
    canvas = page.locator("#mh-focus").bounding_box()
    label = ys.nth(3).bounding_box()
    row_centre = canvas["y"] + canvas["height"] * 3.5 / 8
    assert abs(label["y"] + label["height"] / 2 - row_centre) < 3
    watch.check()


@pytest.mark.browser
@pytest.mark.slow
def test_notebook_frame_renders_offline(open_view):  # noqa: F811
    cap = synthetic_capture(L=2, H=3, T=8)
    host = f"<!DOCTYPE html><html><body><h1>notebook</h1>{cap._repr_html_()}</body></html>"  # as Jupyter shows it
    page, watch, _ = open_view_frame(open_view, host)
    frame = page.frames[1]
    frame.wait_for_selector("html[data-mh-ready='1']", timeout=30_000)
    assert frame.locator("button.mh-cell").count() == 6
    watch.check()


def open_view_frame(open_view, host: str):  # noqa: F811
    """open_view waits for the page's ready mark, which a host page lacks: add it."""
    return open_view(host.replace("<html>", "<html data-mh-ready='1'>", 1), name="notebook.html")
