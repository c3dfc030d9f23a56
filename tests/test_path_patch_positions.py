"""path_patch / path_patch_scan with an `AtPositions` metric on right-padded rows of
different lengths (as tasks.ioi's): the same numbers as the plain metric on full logits and
as the hand-written three steps on eager attention (`test_path_patch._Eager`), while the
forwards ending in logits compute the read positions only, the scan's rows are rolled to end
where the metric reads (so its prefix skip starts later) and its forwards carry more
variants when their rows are short."""

from __future__ import annotations

import pytest
import torch

from multihead import heads
from multihead.heads import _align, _budget, path_patching  # the scan's internals: see _Seen

pytestmark = pytest.mark.usefixtures("one_torch_thread")

transformers = pytest.importorskip("transformers")

from test_path_patch import TOL, V, _build, _Eager, _receivers  # noqa: E402


def _ragged(B=6, T=12):
    """Right-padded pairs, each row its own length and its own changed position."""
    g = torch.Generator().manual_seed(5)
    lengths = [12, 8, 10, 9, 12, 11][:B]
    changed = [5, 3, 7, 4, 8, 6][:B]
    ids = torch.randint(3, V, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, n:] = 0
        mask[r, :n] = 1
    bad = ids.clone()
    for r, c in enumerate(changed):
        bad[r, c] = (ids[r, c] + 7) % (V - 3) + 3
    return {"input_ids": ids, "attention_mask": mask}, {"input_ids": bad, "attention_mask": mask.clone()}, \
        torch.tensor(lengths) - 1


def _fn(last):  # (B, vocab) -> a scalar reading several columns of every row
    return (last[:, 3] - 0.5 * last[:, 4] + last[:, :7].square().mean(1)).mean()


def _plain(read):
    rows = torch.arange(len(read))
    return lambda logits: _fn(logits[rows, read])


class _Seen:
    """Records, for every forward of path_patching, the logits' positions, the prefix the
    skip took and the senders one step-3 forward carried."""

    def __init__(self, monkeypatch):
        self.logits, self.prefix, self.per_forward, self.aligned = [], [], [], []
        # path_patch reports none of these (it returns a number or a table): spies on its steps record them
        real_forward, real_skip, real_chunk = path_patching._forward, path_patching._Skip, path_patching._chunk
        real_aligned = path_patching.aligned

        def forward(*args, **kw):
            out = real_forward(*args, **kw)
            if out is not None:
                self.logits.append(out.shape[1])
            return out

        class Skip(real_skip):
            def __init__(s, T, p, *rest):
                self.prefix.append(p)
                super().__init__(T, p, *rest)

        def chunk(runs, laid, layer, hs, *rest):
            self.per_forward.append(len(hs))
            return real_chunk(runs, laid, layer, hs, *rest)

        def aligned(*args, **kw):
            out = real_aligned(*args, **kw)
            self.aligned.append((out[0] is not args[1], out[3]))
            return out

        # each spy installed where path_patching looks it up, for the reason given above
        monkeypatch.setattr(path_patching, "_forward", forward)
        monkeypatch.setattr(path_patching, "_Skip", Skip)  # the prefix the skip took
        monkeypatch.setattr(path_patching, "_chunk", chunk)  # the senders each forward carried
        monkeypatch.setattr(path_patching, "aligned", aligned)  # whether the rows were rolled, and why not

    def clear(self):
        for x in (self.logits, self.prefix, self.per_forward, self.aligned):
            x.clear()


RECEIVERS = [("q", [(2, 0), (2, 3)]), ("k", [(1, 1), (2, 0)]), ("v", [(2, 1)]), ("q", "logits"),
             ("q", [(1, 2, "q"), (2, 1, "v"), "logits"])]


