"""Block-sparse execution: no (T, S) tensor for a predicate mask (peak memory at N = 16384,
forward and backward), the tile choice, and the engines against each other."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import multihead as mh
from conftest import assert_close
from multihead import masks
from multihead.kernels import common, fused_tiles, planner

N = 16384
TS_BOOL_MIB = N * N / 2**20  # one (T, S) bool mask: 256 MiB

_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    torch.set_num_threads(1)
    import multihead as mh
    from multihead import masks, score_mods
    N = {N}
    q, k, v = (torch.randn(1, 1, N, 16, requires_grad=True) for _ in range(3))
    cases = {{
        "window": lambda: mh.scaled_dot_product_attention(q, k, v, masks.sliding_window(256) & masks.causal()),
        "document": lambda: mh.scaled_dot_product_attention(
            q, k, v, masks.document(torch.arange(N) // 2048) & masks.causal()),
        "flex_callable": lambda: mh.scaled_dot_product_attention(
            q, k, v, lambda b, h, qi, kv: (kv <= qi) & (qi - kv < 256)),
        "softcap_dropout_tiles": lambda: mh.scaled_dot_product_attention(
            q, k, v, masks.sliding_window(256), score_mod=score_mods.softcap(20.0), dropout_p=0.1),
        "control_dense_mask": lambda: masks.to_dense(masks.causal(), 1, 1, N, N).sum() * q.sum(),
    }}

    def rss_kib(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field))

    cases["window"]().sum()  # warm up: imports, allocator, thread pool
    peaks = {{}}
    for name in sys.argv[1:]:
        q.grad = k.grad = v.grad = None
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak resident set size (VmHWM) to the current one
        base = rss_kib("VmRSS:")
        out = cases[name]()
        out.square().sum().backward()
        del out
        peaks[name] = (rss_kib("VmHWM:") - base) / 1024
    print(json.dumps(peaks))
""").format(N=N)


