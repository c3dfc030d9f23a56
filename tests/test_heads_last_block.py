"""patch_scan's last block at the read position: with a metric that reads only the last
position, the variants' last block runs its output projection and MLP there only (its
attention still at every position, for the keys and values). The table must equal the
path that runs the whole block (the trim turned off; that path is tested against one
patched forward per head in test_heads.py) within 1e-6 of the table's scale, and one
patched forward per head by hand, on every decoder architecture, with nothing shared and
with the prefix skip, with and without the shortcut at the patched layer, for z, pattern,
k, v and a subset of positions; and it must be declined, with the reason, where it would
not be exact."""

from __future__ import annotations

import pytest
import torch

from multihead import heads

pytestmark = pytest.mark.usefixtures("one_torch_thread")

transformers = pytest.importorskip("transformers")

import multihead.interop.hf  # noqa: E402, F401  (registers "multihead")
from multihead.heads import _scan_state, _top  # noqa: E402
from multihead.heads import scan as _scan  # noqa: E402
from multihead.heads.engine import logits_of  # noqa: E402
from test_heads import _inputs, _mh, _one_token_changed  # noqa: E402
from test_interop_hf_registry import DECODERS  # noqa: E402


def _fn(last):  # (B, vocab | C) at the read position -> a scalar that reads several columns nonlinearly
    return (last[:, 3] - 0.5 * last[:, 4] + last[:, :7].square().mean(1)).mean()


def _last(B: int = 2):
    return heads.AtPositions(_fn, [-1] * B, "the test metric")


def _both(monkeypatch, model, clean, corrupted, metric, **kw):
    """(table, info) with the trim, then the table without it (today's whole last block)."""
    info: dict = {}
    # the trim has no public switch (it is exact or declined): the scan's own flag turns it off to compare
    monkeypatch.setattr(_scan, "_LAST_BLOCK", True)
    fast = heads.patch_scan(model, clean, corrupted, metric, info=info, **kw)
    monkeypatch.setattr(_scan, "_LAST_BLOCK", False)  # the whole last block: the table to equal
    slow_info: dict = {}
    slow = heads.patch_scan(model, clean, corrupted, metric, info=slow_info, **kw)
    monkeypatch.setattr(_scan, "_LAST_BLOCK", True)  # back on for the caller's next scan
    assert slow_info["last_block"] is False and slow_info["last_block_reason"] == "turned off"
    return fast, slow, info


def _close(fast, slow, what: str, rel: float = 1e-6) -> None:
    """Equal within `rel` of the table's scale: 1e-6 is about 8 float32 roundings (eps 1.2e-7)
    of the largest entry, for the small models here (a few layers, so few roundings add up)."""
    scale = 1 + slow.abs().nan_to_num().max().item()
    diff = (fast - slow).abs().nan_to_num().max().item()
    assert diff <= rel * scale, f"{what}: max diff {diff:.2e} (scale {scale:.1f}, bound {rel:g} x scale)"
    assert (slow - slow.nan_to_num().mean()).abs().nan_to_num().max() > 1e-6, f"{what}: every head scored the same"


def _by_hand(model, clean, corrupted, metric, cells, what: str = "z") -> list[float]:
    """The metric with one head patched from the clean run, one full forward each (the
    metric on the whole logits: AtPositions called as a plain metric)."""
    rec = heads.record(model, clean, what=(what,))
    out = []
    for layer, h in cells:
        with torch.no_grad(), heads.patch(model, rec, [(layer, h)], what=what):
            out.append(float(metric(logits_of(model(**corrupted)))))
    return out


