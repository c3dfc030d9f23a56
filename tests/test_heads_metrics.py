"""`heads.AtPositions`: a metric of one position per row, and the scans computing the model's
head at those positions only (transformers' `logits_to_keep`), with the same tables as the
plain metric on full logits."""

from __future__ import annotations

import pytest
import torch

from multihead import heads
from multihead.heads import _budget, _scan_state

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _lm():
    """A random 2-layer Llama with its LM head (GQA 4/2), on attn_implementation="multihead"."""
    import multihead.interop.hf  # noqa: F401

    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, vocab_size=96,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("multihead")
    return model


def _fn(last):  # (B, vocab) -> a scalar that reads several columns of every row
    return (last[:, 3] - 0.5 * last[:, 4] + last[:, :7].square().mean(1)).mean()


def _pairs(T=9, changed=6):
    g = torch.Generator().manual_seed(1)
    clean = {"input_ids": torch.randint(3, 96, (2, T), generator=g),
             "attention_mask": torch.ones(2, T, dtype=torch.long)}
    corrupted = {k: v.clone() for k, v in clean.items()}
    corrupted["input_ids"][:, changed] = (clean["input_ids"][:, changed] + 5) % 90 + 3
    return clean, corrupted


def _read_sizes(monkeypatch) -> list:
    seen, real = [], _scan_state.ScanState.read
    monkeypatch.setattr(_scan_state.ScanState, "read",
                        lambda self, metric, lg: seen.append(lg.shape[1]) or real(self, metric, lg))
    return seen


@pytest.mark.parametrize("positions", [[8, 8], [7, 5], [-1, 6]])
def test_at_positions_equals_the_plain_metric_and_the_scan_computes_only_those_logits(monkeypatch, positions):
    model = _lm()
    clean, corrupted = _pairs()
    metric = heads.AtPositions(_fn, positions)
    rows = torch.arange(2)
    absolute = torch.tensor([p % 9 for p in positions])

    def plain(logits):
        return _fn(logits[rows, absolute])

    with torch.no_grad():
        logits = model(**corrupted).logits
    assert metric(logits).item() == plain(logits).item()
    seen = _read_sizes(monkeypatch)
    info: dict = {}
    got = heads.patch_scan(model, clean, corrupted, metric, info=info)
    # only the distinct positions read were computed (one, T - 1, once rows are rolled to end there)
    assert set(seen) == {1 if info["aligned"] else len(set(absolute.tolist()))}
    assert info["aligned"] == (positions != [8, 8]), info  # rolled where a row reads before the last position
    assert info["skipped"]
    seen.clear()
    want = heads.patch_scan(model, clean, corrupted, plain)
    assert set(seen) == {9}
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # the reference: each head patched by hand, the metric on the full logits
    rec = heads.record(model, clean)
    for layer, h in [(0, 1), (1, 3)]:
        with torch.no_grad(), heads.patch(model, rec, [(layer, h)]):
            by_hand = plain(model(**corrupted).logits).item()
        assert abs(got[layer, h].item() - by_hand) < 1e-5


def test_path_scans_and_attribution_take_it_too():
    model = _lm()
    clean, corrupted = _pairs()
    metric = heads.AtPositions(_fn, [8, 7])
    rows, at = torch.arange(2), torch.tensor([8, 7])

    def plain(logits):
        return _fn(logits[rows, at])

    torch.testing.assert_close(heads.attribution_scan(model, clean, corrupted, metric),
                               heads.attribution_scan(model, clean, corrupted, plain), rtol=0, atol=1e-6)
    torch.testing.assert_close(heads.path_patch_scan(model, clean, corrupted, metric, [(1, 0)]),
                               heads.path_patch_scan(model, clean, corrupted, plain, [(1, 0)]), rtol=0, atol=1e-5)


def test_a_model_without_logits_to_keep_gets_full_logits(monkeypatch):
    model = _lm()
    clean, corrupted = _pairs()
    monkeypatch.setattr(_budget, "takes_logits_to_keep", lambda m: False)  # a model without logits_to_keep
    seen = _read_sizes(monkeypatch)
    metric = heads.AtPositions(_fn, [8, 7])
    got = heads.patch_scan(model, clean, corrupted, metric)
    assert set(seen) == {9}
    monkeypatch.undo()
    torch.testing.assert_close(got, heads.patch_scan(model, clean, corrupted, metric), rtol=0, atol=1e-5)


@pytest.mark.parametrize("positions, message", [
    ([[1, 2]], "1-D tensor of integer positions"),
    ([], "non-empty"),
    ([0.5, 1.0], "integer positions"),
    ("x", "integer positions"),
    ([True, False], "integer positions"),
])
def test_bad_positions_are_one_line_errors(positions, message):
    with pytest.raises(ValueError, match=message):
        heads.AtPositions(_fn, positions)