@pytest.mark.parametrize("via, receivers", RECEIVERS)
def test_path_patch_scan_at_positions_equals_the_plain_metric_and_the_rows_as_given(via, receivers, monkeypatch):
    model, eager = _build("llama")
    clean, corrupted, last = _ragged()
    before = {k: v.clone() for k, v in corrupted.items()}
    metric, plain = heads.AtPositions(_fn, last), _plain(last)
    seen = _Seen(monkeypatch)
    got = heads.path_patch_scan(model, clean, corrupted, metric, receivers, via=via)
    assert seen.aligned == [(True, "")], seen.aligned
    assert seen.prefix == [5], seen.prefix  # rolled to end at 11: the changes at 5..9 (as given: 3)
    assert set(seen.logits) == {12, 1}, seen.logits  # the skip's check on full logits; the scan's, T - 1 only
    assert seen.logits.count(12) == 1
    assert set(seen.per_forward) == {4}, seen.per_forward  # every sender of a layer: short rows, > 16 // B
    assert all(torch.equal(before[k], corrupted[k]) for k in before)  # the caller's inputs are not touched
    seen.clear()
    want = heads.path_patch_scan(model, clean, corrupted, plain, receivers, via=via)
    assert seen.aligned == [(False, "")] and seen.prefix == [3] and set(seen.logits) == {12}
    assert set(seen.per_forward) == {4}
    torch.testing.assert_close(got, want, rtol=0, atol=TOL * (1 + float(want.abs().max())))
    seen.clear()
    monkeypatch.setattr(_align, "_ALIGN", False)  # no public switch: the rows as given, to compare
    monkeypatch.setattr(_budget, "POSITIONS_PER_RUN", 0)  # and the rows' bound alone: 16 // B variants
    unrolled = heads.path_patch_scan(model, clean, corrupted, metric, receivers, via=via)
    assert seen.aligned == [(False, "turned off")] and seen.prefix == [3] and set(seen.per_forward) == {2}
    assert set(seen.logits) - {12} == {len(set(last.tolist()))}  # the read positions, as given
    torch.testing.assert_close(got, unrolled, rtol=0, atol=TOL * (1 + float(want.abs().max())))
    # the reference: the three steps by hand on eager attention, the rows as given
    ref = _Eager(eager)
    logits = "logits" in receivers
    rs = _receivers([r for r in receivers if r != "logits"] if receivers != "logits" else [], via)
    for layer, h in [(0, 1), (1, 3), (0, 2)]:
        by_hand = ref.path_patch(clean, corrupted, plain, [(layer, h)], rs, logits=logits)
        assert abs(got[layer, h].item() - by_hand) < TOL * (1 + abs(by_hand)), (layer, h, got[layer, h], by_hand)
    assert (want[:2] - want[2, 0]).abs().max() > 1e-3, "every cell the corrupted metric: the check could not fail"


@pytest.mark.parametrize("via, receivers", RECEIVERS)
def test_path_patch_at_positions_computes_the_read_positions_only(via, receivers, monkeypatch):
    model, eager = _build("llama")
    clean, corrupted, last = _ragged()
    metric, plain = heads.AtPositions(_fn, last), _plain(last)
    ref = _Eager(eager)
    logits = "logits" in receivers
    rs = _receivers([r for r in receivers if r != "logits"] if receivers != "logits" else [], via)
    seen = _Seen(monkeypatch)
    for senders in ([(0, 1)], [(0, 3), (1, 0)]):
        seen.clear()
        got = heads.path_patch(model, clean, corrupted, metric, senders, receivers, via=via)
        assert seen.logits == [len(set(last.tolist()))], seen.logits  # step 3 only ends in logits
        want = heads.path_patch(model, clean, corrupted, plain, senders, receivers, via=via)
        by_hand = ref.path_patch(clean, corrupted, plain, senders, rs, logits=logits)
        assert abs(got - want) < TOL * (1 + abs(want)) and abs(got - by_hand) < TOL * (1 + abs(by_hand)), \
            (senders, got, want, by_hand)


def test_a_model_without_logits_to_keep_gets_full_logits_and_rows_as_given(monkeypatch):
    model, _ = _build("llama")
    clean, corrupted, last = _ragged()
    metric = heads.AtPositions(_fn, last)
    want = heads.path_patch_scan(model, clean, corrupted, metric, [(2, 0)])
    seen = _Seen(monkeypatch)
    monkeypatch.setattr(_budget, "takes_logits_to_keep", lambda m: False)  # keep_positions reads it there
    monkeypatch.setattr(_align, "forward_takes", lambda m, *names: False)  # a model without logits_to_keep, as above
    got = heads.path_patch_scan(model, clean, corrupted, metric, [(2, 0)])
    assert not seen.aligned[0][0] and "logits_to_keep" in seen.aligned[0][1]
    assert set(seen.logits) == {12} and seen.prefix == [3]
    torch.testing.assert_close(got, want, rtol=0, atol=TOL * (1 + float(want.abs().max())))


def test_a_metric_for_other_rows_is_a_one_line_error():
    model, _ = _build("llama")
    clean, corrupted, _ = _ragged()
    with pytest.raises(ValueError, match=r"reads logits \(B=2, T, vocab\)"):
        heads.path_patch_scan(model, clean, corrupted, heads.AtPositions(_fn, [1, 2]), [(2, 0)])
    with pytest.raises(ValueError, match=r"reads positions \[1, 12, 1, 1, 1, 1\]; the logits have 12 positions"):
        heads.path_patch(model, clean, corrupted, heads.AtPositions(_fn, [1, 12, 1, 1, 1, 1]), [(0, 0)], [(2, 0)])