@pytest.mark.parametrize("name", DECODERS)
def test_the_trimmed_last_block_gives_the_table_of_the_whole_block(name, monkeypatch):
    model = _mh(name)
    metric = _last()
    kernels = set()
    for pair in ("nothing shared", "one token changed"):
        clean, corrupted = (_inputs(name, 1), _inputs(name, 2)) if pair == "nothing shared" else \
            _one_token_changed(name)
        for what, positions, shortcut in [("z", None, True), ("z", None, False), ("pattern", None, True),
                                          ("z", [2, 6, -1], True), ("z", [2, 6], True)]:
            monkeypatch.setattr(_scan, "_SHORTCUT", shortcut)  # no public switch: the trim with and without it
            fast, slow, info = _both(monkeypatch, model, clean, corrupted, metric, what=what, positions=positions)
            assert info["last_block"], f"{name} {pair} {what}: {info}"
            kernels.add(info["last_block_reason"])  # "" when the kernel, too, ran the last query only
            assert info["skipped"] == (pair == "one token changed"), info
            _close(fast, slow, f"{name} {pair} {what} {positions} shortcut={shortcut}")
        monkeypatch.setattr(_scan, "_SHORTCUT", True)  # the default again
    assert kernels == {""}, kernels  # the kernel ran the last query only
    n_layers = fast.shape[0]
    cells = [(0, 0), (n_layers - 1, 1), (n_layers - 1, 0)]  # the last layer's heads run through the trimmed block
    want = _by_hand(model, clean, corrupted, metric, cells)
    got = heads.patch_scan(model, clean, corrupted, metric)
    for (layer, h), w in zip(cells, want):
        assert abs(got[layer, h].item() - w) <= 1e-5 * (1 + abs(w)), f"{name} layer {layer} head {h}"


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2"])
@pytest.mark.parametrize("what", ["k", "v"])
def test_key_and_value_scans_through_the_trimmed_last_block(name, what, monkeypatch):
    model = _mh(name)
    metric = _last()
    for clean, corrupted in [(_inputs(name, 1), _inputs(name, 2)), _one_token_changed(name)]:
        fast, slow, info = _both(monkeypatch, model, clean, corrupted, metric, what=what)
        assert info["last_block"], info
        _close(fast, slow, f"{name} {what}")
    n_layers = fast.shape[0]
    cells = [(0, 0), (n_layers - 1, 0)]
    for (layer, h), w in zip(cells, _by_hand(model, clean, corrupted, metric, cells, what)):
        assert abs(fast[layer, h].item() - w) <= 1e-5 * (1 + abs(w)), f"{name} {what} layer {layer} head {h}"


def _lm(name: str = "llama"):
    """A random 3-layer causal LM with its head (Llama: GQA 4/2; GPT-2: 4 heads)."""
    if name == "llama":
        cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, vocab_size=96,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                       max_position_embeddings=64)
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.GPT2Config(n_embd=32, n_layer=3, n_head=4, n_positions=64, vocab_size=96)
        cls = transformers.GPT2LMHeadModel
    torch.manual_seed(0)
    model = cls(cfg).eval()
    model.set_attn_implementation("multihead")
    return model


def _pairs(T=11, changed=(0, 6)):
    g = torch.Generator().manual_seed(1)
    clean = {"input_ids": torch.randint(3, 96, (2, T), generator=g),
             "attention_mask": torch.ones(2, T, dtype=torch.long)}
    corrupted = {k: v.clone() for k, v in clean.items()}
    for at in changed:
        corrupted["input_ids"][:, at] = (clean["input_ids"][:, at] + 5) % 90 + 3
    return clean, corrupted


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("positions", [[-1, -1], [7, 5]])
def test_language_models_with_their_head_at_the_read_position(name, positions, monkeypatch):
    """Causal LMs computing their head at the read position only (`logits_to_keep`); rows
    that read elsewhere than T - 1 are rolled to end there first, and then trimmed."""
    model = _lm(name)
    metric = heads.AtPositions(_fn, positions)
    for changed in [(0, 6), (6,)]:  # nothing shared, and the prefix skip
        clean, corrupted = _pairs(changed=changed)
        fast, slow, info = _both(monkeypatch, model, clean, corrupted, metric)
        assert info["last_block"] and info["aligned"] == (positions == [7, 5]), info
        _close(fast, slow, f"{name} {positions} {changed}")
        cells = [(0, 1), (1, 2), (2, 0), (2, 3)]
        for (layer, h), w in zip(cells, _by_hand(model, clean, corrupted, metric, cells)):
            assert abs(fast[layer, h].item() - w) <= 1e-5 * (1 + abs(w)), f"{name} layer {layer} head {h}"


def test_rows_are_rolled_for_the_trim_where_the_shared_prefix_would_not_grow(monkeypatch):
    """Both rows changed at 6, one read at 8 and one at the last position (10): rolled, the
    first row's change moves to 8 and the shared prefix stays 6 (the second row's), but every
    row then reads T - 1 and the last block is trimmed. Without the trim (the scan's flag
    off) the rows stay as given; both tables equal one patched forward per head."""
    model = _lm()
    clean, corrupted = _pairs(changed=(6,))
    metric = heads.AtPositions(_fn, [8, 10])
    fast, slow, info = _both(monkeypatch, model, clean, corrupted, metric)
    assert info["aligned"] and info["prefix"] == 6 and info["skipped"] and info["last_block"], info
    assert info["last_block_reason"] == "", info
    _close(fast, slow, "rolled for the trim")
    monkeypatch.setattr(_scan, "_LAST_BLOCK", False)
    off = _decision(model, clean, corrupted, metric)
    assert not off["aligned"] and off["aligned_reason"] == "" and off["prefix"] == 6, off
    monkeypatch.setattr(_scan, "_LAST_BLOCK", True)
    cells = [(0, 1), (2, 0), (2, 3)]
    for (layer, h), w in zip(cells, _by_hand(model, clean, corrupted, metric, cells)):
        assert abs(fast[layer, h].item() - w) <= 1e-5 * (1 + abs(w)), f"layer {layer} head {h}"


