"""patch_scan's shortcut at the patched layer: a variant's attention output there is the
corrupted run's plus the head's change through its columns of the output projection, so
that layer's attention does not run for its variants. The table must equal the path that
runs it (the shortcut turned off: the batched forwards tested against one full patched
forward per head in test_heads.py), to float rounding, on every decoder architecture,
with nothing shared (clean and corrupted differ from the first token) and with the prefix skip (one token changed
in the middle), for z, pattern and a subset of positions; and it must be declined where
it would not be exact."""

from __future__ import annotations

import pytest
import torch

from multihead import heads

pytestmark = pytest.mark.usefixtures("one_torch_thread")

transformers = pytest.importorskip("transformers")

import multihead.interop.hf  # noqa: E402, F401  (registers "multihead")
from multihead.heads import _scan_state, _shortcut  # noqa: E402
from multihead.heads import scan as _scan  # noqa: E402
from test_heads import _inputs, _metric, _mh, _one_token_changed  # noqa: E402
from test_interop_hf_registry import DECODERS  # noqa: E402


def _decisions(monkeypatch) -> list:
    """(reason, layers taken) of every scan's shortcut decision."""
    seen, real = [], _scan_state.ScanState.decide_shortcut

    def spy(self, *args):
        why = real(self, *args)
        seen.append((why, sorted(self.shortcut.layers)))
        return why
    monkeypatch.setattr(_scan_state.ScanState, "decide_shortcut", spy)
    return seen


def _both(monkeypatch, model, clean, corrupted, **kw):
    # the shortcut has no public switch (it is exact or declined): the scan's flag turns it off to compare
    monkeypatch.setattr(_scan, "_SHORTCUT", True)
    fast = heads.patch_scan(model, clean, corrupted, _metric, **kw)
    monkeypatch.setattr(_scan, "_SHORTCUT", False)  # the table without it
    slow = heads.patch_scan(model, clean, corrupted, _metric, **kw)
    monkeypatch.setattr(_scan, "_SHORTCUT", True)  # on again for the caller
    return fast, slow


@pytest.mark.parametrize("name", DECODERS)
def test_the_shortcut_gives_the_table_of_the_path_that_runs_the_patched_layer(name, monkeypatch):
    model = _mh(name)
    seen = _decisions(monkeypatch)
    n_layers = None
    for pair in ("nothing shared", "one token changed"):
        clean, corrupted = (_inputs(name, 1), _inputs(name, 2)) if pair == "nothing shared" else \
            _one_token_changed(name)
        for what, positions in [("z", None), ("pattern", None), ("z", [2, 6, -1])]:
            seen.clear()
            fast, slow = _both(monkeypatch, model, clean, corrupted, what=what, positions=positions)
            n_layers = fast.shape[0]
            assert seen[0] == ("", list(range(n_layers))), f"{name} {pair} {what}: {seen[0]}"
            scale = 1 + slow.abs().nan_to_num().max().item()
            diff = (fast - slow).abs().nan_to_num().max().item()
            # today's path is bitwise one patched forward per head; the shortcut sums the
            # projection in another order: float32 rounding, which gemma2 (softcap, scaled
            # embeddings) grows to 1.3e-6 of the table's largest value
            assert diff < 2e-6 * scale, f"{name} {pair} {what} {positions}: max diff {diff:.2e} (scale {scale:.1f})"
            assert (slow - slow.nan_to_num().mean()).abs().nan_to_num().max() > 1e-6, "every head scored the same"
    for what in ("k", "v"):  # a key or value patch changes the attention itself: the layer runs
        seen.clear()
        heads.patch_scan(model, clean, corrupted, _metric, what=what)
        assert seen[0] == (f"not for what={what!r}", [])


def test_the_shortcut_is_declined_where_the_attention_output_is_not_the_projection_of_z(monkeypatch):
    """BERT's attention module hands back the heads' z (the projection is its sibling's):
    declined by the check, and the table is still the exact one."""
    seen = _decisions(monkeypatch)
    model = _mh("bert")
    clean, corrupted = _inputs("bert", 1), _inputs("bert", 2)
    fast, slow = _both(monkeypatch, model, clean, corrupted)
    assert seen[0][1] == [] and "is not its output projection of the heads' z" in seen[0][0], seen[0]
    assert torch.equal(fast.nan_to_num(), slow.nan_to_num())


def test_the_shortcut_is_declined_when_its_self_check_fails(monkeypatch):
    """A module input whose batch the shortcut cuts wrongly (simulated: the 4-D attention
    mask left uncut) makes the self-check fail or raise: declined, and the table exact."""
    seen = _decisions(monkeypatch)
    model = _mh("llama")
    clean, corrupted = _inputs("llama", 1), _inputs("llama", 2)
    want = heads.patch_scan(model, clean, corrupted, _metric)
    real = _shortcut.keep_rows
    # a fault injected: a mask left uncut, which no real model produces; the check must catch it
    monkeypatch.setattr(_shortcut, "keep_rows", lambda x, rows, keep: x if isinstance(x, torch.Tensor) and x.dim() == 4
                        else real(x, rows, keep))
    seen.clear()
    got = heads.patch_scan(model, clean, corrupted, _metric)
    assert seen[0][1] == [] and seen[0][0].startswith("the corrupted run through the shortcut"), seen[0]
    assert (got - want).abs().max() < 1e-5