def test_mismatched_rows_and_positions_are_refused():
    model = _lm()
    clean, corrupted = _pairs()
    with pytest.raises(ValueError, match="one position for each of 3 rows; the inputs have 2 rows"):
        heads.patch_scan(model, clean, corrupted, heads.AtPositions(_fn, [1, 2, 3]))
    with pytest.raises(ValueError, match=r"reads positions \[1, 9\]; the logits have 9 positions"):
        heads.AtPositions(_fn, [1, 9])(torch.zeros(2, 9, 5))
    with pytest.raises(ValueError, match=r"reads logits \(B=2, T, vocab\)"):
        heads.AtPositions(_fn, [1, 2])(torch.zeros(2, 5))
    with pytest.raises(TypeError, match="fn must be callable"):
        heads.AtPositions(None, [1, 2])


def _ragged():
    """Right-padded pairs of different lengths, changed at different places (as tasks.ioi's)."""
    g = torch.Generator().manual_seed(3)
    T, lengths, changed = 12, [12, 8, 10], [5, 3, 7]
    ids = torch.randint(3, 96, (3, T), generator=g)
    mask = torch.zeros(3, T, dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, n:] = 0
        mask[r, :n] = 1
    bad = ids.clone()
    for r, c in enumerate(changed):
        bad[r, c] = (ids[r, c] + 7) % 90 + 3
    return {"input_ids": ids, "attention_mask": mask}, {"input_ids": bad, "attention_mask": mask.clone()}, \
        torch.tensor(lengths) - 1


def test_rows_rolled_to_end_where_the_metric_reads_give_the_same_table(monkeypatch):
    from multihead.heads import _align

    model = _lm()
    clean, corrupted, last = _ragged()
    metric = heads.AtPositions(_fn, last)
    before = {k: v.clone() for k, v in corrupted.items()}
    info: dict = {}
    got = heads.patch_scan(model, clean, corrupted, metric, info=info)
    assert info["aligned"] and info["prefix"] == 5 and info["skipped"], info  # rolled: changes at 5, 7, 9
    assert all(torch.equal(before[k], corrupted[k]) for k in before)  # the caller's inputs are not touched
    monkeypatch.setattr(_align, "_ALIGN", False)  # no public switch: the rows as given, to compare
    off: dict = {}
    want = heads.patch_scan(model, clean, corrupted, metric, info=off)
    assert not off["aligned"] and off["prefix"] == 3
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    rec = heads.record(model, clean)  # and by hand on the rows as given
    rows = torch.arange(3)
    for layer, h in [(0, 0), (1, 2)]:
        with torch.no_grad(), heads.patch(model, rec, [(layer, h)]):
            by_hand = _fn(model(**corrupted).logits[rows, last]).item()
        assert abs(got[layer, h].item() - by_hand) < 1e-5


def test_rolling_is_declined_with_a_reason_where_it_cannot_be_checked_equal(monkeypatch):
    model = _lm()
    clean, corrupted, last = _ragged()
    metric = heads.AtPositions(_fn, last)
    info: dict = {}
    heads.patch_scan(model, clean, corrupted, metric, positions=[-1], info=info)
    assert not info["aligned"] and info["aligned_reason"] == "positions= given"
    extra = ({**clean, "token_type_ids": torch.zeros_like(clean["input_ids"])},
             {**corrupted, "token_type_ids": torch.zeros_like(clean["input_ids"])})
    heads.patch_scan(model, *extra, metric, info=info)  # (Llama's forward takes and ignores them)
    assert not info["aligned"] and "inputs other than" in info["aligned_reason"]

    # GPT-2's positions are learned and absolute: rolled rows are the same only through position_ids
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=32, vocab_size=96)
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(cfg).eval()
    gpt2.set_attn_implementation("multihead")
    info = {}
    got = heads.patch_scan(gpt2, clean, corrupted, metric, info=info)
    assert info["aligned"], info
    from multihead.heads import _align

    with monkeypatch.context() as mp:
        mp.setattr(_align, "_ALIGN", False)  # no public switch: the rows as given, to compare
        torch.testing.assert_close(got, heads.patch_scan(gpt2, clean, corrupted, metric), rtol=0, atol=1e-5)

    class Unpositioned(transformers.GPT2LMHeadModel):  # counts positions itself, whatever it is handed
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, logits_to_keep=0, use_cache=None,
                    **kw):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep,
                                   use_cache=use_cache, **kw)

    other = Unpositioned(cfg).eval()
    other.load_state_dict(gpt2.state_dict())
    other.set_attn_implementation("multihead")
    info = {}
    got = heads.patch_scan(other, clean, corrupted, metric, info=info)
    assert not info["aligned"] and "rolled rows' logits differ" in info["aligned_reason"], info
    rec = heads.record(other, clean)
    with torch.no_grad(), heads.patch(other, rec, [(1, 1)]):
        by_hand = metric(other(**corrupted).logits).item()
    assert abs(got[1, 1].item() - by_hand) < 1e-5