def test_a_batch_of_input_ids_that_already_ends_at_the_read_position_is_not_rolled(monkeypatch):
    """A tensor of input_ids read at T - 1 in every row: nothing to roll (info says so, the
    scan gets the tensor as given), and the last block is trimmed."""
    model = _lm("gpt2")
    clean, corrupted = _pairs(changed=(0,))
    fast, slow, info = _both(monkeypatch, model, clean["input_ids"], corrupted["input_ids"],
                             heads.AtPositions(_fn, [-1, -1]))
    assert info["aligned"] is False and info["aligned_reason"] == "" and info["last_block"], info
    _close(fast, slow, "gpt2, input_ids")


def _decision(model, clean, corrupted, metric, **kw) -> dict:
    info: dict = {}
    heads.patch_scan(model, clean, corrupted, metric, info=info, **kw)
    return info


def test_the_trim_is_declined_for_metrics_that_read_elsewhere(monkeypatch):
    model = _lm()
    clean, corrupted = _pairs()
    # the scan's decision, recorded where it is made: info omits it for a plain metric
    seen, real = [], _scan_state.ScanState.decide_last_block
    monkeypatch.setattr(_scan_state.ScanState, "decide_last_block", lambda self: seen.append(real(self)) or seen[-1])
    plain = _decision(model, clean, corrupted, lambda lg: _fn(lg[:, -1]))
    assert "last_block" not in plain and seen[0].startswith("the metric is a plain function"), (plain, seen)
    # two positions read (rows rolled apart would not help: positions= keeps them in place)
    several = _decision(model, clean, corrupted, heads.AtPositions(_fn, [7, 5]), positions=[8, 9, 10])
    assert not several["last_block"] and "reads positions [5, 7]" in several["last_block_reason"], several
    one_inside = _decision(model, clean, corrupted, heads.AtPositions(_fn, [8, 8]), positions=[8, 9, 10])
    assert not one_inside["last_block"] and "reads positions [8]" in one_inside["last_block_reason"], one_inside


def test_the_trim_is_declined_for_a_block_without_an_mlp_module():
    """BERT's layer has its feed-forward in `intermediate` / `output`, not an `mlp`: declined,
    and the table is the whole block's."""
    model = _mh("bert")
    clean, corrupted = _inputs("bert", 1), _inputs("bert", 2)
    info = _decision(model, clean, corrupted, _last())
    assert not info["last_block"] and "has no `mlp` module" in info["last_block_reason"], info