def _peaks_mib(*cases: str) -> dict:
    """Each case's peak RSS growth in a fresh process. glibc's mmap threshold is fixed at its
    default 128 KiB there: left dynamic, it rises after the first large frees, and the many
    1 MiB temporaries of a tile classification then come from the heap, which keeps freed
    memory: the peak read 0.5 to 154 MiB from run to run for the same calls, none of it a
    (T, S) tensor. Fixed, a freed block of 128 KiB or more goes back at once, and the peak is
    that of what is alive (5-8 MiB for the predicate cases, 256 MiB for the dense control)."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS between cases")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    run = subprocess.run([sys.executable, "-c", _SCRIPT, *cases], capture_output=True, text=True, timeout=300,
                         env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _check_peaks(peaks: dict) -> None:
    for case, peak in peaks.items():
        assert peak < 128, f"{case}: peak grew by {peak:.0f} MiB (one (T, S) bool mask is {TS_BOOL_MIB:.0f} MiB)"


def test_predicate_masks_never_allocate_t_by_s():
    """Peak RSS growth of forward + backward at N = 16384 stays below half of one (T, S) bool
    mask (256 MiB; a float one is 1 GiB)."""
    _check_peaks(_peaks_mib("window"))


@pytest.mark.slow
def test_the_memory_probe_sees_a_t_by_s_mask():
    """The control: building one (T, S) bool mask shows up in the probe."""
    assert _peaks_mib("control_dense_mask")["control_dense_mask"] > TS_BOOL_MIB * 0.9


@pytest.mark.slow
def test_generic_predicates_and_tiles_never_allocate_t_by_s():
    """The same for a plain flex callable (tiles classified patch by patch) and for the explicit
    tile engine with softcap and dropout (backward recomputes tiles from the log-sum-exp)."""
    _check_peaks(_peaks_mib("document", "flex_callable", "softcap_dropout_tiles"))


def test_tile_choice_follows_the_mask():
    """Local masks get short query blocks; causal is one causal square, documents one each."""
    def chosen(pred, T=4096, G=1):
        return planner.choose_tile(pred, 1, 8, T, T, G, None, "cpu")[0]

    def squares(pred, T=4096):
        return planner.choose_tile(pred, 1, 8, T, T, 1, None, "cpu")[4]

    assert chosen(masks.sliding_window(128) & masks.causal()) <= 128
    assert squares(masks.causal()) == {0: 4096}
    assert squares(masks.document(torch.arange(4096) // 2048) & masks.causal()) == {0: 2048, 2048: 4096}
    lengths = torch.tensor([1000, 1500, 1, 1595])  # packed documents off the tile edges: one square each
    assert squares(masks.document(torch.repeat_interleave(torch.arange(4), lengths)) & masks.causal()) == \
        {0: 1000, 1000: 2500, 2500: 2501, 2501: 4096}
    assert squares(masks.document(torch.arange(4096) // 16) & masks.causal()) == {}  # short ones: tiles
    assert chosen(masks.from_flex(lambda b, h, q, kv: kv <= q)) == 128  # generic: planned once, fixed tile


@pytest.mark.parametrize("tile", [None, 5, 16])
@pytest.mark.parametrize("G", [1, 3])
def test_fused_engines_agree_in_float64(tile, G, monkeypatch):
    """The log-sum-exp CPU engine (D == Dv), the public one (D != Dv) and the explicit tiles."""
    monkeypatch.setattr(fused_tiles, "FUSED_TILE", tile)  # small tiles: many blocks at these test sizes
    B, Hkv, T, S = 2, 2, 40, 47
    mod = masks.prefix_lm(torch.tensor([10, 0])) | masks.sliding_window(9) & masks.document(
        torch.tensor([[0] * 20 + [1] * 27, [0] * 47]))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, G * Hkv, T, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Hkv, S, 8, generator=g, dtype=torch.float64, requires_grad=True)
    for Dv in (8, 3):
        v = torch.randn(B, Hkv, S, Dv, generator=g, dtype=torch.float64, requires_grad=True)
        results = {}
        for backend in ("math", "sdpa", "tiles"):
            out = mh.scaled_dot_product_attention(q, k, v, mod, backend=backend)
            results[backend] = (out, *torch.autograd.grad(out.square().sum(), (q, k, v)))
        for backend in ("sdpa", "tiles"):
            for name, a, b in zip(["out", "dq", "dk", "dv"], results["math"], results[backend]):
                assert_close(b, a, what=f"{backend} {name} tile={tile} G={G} Dv={Dv}")


@pytest.mark.parametrize("pred, squares", [
    (masks.causal(), {0: 64}),
    (masks.causal() & masks.causal(), {0: 64}),
    (masks.document(torch.arange(64) // 16) & masks.causal(), {0: 16, 16: 32, 32: 48, 48: 64}),
    (masks.local_chunks(16) & masks.causal(), {0: 16, 16: 32, 32: 48, 48: 64}),
    (masks.document(torch.arange(64) // 12) & masks.causal(),  # documents: wherever they start
     {0: 12, 12: 24, 24: 36, 36: 48, 48: 60, 60: 64}),
    (masks.local_chunks(12) & masks.causal(), {0: 8, 24: 32, 48: 56}),  # chunks: on tile edges only
    (masks.sliding_window(20) & masks.causal(), {0: 16}),  # rows 0..15 see all keys before them
    (masks.sliding_window(4) & masks.causal(), {}),  # narrower than a tile: the diagonal is a band
    (masks.padding(torch.tensor([30, 64])) & masks.causal(), {0: 24}),  # batch 0's keys 30.. are hidden
    (masks.document(torch.arange(64) // 12), {}),  # documents without causal: bidirectional
    (masks.prefix_lm(10), {}),  # bidirectional prefix
    (masks.from_flex(lambda b, h, q, kv: kv <= q), {}),  # a generic predicate is not analysed
])
def test_causal_squares(pred, squares, monkeypatch):
    """Rows that attend exactly causally among themselves (8 x 8 tiles of 8; documents of 12
    found as such, with documents of 4 or more rows running as squares here)."""
    monkeypatch.setattr(planner, "_MIN_SEGMENT", 4)  # squares of a few rows count at these test sizes
    bq, bk, kept, full, found = planner.choose_tile(pred, 2, 4, 64, 64, 1, 8, "cpu")
    assert found == squares
    for a, e in found.items():  # against the dense mask: rows a..e see exactly keys a..row
        dense = masks.to_dense(pred, 2, 4, 64, 64)[:, :, a:e]
        rows = torch.arange(a, e)[:, None]
        assert torch.equal(dense, ((torch.arange(64) >= a) & (torch.arange(64) <= rows)).expand_as(dense))


def test_public_engine_runs_squares_as_causal_calls_where_memory_allows(monkeypatch):
    """The public-sdpa engine (GPU, dropout, D != Dv) makes one causal call per square only where
    torch's kernels are O(N) in memory (not the CPU, not GQA); forced here on the CPU, its
    squares equal the math path (documents off the tile edges, D != Dv)."""
    q, k = torch.randn(1, 4, 64, 16), torch.randn(1, 4, 64, 16)
    # the engine's rule for where squares run as causal calls, read directly: its GPU case cannot run here
    public_squares = fused_tiles._public_squares
    assert not public_squares(q, k)
    assert not public_squares(q.to("meta"), k[:, :2].to("meta"))
    assert public_squares(q.to("meta"), k.to("meta"))
    monkeypatch.setattr(fused_tiles, "_public_squares", lambda q, k: True)  # forced on the CPU, as said above
    monkeypatch.setattr(planner, "_MIN_SEGMENT", 4)  # squares of a few rows count at these test sizes
    calls = []
    real = fused_tiles.F.scaled_dot_product_attention

    def spy(*args, **kw):
        calls.append(kw.get("is_causal", False))
        return real(*args, **kw)

    monkeypatch.setattr(fused_tiles.F, "scaled_dot_product_attention", spy)  # counts the causal calls
    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(2, 4, 64, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 4, 64, 5, generator=g, dtype=torch.float64, requires_grad=True)
    pred = masks.document(torch.arange(64) // 20) & masks.causal()
    got = mh.scaled_dot_product_attention(q, k, v, pred)
    assert calls == [True] * 4  # documents of 20, 20, 20, 4
    want = mh.scaled_dot_product_attention(q, k, v, pred, backend="math")
    for name, a, b in zip(["out", "dq", "dk", "dv"], (got, *torch.autograd.grad(got.square().sum(), (q, k, v))),
                          (want, *torch.autograd.grad(want.square().sum(), (q, k, v)))):
        assert_close(a, b, what=name)


@pytest.mark.parametrize("Hkv", [4, 2, 1])
@pytest.mark.parametrize("T", [37, 64])
def test_causal_squares_equal_the_math_path(Hkv, T, monkeypatch):
    """Causal squares run as one causal call each (GQA: K/V heads as the batch, a stride-0 view
    for their query heads; equal squares folded into the heads): outputs and gradients equal the
    math path's in float64."""
    monkeypatch.setattr(fused_tiles, "FUSED_TILE", 8)  # small tiles: many blocks at these test sizes
    monkeypatch.setattr(planner, "_MIN_SEGMENT", 4)  # squares of a few rows count at these test sizes
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, T, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, Hkv, T, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    if Hkv == 4:  # heads interleaved in memory, (B, T, H, D) transposed: no folding of squares into heads
        q = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    for pred in (masks.causal(), masks.document(torch.arange(T) // 16) & masks.causal(),
                 masks.sliding_window(20) & masks.causal(), masks.document(torch.arange(T) // 13) & masks.causal()):
        assert planner.choose_tile(pred, 2, 4, T, T, 4 // Hkv, 8, "cpu")[4]  # squares in the plan
        for vv in (v, v[..., :5]):  # Dv != D: the public-sdpa engine (squares as pieces on the CPU)
            got = mh.scaled_dot_product_attention(q, k, vv, pred)
            want = mh.scaled_dot_product_attention(q, k, vv, pred, backend="math")
            for name, a, b in zip(["out", "dq", "dk", "dv"],
                                  (got, *torch.autograd.grad(got.square().sum(), (q, k, v))),
                                  (want, *torch.autograd.grad(want.square().sum(), (q, k, v)))):
                assert_close(a, b, what=f"{pred.name} {name} Hkv={Hkv} T={T} Dv={vv.shape[-1]}")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=6),
       heads=st.sampled_from([(4, 4), (4, 2), (4, 1)]), tile=st.sampled_from([None, 4, 8]),
       dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]), batch_ids=st.booleans(),
       seed=st.integers(0, 2**16))
