"""The caches' buffers on huge pages: a buffer of two huge pages or more is advised
MADV_HUGEPAGE over its aligned interior before it is written (the kernel's VmFlags for the
mapping say `hg`), a small one is not (a spy on madvise says so), and either way the buffer
is zeros of the shape and dtype asked, and the cache's decode equals the NumPy reference."""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import assert_close
from multihead import reference as R
from multihead.cache import KVCache, LatentCache, _zeros
from multihead.functional import attend

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc/self/smaps are Linux's")


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@linux
def test_a_large_buffer_is_advised_huge_pages_and_is_zeros():
    t = _zeros((2, 4, 4096, 64), torch.float32, None)  # 8 MiB
    assert t.shape == (2, 4, 4096, 64) and t.dtype == torch.float32 and not t.any()
    middle = t.data_ptr() + t.numel() * t.element_size() // 2
    assert "hg" in _vm_flags(middle)


@linux
def test_a_small_buffer_is_left_to_torch(monkeypatch):
    """No advice for a small buffer, seen by a spy on libc's madvise. Its mapping's VmFlags
    cannot say it: the allocator may hand it memory of the heap that a large buffer, advised
    earlier in the same process and since freed, left `hg`."""
    import multihead.cache as cache_module

    calls = []

    class Libc:
        def madvise(self, *args):
            calls.append(args)
            return 0

    monkeypatch.setattr(cache_module.ctypes, "CDLL", lambda name: Libc())
    t = _zeros((1, 2, 64, 16), torch.float64, None)  # 16 KiB: on the allocator's pages
    assert t.dtype == torch.float64 and not t.any() and calls == []
    _zeros((2, 4, 4096, 64), torch.float32, None)  # 8 MiB: the spy sees a large buffer's advice
    assert len(calls) == 1


@linux
def test_the_caches_take_their_buffers_from_it():
    kv = KVCache(1, 8, 16384, 64)  # 4 MiB each for K and V
    for buf in (kv.k, kv.v):
        assert "hg" in _vm_flags(buf.data_ptr() + buf.numel() * buf.element_size() // 2)
    lat = LatentCache(1, 8192, 128, 64)  # 6 MiB
    assert "hg" in _vm_flags(lat.buf.data_ptr() + lat.buf.numel() * lat.buf.element_size() // 2)


def test_a_decode_over_a_large_cache_equals_the_reference():
    g = torch.Generator().manual_seed(0)
    cache = KVCache(1, 2, 20000, 32)  # 5 MiB per buffer
    k, v = torch.randn(1, 2, 19999, 32, generator=g), torch.randn(1, 2, 19999, 32, generator=g)
    cache.update(k, v)
    q = torch.randn(1, 8, 1, 32, generator=g)
    k_all, v_all = cache.update(torch.randn(1, 2, 1, 32, generator=g), torch.randn(1, 2, 1, 32, generator=g))
    out, _ = attend(q, k_all, v_all)
    want = R.attention(q.double().numpy(), k_all.double().numpy(), v_all.double().numpy())
    assert_close(out, torch.from_numpy(want), torch.float32, what="decode over a huge-page cache")