def test_the_trim_is_declined_when_its_check_fails(monkeypatch):
    """An MLP cut to the wrong position (simulated: the first instead of the last) makes the
    check on the corrupted run fail: declined with the difference, and the table exact."""
    model = _lm()
    clean, corrupted = _pairs()
    metric = heads.AtPositions(_fn, [-1, -1])
    monkeypatch.setattr(_scan, "_LAST_BLOCK", False)  # no public switch: the whole block's table to equal
    want = heads.patch_scan(model, clean, corrupted, metric)
    monkeypatch.setattr(_scan, "_LAST_BLOCK", True)  # and the trim on, whatever the default
    # faults injected into the trim's hooks: no model makes the real ones cut the wrong position or fail
    real = _top._last_position

    def first(module, args, kwargs):
        return (args[0][:, :1], *args[1:]), kwargs
    monkeypatch.setattr(_top, "_last_position", first)  # the wrong position, as said above
    info: dict = {}
    got = heads.patch_scan(model, clean, corrupted, metric, info=info)
    assert not info["last_block"] and "differs from the corrupted run's by" in info["last_block_reason"], info
    assert torch.equal(got, want)

    monkeypatch.setattr(_top, "_last_position", real)  # the real cut again, for the kernel's fault next

    def no_mask(module, args, kwargs):  # the last query alone, declined: the kernel runs every query
        raise ValueError("no mask of that kind")
    monkeypatch.setattr(_top, "_mask_last_query", no_mask)  # a kernel that takes no last-query mask
    info = {}
    got = heads.patch_scan(model, clean, corrupted, metric, info=info)
    assert info["last_block"] and info["last_block_reason"] == (
        "taken, but its attention kernel runs every query (with the last query alone: the corrupted run through "
        "the trimmed last block failed: ValueError: no mask of that kind)"), info
    assert (got - want).abs().max() <= 1e-6 * (1 + want.abs().max())

    def broken(module, args, kwargs):
        raise ValueError("no such input")
    monkeypatch.setattr(_top, "_last_position", broken)  # a cut that fails outright
    info = {}
    got = heads.patch_scan(model, clean, corrupted, metric, info=info)
    assert not info["last_block"] and info["last_block_reason"].startswith(
        "the corrupted run through the trimmed last block failed: ValueError: no such input"), info
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_the_last_query_projection_runs_one_position_and_the_others_every_position(name, monkeypatch):
    """The trimmed block's query projection (Llama's q_proj, GPT-2's fused c_attn: its query
    columns) runs at the last position; its keys and values, and every other layer's queries,
    at every position. Counted by the rows each projection is handed in the scan's forwards,
    and the table is the whole block's."""
    model = _lm(name)
    layers = model.model.layers if name == "llama" else model.transformer.h
    projection = [(blk.self_attn.q_proj if name == "llama" else blk.attn.c_attn) for blk in layers]
    ran: dict[int, set] = {}  # layer -> the positions its projection ran in forwards of variants (rows > B)

    def seen(i, m, a, out):
        if a[0].shape[0] > 2:
            ran.setdefault(i, set()).add(a[0].shape[1])
    hooks = [m.register_forward_hook(lambda m, a, out, i=i: seen(i, m, a, out)) for i, m in enumerate(projection)]
    metric = heads.AtPositions(_fn, [-1, -1])
    for changed, T in [((0, 6), 11), ((6,), 5)]:  # nothing shared; the prefix skip: positions 6-10 run
        clean, corrupted = _pairs(changed=changed)
        ran.clear()
        try:
            heads.patch_scan(model, clean, corrupted, metric)
        finally:
            for h in hooks if changed == (6,) else ():
                h.remove()
        # 1: the trimmed block; the first layer's queries may come from the corrupted run (the shortcut)
        assert ran[2] == {1} and ran[1] == {T} and ran.get(0, {T}) == {T}, ran
        fast, slow, info = _both(monkeypatch, model, clean, corrupted, metric)
        assert info["last_block"] and info["last_block_reason"] == "", info
        _close(fast, slow, f"{name} {changed}")
    if name == "gpt2":  # the fused projection's hooks by themselves: keys and values at every position
        x = torch.randn(2, 7, 32)
        q, c_attn = _top.query_projection(layers[-1].attn), projection[-1]
        with torch.no_grad():
            want, got = c_attn(x), q.post(c_attn, (), c_attn(*q.pre(c_attn, (x,), {})[0]))
        assert got.shape == want.shape and torch.equal(got[:, :, :32], got[:, -1:, :32].expand(2, 7, 32))
        # a product of fewer rows or columns may round differently: within a few float32 roundings
        torch.testing.assert_close(got[..., 32:], want[..., 32:], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got[:, -1], want[:, -1], rtol=1e-6, atol=1e-6)


def test_a_query_projection_that_cannot_run_at_the_last_position_alone_runs_every_position(monkeypatch):
    """A query cut the check refuses (simulated: the widened queries wrong, then a projection
    that fails) leaves the projection at every position and the rest of the trim taken, with
    the reason; the table is the whole block's."""
    model = _lm()
    clean, corrupted = _pairs()
    metric = heads.AtPositions(_fn, [-1, -1])
    real = _top.QueryAtLast.post
    for fault, says in [(lambda self, m, a, out: 2 * real(self, m, a, out), "differs from the corrupted run's by"),
                        (lambda self, m, a, out: out, "failed: RuntimeError")]:  # one position: the reshape fails
        monkeypatch.setattr(_top.QueryAtLast, "post", fault)
        fast, slow, info = _both(monkeypatch, model, clean, corrupted, metric)
        reason = info["last_block_reason"]
        assert info["last_block"] and reason.startswith("taken, but its query projection runs every position (with "
                                                        "the last query alone: the ") and says in reason, info
        _close(fast, slow, reason)
    monkeypatch.setattr(_top.QueryAtLast, "post", real)
    assert _top.query_projection(model.model.layers[0].self_attn) is not None
    assert _top.query_projection(_mh("phi3").layers[0].self_attn) is None  # q, k, v fused: left whole