def test_document_squares_equal_the_reference(lengths, heads, tile, dtype, batch_ids, seed, monkeypatch):
    """Packed documents of any lengths & causal (one causal call per document, or tiles when the
    planner declines): output and gradients against the math path in float64."""
    monkeypatch.setattr(planner, "_MIN_SEGMENT", 1)  # squares of a few rows count at these test sizes
    monkeypatch.setattr(fused_tiles, "FUSED_TILE", tile)  # small tiles: many blocks at these test sizes
    H, Hkv = heads
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    T = ids.numel()
    pred = masks.document(torch.stack([ids, ids]) if batch_ids else ids) & masks.causal()
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, H, T, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, Hkv, T, 8, generator=g, dtype=torch.float64) for _ in range(2))
    q, k, v = (x.to(dtype).requires_grad_() for x in (q, k, v))
    got = mh.scaled_dot_product_attention(q, k, v, pred)
    g_out = torch.linspace(-1, 1, got.numel(), dtype=torch.float64).view_as(got)
    grads = torch.autograd.grad(got, (q, k, v), g_out.to(dtype))
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = mh.scaled_dot_product_attention(q64, k64, v64, pred, backend="math")
    want_grads = torch.autograd.grad(want, (q64, k64, v64), g_out)
    assert_close(got, want, dtype, what=f"out {lengths} {heads} {dtype}")
    for n, a, b in zip("qkv", grads, want_grads):
        assert_close(a, b, dtype, what=f"d{n} {lengths} {heads} {dtype}")


