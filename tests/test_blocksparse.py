"""Block-sparse execution: no (T, S) tensor for a predicate mask (peak memory at N = 16384,
forward and backward), the tile choice, and the engines against each other."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import multihead as mh
from conftest import assert_close
from multihead import blocksparse, masks

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
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS between cases")
    run = subprocess.run([sys.executable, "-c", _SCRIPT, *cases], capture_output=True, text=True, timeout=300)
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
    """Local masks get short query blocks, causal and long documents get long ones."""
    def chosen(pred, T=4096, G=1):
        return blocksparse._choose_tile(pred, 1, 8, T, T, G, None, "cpu")[0]

    assert chosen(masks.sliding_window(128) & masks.causal()) <= 128
    assert chosen(masks.causal()) >= 512
    assert chosen(masks.document(torch.arange(4096) // 2048) & masks.causal()) >= 256
    assert chosen(masks.from_flex(lambda b, h, q, kv: kv <= q)) == 128  # generic: planned once, fixed tile


@pytest.mark.parametrize("tile", [None, 5, 16])
@pytest.mark.parametrize("G", [1, 3])
def test_fused_engines_agree_in_float64(tile, G, monkeypatch):
    """The log-sum-exp CPU engine (D == Dv), the public one (D != Dv) and the explicit tiles."""
    monkeypatch.setattr(blocksparse, "FUSED_TILE", tile)
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