@pytest.mark.slow
def test_smollm2_ioi_scan_through_the_trimmed_last_block(smollm2, monkeypatch):
    """GQA 9/3 on the real model: tasks.ioi's metric (rows rolled to end at the read position
    where that helps, the prefix skipped), the table with the trim equal to the whole block's, and
    one by-hand patched forward of a head of the last layer.

    The claim is exactness (the trim changes which positions run, not what they compute), so
    it runs in float64: in float32 the two paths sum 30 layers in different orders and differ
    by a few float32 roundings of the table's scale, a figure that depends on the CPU's
    kernels (3.8e-6 of 3.6 on an AMD EPYC). In float64 the reordering is about 1e-15 of the
    scale, and what is left is the table's own rounding: patch_scan returns float32, so two
    float64 results that agree to 1e-15 can still land on neighbouring float32 values, one
    float32 spacing (at most eps32 x the entry) apart. A head patched at a wrong position moves
    its entry by 1e-3 or more."""
    from multihead.heads.tasks import ioi

    model = smollm2.copy().model.double()
    task = ioi(2, seed=0, tokenizer=smollm2.tokenizer)
    fast, slow, info = _both(monkeypatch, model, task.clean, task.corrupted, task.metric)
    assert info["last_block"] and info["skipped"], info
    eps32 = torch.finfo(torch.float32).eps
    _close(fast, slow, "smollm2 ioi (float64, the table float32)", rel=eps32)
    last = fast.shape[0] - 1
    cells = [(last, 0), (last - 1, 4)]
    for (layer, h), w in zip(cells, _by_hand(model, task.clean, task.corrupted, task.metric, cells)):
        assert abs(fast[layer, h].item() - w) <= eps32 * (1 + abs(w)), f"layer {layer} head {h}: {fast[layer, h]} {w}"


@pytest.mark.parametrize("name", ["bart", "t5"])
def test_encoder_decoders_are_declined_with_the_reason(name):
    """The decoder's length is not the inputs' (T cannot be read off them): declined."""
    info = _decision(_mh(name), _inputs(name, 1), _inputs(name, 2), _last())
    assert not info["last_block"] and info["last_block_reason"] == "the inputs' positions cannot be read off them"


def test_multihead_modules_are_declined_with_the_reason():
    """A lab model (multihead's own Attention): its heads' outputs are read at the output
    projection's input, which the trim would cut; declined, the table the whole block's."""
    from multihead.decoder import LabConfig, LabTransformer

    torch.manual_seed(0)
    model = LabTransformer(LabConfig(vocab_size=50, max_len=16, n_layers=2, n_heads=4)).eval()
    g = torch.Generator().manual_seed(1)
    clean, corrupted = torch.randint(0, 50, (3, 10), generator=g), torch.randint(0, 50, (3, 10), generator=g)
    info = _decision(model, clean, corrupted, _last(3))
    assert not info["last_block"] and info["last_block_reason"] == \
        "not a transformers model on multihead's attention function", info


def _w_shared(rank: int, world: int) -> dict:
    """Each rank's tables as NumPy arrays, pickled by value: a tensor put on the result queue
    travels as a file descriptor that the rank's process hands out only while it lives, so a
    rank that exits before the test reads its result fails it (EOFError, or its socket gone)."""
    import torch.distributed as dist

    model = _lm("gpt2")
    out = {}
    for changed in [(0, 6), (6,)]:
        clean, corrupted = _pairs(changed=changed)
        info: dict = {}
        shared = heads.patch_scan(model, clean, corrupted, heads.AtPositions(_fn, [-1, -1]), info=info,
                                  group=dist.group.WORLD)
        out[changed] = (shared.numpy(), info)
    return out


@pytest.mark.distributed
def test_ranks_share_a_trimmed_scan_and_return_the_one_process_table():
    """Two gloo ranks (`group=`): each decides the trim the same way and the table is
    bitwise the one process's."""
    import dist_helpers

    results = dist_helpers.run_world(_w_shared, 2, timeout=90.0, pg_timeout=30)
    model = _lm("gpt2")
    for changed in [(0, 6), (6,)]:
        clean, corrupted = _pairs(changed=changed)
        info: dict = {}
        single = heads.patch_scan(model, clean, corrupted, heads.AtPositions(_fn, [-1, -1]), info=info)
        assert info["last_block"], info
        for rank in results:
            shared, shared_info = torch.from_numpy(rank[changed][0]), rank[changed][1]
            assert shared_info == info and torch.equal(shared.nan_to_num(), single.nan_to_num()), (changed, info)