def _spy_flash_calls(monkeypatch):
    """(q shape, k shape, causal, mask shape) of every call of the CPU flash kernel, forward and backward."""
    seen = []
    for name in ("flash_lse", "flash_lse_backward"):
        real = getattr(fused_tiles, name)

        def spy(*args, real=real, name=name, **kw):
            q, k = args[:2] if name == "flash_lse" else args[1:3]
            mask = None if kw.get("mask") is None else tuple(kw["mask"].shape)
            seen.append((name, tuple(q.shape), tuple(k.shape), kw["causal"], mask))
            return real(*args, **kw)

        monkeypatch.setattr(fused_tiles, name, spy)  # records each kernel call: how the engine cut the work
    return seen


@pytest.mark.skipif(not common.HAS_CPU_FLASH, reason="needs torch's CPU flash kernel (log-sum-exp pieces)")
def test_alike_blocks_of_a_window_run_as_one_band_call(monkeypatch):
    """sliding_window(4) & causal, T = S = 64, tiles of 8: block 0 alone, blocks 1..7 (each
    keys r0 - 8 .. r0 + 8) as one call with the 7 blocks as the kernel's heads; the backward block by block."""
    monkeypatch.setattr(fused_tiles, "FUSED_TILE", 8)  # small tiles: many blocks at these test sizes
    seen = _spy_flash_calls(monkeypatch)
    q, k, v = (torch.randn(1, 2, 64, 4, requires_grad=True) for _ in range(3))
    out = mh.scaled_dot_product_attention(q, k, v, masks.sliding_window(4) & masks.causal())
    out.sum().backward()
    assert [s for s in seen if s[1][1] == 7] == [("flash_lse", (2, 7, 8, 4), (2, 7, 16, 4), False, (1, 1, 8, 16))]
    assert len(seen) == 2 + 8, seen  # forward: block 0 and the band; backward: the 8 blocks


