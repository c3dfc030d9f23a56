"""patch_scan at length: variants batched to a memory budget (`max_memory=`), and
`progress=` (a callable, or a line on a terminal only). Tables equal to the default run."""

from __future__ import annotations

import io

import pytest
import torch

from multihead import heads
from multihead.heads.progress import ScanProgress

pytestmark = pytest.mark.usefixtures("one_torch_thread")

transformers = pytest.importorskip("transformers")

import multihead.interop.hf  # noqa: E402, F401  (registers "multihead")
from multihead.heads import _budget, _scan_state  # noqa: E402
from multihead.heads import scan as _scan  # noqa: E402
from test_heads import _inputs, _metric, _mh  # noqa: E402


class _Tty(io.StringIO):
    def isatty(self):
        return True


def _forwards(monkeypatch) -> list:
    sizes, real = [], _scan_state.ScanState.chunk_logits
    monkeypatch.setattr(_scan_state.ScanState, "chunk_logits",
                        lambda self, chunk, *a, **k: sizes.append(len(chunk)) or real(self, chunk, *a, **k))
    return sizes


def test_a_memory_budget_sets_the_variants_per_forward_and_not_the_table(monkeypatch):
    model = _mh("llama")
    clean, corrupted = _inputs("llama", 1), _inputs("llama", 2)
    sizes = _forwards(monkeypatch)
    want = heads.patch_scan(model, clean, corrupted, _metric)
    n_variants = sum(lay.H for lay in heads.record(model, clean).layers)
    T = clean["input_ids"].shape[1] if isinstance(clean, dict) else clean.shape[1]
    # short rows: up to POSITIONS_PER_RUN row-positions a forward (T or fewer positions a row)
    assert max(sizes) >= min(n_variants, _budget.POSITIONS_PER_RUN // T // 2) > 16 // 2
    sizes.clear()
    monkeypatch.setattr(_budget, "POSITIONS_PER_RUN", 0)  # no public knob: the rows' bound alone, to compare
    assert (heads.patch_scan(model, clean, corrupted, _metric) - want).abs().max() < 1e-5
    # else the automatic budget holds 16 rows of this tiny model, in forwards of one size; the scan's
    # private rule for forwards of about one size is read directly, as the scan reports no sizes
    even = _scan._even
    assert max(sizes) == even(n_variants, 16 // 2) == -(-n_variants // 4)
    assert even(48, 4) == 4 and even(270, 42) == 34 and even(5, 8) == 5
    block = model.layers[0]
    params = sum(p.numel() for p in block.parameters())
    assert _budget.bytes_per_row(100, 4, [block], 8, 10) == 10 * 4 * (2 * 100 + 2 * params // 8 + 4 * 8)
    assert _budget.bytes_per_row(100, 4, [block], 8, 10, 1) == 4 * (10 * (2 * params // 8 + 4 * 8) + 1 * 2 * 100)
    for rows, expected in ((1, 1), (3 * 2, 3)):  # a budget of 1 byte still runs one variant a forward
        sizes.clear()
        info = {}
        got = heads.patch_scan(model, clean, corrupted, _metric, max_memory=1 if rows == 1 else None,
                               variants_per_run=None if rows == 1 else 3, info=info)
        assert max(sizes[1:]) == expected, sizes  # sizes[0]: the shortcut's self-check
        assert (got - want).abs().max() < 1e-5
    for bad, error in ((0, ValueError), (-5, ValueError), (float("nan"), ValueError), ("1GB", TypeError),
                       (True, TypeError)):
        with pytest.raises(error, match="max_memory must be None"):
            heads.patch_scan(model, clean, corrupted, _metric, max_memory=bad)


def test_the_shortcut_is_declined_when_what_it_holds_is_over_a_quarter_of_the_budget(monkeypatch):
    seen, real = [], _scan_state.ScanState.decide_shortcut
    monkeypatch.setattr(_scan_state.ScanState, "decide_shortcut", lambda self, budget: seen.append(real(self, budget))
                        or seen[-1])
    model = _mh("llama")
    clean, corrupted = _inputs("llama", 1), _inputs("llama", 2)
    want = heads.patch_scan(model, clean, corrupted, _metric)
    got = heads.patch_scan(model, clean, corrupted, _metric, max_memory=1000)
    assert seen[0] == "" and seen[1].startswith("it would hold") and "over a quarter of the memory budget" in seen[1]
    assert (got - want).abs().max() < 1e-5


def test_progress_reports_every_head_to_a_callable_and_draws_only_on_a_terminal(monkeypatch):
    model = _mh("gpt2")
    clean, corrupted = _inputs("gpt2", 1), _inputs("gpt2", 2)
    calls = []
    table = heads.patch_scan(model, clean, corrupted, _metric, variants_per_run=3,
                             progress=lambda done, total, eta: calls.append((done, total, eta)))
    n = int((~torch.isnan(table)).sum())
    assert [c[0] for c in calls] == sorted({min(3 * (i + 1), n) for i in range(len(calls))}) and calls[-1][:2] == (n, n)
    assert calls[0][2] is None and calls[-1][2] == 0.0  # no ETA from the first forward alone
    quiet = io.StringIO()
    monkeypatch.setattr("sys.stderr", quiet)
    heads.patch_scan(model, clean, corrupted, _metric, progress=True)
    assert quiet.getvalue() == ""  # not a terminal: nothing
    tty = _Tty()
    monkeypatch.setattr("sys.stderr", tty)
    heads.patch_scan(model, clean, corrupted, _metric, progress=True)
    out = tty.getvalue()
    assert "variant(s) of 2 row(s) per forward" in out and f"{n}/{n} heads" in out and "heads/s" in out, out
    with pytest.raises(TypeError, match="progress must be None"):
        heads.patch_scan(model, clean, corrupted, _metric, progress="yes")


def test_the_time_left_is_priced_by_each_forwards_cost():
    now = [0.0]
    p = ScanProgress(lambda *a: None, 3, [3.0, 2.0, 1.0], "x", clock=lambda: now[0])
    now[0] = 10.0
    p.step(1, 3.0)
    assert p.eta(now[0]) is None
    now[0] = 12.0
    p.step(1, 2.0)  # 2 cost units in 2 s after the first forward: 1 unit left, 1 s
    assert p.eta(now[0]) == pytest.approx(1.0)


def test_path_patch_scan_takes_the_same_budget_and_progress():
    model = _mh("gpt2")
    clean, corrupted = _inputs("gpt2", 1), _inputs("gpt2", 2)
    want = heads.path_patch_scan(model, clean, corrupted, _metric, receivers="logits")
    calls = []
    got = heads.path_patch_scan(model, clean, corrupted, _metric, receivers="logits", max_memory=1,
                                progress=lambda done, total, eta: calls.append((done, total)))
    n = int((~torch.isnan(want)).sum())
    assert [d for d, _ in calls] == list(range(1, n + 1)) and calls[-1] == (n, n)  # one sender a forward
    assert (got - want).abs().nan_to_num().max() < 1e-5
    with pytest.raises(ValueError, match="max_memory must be None"):
        heads.path_patch_scan(model, clean, corrupted, _metric, receivers="logits", max_memory=0)


@pytest.mark.parametrize("name", ["gpt2", "qwen2", "gemma2"])
def test_the_recording_runs_skip_their_full_logits_under_a_small_budget_and_the_table_stays(name, monkeypatch):
    """Under a budget their logits would pass a quarter of, the clean and corrupted runs ask
    for the last position's logits only (logits_to_keep=1); the self-checks read the last
    block's output, so the prefix skip and the shortcut are still checked; same table."""
    from test_interop_hf_registry import build

    model = build(name, lm=True)
    model.set_attn_implementation("multihead")
    clean, corrupted = _inputs(name, 1), _inputs(name, 2)
    # the scan reports no keywords of its recording runs: a spy on the function that picks them records them
    asked, real = [], _scan._lean
    monkeypatch.setattr(_scan, "_lean", lambda *a: asked.append(real(*a)) or asked[-1])  # records each pick
    want = heads.patch_scan(model, clean, corrupted, _metric)
    got = heads.patch_scan(model, clean, corrupted, _metric, max_memory=1000)
    assert asked == [{}, {"logits_to_keep": 1}], asked
    assert (got - want).abs().max() < 1e-5
