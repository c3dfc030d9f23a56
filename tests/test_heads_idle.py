"""patch_scan's idle blocks: in a forward whose variants start at a later layer, each block
below the first patched one runs on one row and one position (`_prefix.idle`), because its
output is replaced by the corrupted run's cached input. What they compute is never read,
so the table must be bitwise the one of blocks run on one row of every position (the
behaviour before), on every decoder architecture, with nothing shared and with the prefix
skip; the blocks must really run one position; and inputs `idle` does not know how to cut
leave a block all its positions (the hidden states widened back where an earlier idle
block cut them), never an error."""

from __future__ import annotations

import pytest
import torch

from multihead import heads
from multihead.heads import _prefix, _scan_state
from multihead.masks import MaskMod

pytestmark = pytest.mark.usefixtures("one_torch_thread")

transformers = pytest.importorskip("transformers")

import multihead.interop.hf  # noqa: E402, F401  (registers "multihead")
from test_heads import _metric, _mh, _one_token_changed  # noqa: E402
from test_interop_hf_registry import DECODERS  # noqa: E402


def _all_positions(args, kwargs, B, T, skipped=None):
    """The idle blocks' inputs before: one row, every position."""
    from multihead.heads._batch import one_row

    return tuple(one_row(a, B) for a in args), {k: one_row(v, B) for k, v in kwargs.items()}


def _idle_positions(model) -> tuple[list[int], list]:
    """A spy on every block's input: (the positions of the blocks that run on one row, the
    hooks' handles to remove)."""
    seen, handles = [], []
    for block in _blocks(model):
        def pre(m, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            if x.shape[0] == 1:
                seen.append(x.shape[1])
        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
    return seen, handles


def _blocks(model):
    stacks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
    return list(stacks[0])


@pytest.mark.parametrize("name", DECODERS)
@pytest.mark.parametrize("at", [0, 5])  # nothing shared; the prefix skip (row 1 left-padded)
def test_idle_blocks_run_one_position_and_the_table_is_bitwise_the_same(name, at, monkeypatch):
    model = _mh(name)
    clean, corrupted = _one_token_changed(name, at)
    metric = _metric
    seen, handles = _idle_positions(model)
    try:
        fast = heads.patch_scan(model, clean, corrupted, metric, variants_per_run=1)
    finally:
        for h in handles:
            h.remove()
    monkeypatch.setattr(_scan_state, "idle", _all_positions)
    slow = heads.patch_scan(model, clean, corrupted, metric, variants_per_run=1)
    assert torch.equal(fast, slow), f"{name}: max diff {(fast - slow).abs().max().item():.2e}"
    # this spy's hooks run before the scan's, so it sees each block's input as the forward
    # hands it: an idle block after the first receives the one position the first left
    assert 1 in seen, f"{name}: no block ran idle on one position (saw {sorted(set(seen))})"


def test_idle_cuts_every_input_it_knows_to_the_first_position():
    T, B, C = 6, 2, 4
    h = torch.randn(B, T, C)
    mask = torch.randn(B, 1, T, T)
    cos, sin = torch.randn(1, T, 8), torch.randn(1, T, 8)
    args, kw = _prefix.idle((h, None, mask), {"position_ids": torch.arange(T)[None].expand(B, T),
                                             "position_embeddings": (cos, sin), "cache_position": torch.arange(T),
                                             "use_cache": False}, B, T)
    assert torch.equal(args[0], h[:1, :1]) and args[1] is None and torch.equal(args[2], mask[:1, :, :1, :1])
    assert torch.equal(kw["position_ids"], torch.zeros(1, 1, dtype=torch.long))
    assert torch.equal(kw["position_embeddings"][0], cos[:, :1]) and torch.equal(kw["position_embeddings"][1],
                                                                               sin[:, :1])
    assert torch.equal(kw["cache_position"], torch.zeros(1, dtype=torch.long)) and kw["use_cache"] is False
    fn = MaskMod(lambda b, h, q, k: q >= k, "causal")
    assert _prefix.idle((h,), {"attention_mask": fn}, B, T)[1]["attention_mask"] is fn  # q = k = 0 either way


@pytest.mark.parametrize("odd", ["unknown", "mask", "dict"])
def test_idle_leaves_every_position_to_an_input_it_does_not_know(odd):
    """A T-long input of no known kind, a mask of other positions than (T, T), a dict of
    tensors: one row of every position, and hidden states an earlier idle block left at one
    position widened back to T (a view), so that the block's shapes agree."""
    T, B, C = 6, 2, 4
    extra = {"unknown": {"token_types": torch.zeros(B, T, 3)}, "mask": {"attention_mask": torch.ones(B, 1, T, T + 2)},
             "dict": {"attention_mask": {"full": torch.ones(B, 1, T, T)}}}[odd]
    for h in (torch.randn(B, T, C), torch.randn(1, 1, C)):  # the first idle block's input, a later one's
        args, kw = _prefix.idle((h,), dict(extra), B, T)
        assert args[0].shape == (1, T, C) and torch.equal(args[0][0, 0], h[0, 0])
        for k, v in extra.items():
            got, want = kw[k], v
            if isinstance(want, dict):
                assert got.keys() == want.keys()
            else:
                assert torch.equal(got, want[:1])


def test_idle_keeps_every_position_where_the_skip_leaves_one():
    """Under the prefix skip with T - p = 1 the attention handler takes a one-position block
    input for a cut one (and puts the prefix in front): an idle block then keeps its T."""
    T, B, C = 6, 2, 4
    h = torch.randn(B, T, C)
    args, _ = _prefix.idle((h,), {}, B, T, skipped=1)
    assert torch.equal(args[0], h[:1])
    args, _ = _prefix.idle((h,), {}, B, T, skipped=2)
    assert torch.equal(args[0], h[:1, :1])