def _layout(x, bthd):
    """The same values with heads interleaved in memory, (B, T, H, D) transposed, as projections give them."""
    return x.transpose(1, 2).contiguous().transpose(1, 2) if bthd else x


@pytest.mark.skipif(not common.HAS_CPU_FLASH, reason="needs torch's CPU flash kernel (log-sum-exp pieces)")
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("bthd", [False, True])
@pytest.mark.parametrize("pieces", ["one call", "pieces"])
def test_bands_equal_the_math_path(heads, bthd, pieces, monkeypatch):
    """Bands (blocks in the kernel's batch, GQA group positions one call each, the batch folded or
    one call per b): outputs and gradients equal the math path in float64, for windows narrower
    and wider than a tile, more keys than queries, and (`pieces`) bands of several pieces merged by
    log-sum-exp (partial, full, the causal diagonal)."""
    monkeypatch.setattr(fused_tiles, "FUSED_TILE", 8)  # small tiles: many blocks at these test sizes
    if pieces == "pieces":
        monkeypatch.setattr(fused_tiles, "_ONE_CALL_SPAN", 0)  # forces bands of several pieces at these sizes
    seen = _spy_flash_calls(monkeypatch)
    H, Hkv = heads
    g = torch.Generator().manual_seed(3)
    for T, S, window in ((64, 64, 4), (80, 80, 21), (48, 75, 13)):
        q = _layout(torch.randn(2, H, T, 16, generator=g, dtype=torch.float64), bthd).requires_grad_()
        k, v = (_layout(torch.randn(2, Hkv, S, 16, generator=g, dtype=torch.float64), bthd).requires_grad_()
                for _ in range(2))
        pred = masks.sliding_window(window) & masks.causal()
        seen.clear()
        got = mh.scaled_dot_product_attention(q, k, v, pred)
        g_out = torch.linspace(-1, 1, got.numel(), dtype=torch.float64).view_as(got)
        grads = torch.autograd.grad(got, (q, k, v), g_out)
        assert any(s[1][1] > 4 for s in seen), seen  # a band ran (blocks as the kernel's heads)
        want = mh.scaled_dot_product_attention(q, k, v, pred, backend="math")
        want_grads = torch.autograd.grad(want, (q, k, v), g_out)
        for name, a, b in zip(["out", "dq", "dk", "dv"], (got, *grads), (want, *want_grads)):
            assert_close(a, b, what=f"{name} T={T} S={S} window={window} heads={heads} bthd={bthd}")
        if pieces == "pieces" and window > 8 and T == S:
            assert any(s[3] for s in seen if s[1][1] > 4), seen  # the diagonal piece through the causal kernel


@pytest.mark.skipif(not common.HAS_CPU_FLASH, reason="needs torch's CPU flash kernel (log-sum-exp pieces)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bands_in_low_precision_and_a_broadcast_gradient(dtype, monkeypatch):
    """float32 and bfloat16 against float64's math path; out.sum()'s gradient is a stride-0 view."""
    monkeypatch.setattr(fused_tiles, "FUSED_TILE", 16)  # small tiles: many blocks at these test sizes
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 4, 96, 32, generator=g, dtype=torch.float64) for _ in range(3))
    pred = masks.sliding_window(24) & masks.causal()
    xs = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    got = mh.scaled_dot_product_attention(*xs, pred)
    grads = torch.autograd.grad(got.sum(), xs)
    x64 = [x.requires_grad_() for x in (q, k, v)]
    want = mh.scaled_dot_product_attention(*x64, pred, backend="math")
    want_grads = torch.autograd.grad(want.sum(), x64)
    for name, a, b in zip(["out", "dq", "dk", "dv"], (got, *grads), (want, *want_grads)):
        assert_close(a, b, dtype, what=f"{name} {dtype}")


def test_band_rows_are_blocks_shifted_by_one_tile():
    """A window's rows past its start keep the tiles of the row before, shifted: bands (row 4 is
    the first whose window has left tile 0); causal's rows do not (each keeps one tile more), nor
    does a short last block."""
    w = masks.sliding_window(20) & masks.causal()
    kept, full = planner.tile_plan(w, 1, 1, 64, 64, 8, 8, "cpu")
    assert planner.band_rows(kept, full, 64, 8).tolist() == [False, False, False, False, True, True, True, True]
    kept, full = planner.tile_plan(w, 1, 1, 60, 60, 8, 8, "cpu")
    assert planner.band_rows(kept, full, 60, 8).tolist() == [False, False, False, False, True, True, True, False]
    kept, full = planner.tile_plan(masks.causal(), 1, 1, 64, 64, 8, 8, "cpu")
    assert not planner.band_rows(kept, full, 64, 8).any()


@settings(max_examples=150, deadline=None)
@given(T=st.integers(1, 70), S=st.integers(1, 70), bq=st.integers(1, 17), square=st.booleans(),
       bk=st.integers(1, 17), window=st.integers(1, 40), which=st.sampled_from(["causal", "window", "and", "or"]))
def test_relative_plan_equals_the_dense_mask(T, S, bq, square, bk, window, which):
    """The plan of a function of q - kv (one pass over the differences, square tiles laid out
    from one vector) keeps exactly the tiles with an allowed pair and fills exactly the tiles
    whose every pair is allowed, short last row and column included."""
    bk = bq if square else bk
    pred = {"causal": masks.causal(), "window": masks.sliding_window(window),
            "and": masks.sliding_window(window) & masks.causal(),
            "or": masks.causal() | masks.sliding_window(window)}[which]
    assert pred.relative
    kept, full = planner.tile_plan(pred, 2, 3, T, S, bq, bk, "cpu")
    dense = masks.to_dense(pred, 1, 1, T, S)[0, 0]
    nq, nk = -(-T // bq), -(-S // bk)
    pad = torch.zeros(nq * bq, nk * bk, dtype=torch.int8)
    pad[:T, :S] = dense.to(torch.int8)
    real = torch.zeros_like(pad)
    real[:T, :S] = 1
    tiles = pad.view(nq, bq, nk, bk).sum((1, 3))  # allowed pairs per tile
    size = real.view(nq, bq, nk, bk).sum((1, 3))  # pairs per tile (short at the edges)
    assert torch.equal(kept, tiles > 0), (kept.int(), tiles)
    assert torch.equal(full, tiles == size), (full.int(), tiles, size)


@pytest.mark.skipif(not common.HAS_CPU_FLASH, reason="needs torch's CPU flash kernel (log-sum-exp pieces)")
def test_planned_band_forward_and_replanned_backward_equal_the_math_path(monkeypatch):
    """The engine's own tile choice (none fixed): the forward runs a band, the backward its own
    plan block by block; outputs and gradients equal the math path in float64."""
    seen = _spy_flash_calls(monkeypatch)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 1024, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    pred = masks.sliding_window(100) & masks.causal()
    got = mh.scaled_dot_product_attention(q, k, v, pred)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    forward = [s for s in seen if s[0] == "flash_lse"]
    backward = [s for s in seen if s[0] == "flash_lse_backward"]
    assert any(s[1][1] > 2 for s in forward) and all(s[1][1] <= 2 for s in backward), seen
    want = mh.scaled_dot_product_attention(q, k, v, pred, backend="math")
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    for name, a, b in zip(["out", "dq", "dk", "dv"], (got, *grads), (want, *want_grads)):
        assert_close(a, b, what=name)
