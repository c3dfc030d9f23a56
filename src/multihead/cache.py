"""KV caches: static, preallocated buffers for decoding (the gpt-fast design).

`KVCache` holds keys `(B, Hkv, S_max, D)` and values `(B, Hkv, S_max, Dv)`: Hkv heads,
not H, which is the whole point of GQA and MQA. `LatentCache` holds MLA's compressed
latent `(B, S_max, R + rope_dim)` instead. Each kind has one write method, `update`: it
writes the new tokens at the current length and returns views of everything cached so
far; a cross-attention context is held by `hold_context`, once, in an empty cache.

Details: docs/kernel.md, "KV caches: the compiled path and the state rules".
"""

from __future__ import annotations

import copy
import ctypes
import sys

import torch
from torch import Tensor

from multihead.checks import check_nonnegative_int, check_positive_int

__all__ = ["CacheMark", "KVCache", "LatentCache", "RollingKVCache"]

_HUGE = 2 << 20  # one huge page of x86-64 and arm64 Linux
_MADV_HUGEPAGE = 14


def _zeros(shape: tuple, dtype: torch.dtype, device) -> Tensor:
    """A zeroed cache buffer. On Linux CPUs, a buffer of a few huge pages or more is asked for
    huge pages (madvise MADV_HUGEPAGE over its 2 MiB-aligned interior, before it is first
    written): a long decode step streams the whole cache, and on 4 KiB pages its reads miss
    the TLB every 4 KiB, which a kernel that gives huge pages only where asked ("madvise")
    leaves as it is (measured: docs/kernel.md, "KV caches"). Where the kernel says no, or
    gives them anyway, nothing changes; the values are zeros either way."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.is_cpu and sys.platform.startswith("linux") and t.numel() * t.element_size() >= 2 * _HUGE:
        start = t.data_ptr()
        lo = -(-start // _HUGE) * _HUGE
        hi = (start + t.numel() * t.element_size()) // _HUGE * _HUGE
        if hi > lo:
            try:
                ctypes.CDLL(None).madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_HUGEPAGE)
            except (OSError, AttributeError):
                pass  # no libc madvise: 4 KiB pages, as torch would give
    return t.zero_()


class CacheMark:
    """What `restore` needs to undo a write (from `checkpoint`); as a context manager, the
    block's writes are undone if the block raises, and kept otherwise."""

    __slots__ = ("cache", "state")

    def __init__(self, cache: _StaticCache, state: tuple):
        self.cache, self.state = cache, state

    def __enter__(self) -> CacheMark:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            self.cache.restore(self)
        return False  # the error propagates


class _StaticCache:
    """Shared bookkeeping: a length within a fixed capacity along dim `seq_dim`."""

    _seq_dim: int
    _buffers: tuple[str, ...]  # attribute names of the cache tensors
    _rolling = False  # slots are reused round-robin (no overflow)

    def __init__(self, max_len: int, device=None):
        self.max_len = max_len
        self.position = torch.zeros((), dtype=torch.long, device=device)  # tokens cached so far
        self._len: int | None = 0  # the same on the host; None after compiled steps

    @property
    def batch_size(self) -> int:
        return getattr(self, self._buffers[0]).shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return getattr(self, self._buffers[0]).dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the preallocated buffers: 2 * B * Hkv * S_max * D * itemsize for k and v
        of D == Dv, B * S_max * (kv_rank + rope_dim) * itemsize for the latent."""
        return sum(getattr(self, name).nbytes for name in self._buffers)

    @property
    def length(self) -> int:
        """Tokens cached so far."""
        if self._len is None:  # compiled steps advanced the tensor only: sync once
            self._len = int(self.position)
        return self._len

    def _advance_to(self, end: int) -> None:
        self.position.fill_(end)
        self._len = end

    def reset(self) -> None:
        """Forget every cached token (the buffers are kept and reused) and any autograd
        graph that previous writes attached to them."""
        for name in self._buffers:
            setattr(self, name, getattr(self, name).detach())
        self.position.zero_()
        self._len = 0

    def checkpoint(self, n_new: int) -> CacheMark:
        """A mark to undo writing `n_new` tokens: the length and the slots those tokens will
        overwrite (copies of at most `n_new` tokens per buffer). `with cache.checkpoint(n):`
        restores it if the block raises; `cache.restore(mark)` restores it at any time."""
        return CacheMark(self, self._state(n_new))

    def _state(self, n_new: int) -> tuple:
        start = self.length
        slots = self._slots(start, n_new)
        saved = tuple(getattr(self, name).index_select(self._seq_dim, slots).detach().clone()
                      for name in self._buffers)
        return start, slots, saved

    def restore(self, mark: CacheMark) -> None:
        """Put back the length and the contents saved by `checkpoint`."""
        self._put_back(mark.state)

    def _put_back(self, state: tuple) -> None:
        start, slots, saved = state
        with torch.no_grad():
            for name, old in zip(self._buffers, saved):
                getattr(self, name).index_copy_(self._seq_dim, slots, old)
        self._advance_to(start)

    def _slots(self, start: int, n: int) -> Tensor:
        device = getattr(self, self._buffers[0]).device
        return torch.arange(start, min(start + n, self.max_len), device=device)

    def __deepcopy__(self, memo):
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if isinstance(value, Tensor):
                value = value.detach().clone()
            else:
                value = copy.deepcopy(value, memo)
            setattr(new, key, value)
        return new

    def _reserve(self, name: str, new: Tensor, buf: Tensor, batch_dim: int = 0) -> tuple[int, int]:
        if not isinstance(new, Tensor):
            raise TypeError(f"{name} must be a tensor; received {type(new).__name__}")
        expect = list(buf.shape)
        got = list(new.shape)
        if new.dim() != buf.dim():
            raise ValueError(f"{name} must be {self._layout}; received shape {tuple(got)}")
        if got[batch_dim] != expect[batch_dim]:
            raise ValueError(
                f"cache was made for batch size {expect[batch_dim]}; received {name} with batch "
                f"size {got[batch_dim]}. Make a new cache with new_cache(batch_size={got[batch_dim]}, ...)"
            )
        got_other = [g for i, g in enumerate(got) if i not in (batch_dim, self._seq_dim)]
        exp_other = [e for i, e in enumerate(expect) if i not in (batch_dim, self._seq_dim)]
        if got_other != exp_other:
            raise ValueError(f"{name} of shape {tuple(got)} does not fit the cache {self._layout} "
                             f"= {tuple(expect[:self._seq_dim])} + (S, ...) {tuple(exp_other)}")
        if new.dtype != buf.dtype:
            raise TypeError(f"cache holds {buf.dtype}; received {name} in {new.dtype}. "
                            f"Cast it, or make the cache with dtype={new.dtype}")
        if new.device != buf.device:
            raise ValueError(f"cache lives on {buf.device}; received {name} on {new.device}")
        start = self.length
        end = start + got[self._seq_dim]
        if end > self.max_len and not self._rolling:
            raise ValueError(
                f"cache overflow: {start} tokens cached + {got[self._seq_dim]} new = {end} "
                f"> max_len {self.max_len}. Make the cache with a larger max_len, or reset() it"
            )
        return start, end


class KVCache(_StaticCache):
    """A preallocated key/value cache `(B, Hkv, S_max, D)` for one attention layer.

    Args:
        batch_size, n_kv_heads, max_len, head_dim: the buffer shape.
        v_head_dim: value head dim if it differs from head_dim.
        dtype, device: of the buffers (float32 / cpu by default).
    """

    _seq_dim = 2
    _layout = "(B, Hkv, S, D)"
    _buffers = ("k", "v")

    def __init__(self, batch_size: int, n_kv_heads: int, max_len: int, head_dim: int,
                 v_head_dim: int | None = None, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        for name, value in (("batch_size", batch_size), ("n_kv_heads", n_kv_heads),
                            ("max_len", max_len), ("head_dim", head_dim)):
            check_positive_int(name, value)
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        check_positive_int("v_head_dim", v_head_dim)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"cache dtype must be a floating torch.dtype; received {dtype!r}")
        super().__init__(max_len, device)
        self.k = _zeros((batch_size, n_kv_heads, max_len, head_dim), dtype, device)
        self.v = _zeros((batch_size, n_kv_heads, max_len, v_head_dim), dtype, device)

    @property
    def n_kv_heads(self) -> int:
        return self.k.shape[1]

    def _reserve_kv(self, k: Tensor, v: Tensor) -> tuple[int, int]:
        """Check k and v against the buffers and each other; (start, end) of the new tokens."""
        start, end = self._reserve("k", k, self.k)
        self._reserve("v", v, self.v)
        if k.shape[2] != v.shape[2]:
            raise ValueError(f"k and v must add the same number of tokens; received "
                             f"{k.shape[2]} and {v.shape[2]}")
        return start, end

    def update(self, k: Tensor, v: Tensor, *, static: bool = False) -> tuple[Tensor, Tensor]:
        """Append k `(B, Hkv, T, D)`, v `(B, Hkv, T, Dv)`; return all cached `(B, Hkv, S, .)`.

        `static=True` (compiled decoding): write at the tensor position and return the
        whole buffers `(B, Hkv, S_max, .)`. No Python int is read, so shapes stay static;
        keys at positions >= `position` are stale and must be masked by the caller.
        Overflow is not checked then (that would need the length on the host).
        """
        if static:
            return self._update_static(k, v)
        start, end = self._reserve_kv(k, v)
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self._advance_to(end)
        return self.k[:, :, :end], self.v[:, :, :end]

    def hold_context(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Cross-attention: keep a whole context, k `(B, Hkv, S, D)`, v `(B, Hkv, S, Dv)`, in
        an empty cache (filled once, read by every later step); return it `(B, Hkv, S, .)`."""
        if self.length:
            raise ValueError(f"this cache already holds {self.length} tokens; a cross-attention context "
                             f"is held by an empty cache (reset() it, or make a new one)")
        if isinstance(k, Tensor) and k.dim() == 4 and k.shape[2] > self.max_len:
            raise ValueError(
                f"cross-attention keeps the whole context ({k.shape[2]} tokens) but this cache holds "
                f"max_len {self.max_len}; make it with new_cache(batch_size, max_len={k.shape[2]})")
        return KVCache.update(self, k, v)

    def cached(self) -> tuple[Tensor, Tensor]:
        """Views of every cached key and value `(B, Hkv, S, .)`, in slot order (a held
        context: in order)."""
        return self.k[:, :, : min(self.length, self.max_len)], self.v[:, :, : min(self.length, self.max_len)]

    def _update_static(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        idx = self.position + torch.arange(k.shape[2], device=self.position.device)
        self.k.index_copy_(2, idx, k)
        self.v.index_copy_(2, idx, v)
        self.position.add_(k.shape[2])
        self._len = None
        return self.k, self.v

    def __repr__(self) -> str:
        B, Hkv, S, D = self.k.shape
        return (f"KVCache(B={B}, Hkv={Hkv}, max_len={S}, D={D}, Dv={self.v.shape[-1]}, "
                f"length={self.length}, dtype={self.dtype})")


class RollingKVCache(KVCache):
    """A sliding-window key/value cache of W slots, written round-robin (Mistral's design).

    A layer that attends at most `window` keys back (query p sees keys p - W < j <= p)
    never needs older keys, so the cache holds W tokens whatever the sequence length:
    memory O(W) instead of O(max_len), and no overflow. `length` counts every token
    seen. `update` returns the keys still visible to the new queries in chronological
    order (at most W - 1 old ones, then the new ones), so the bottom-right
    `masks.sliding_window(W)` predicate applies to them as it does to a full forward.

    Args:
        batch_size, n_kv_heads, window, head_dim, v_head_dim, dtype, device: as `KVCache`,
            with `window` slots.
    """

    _rolling = True

    def __init__(self, batch_size: int, n_kv_heads: int, window: int, head_dim: int,
                 v_head_dim: int | None = None, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        check_positive_int("window", window)
        super().__init__(batch_size, n_kv_heads, window, head_dim, v_head_dim, dtype=dtype, device=device)
        self._window = window

    @property
    def window(self) -> int:
        return self._window

    @property
    def holds_context(self) -> bool:
        """Whether the slots were widened to hold a cross-attention context (see `hold_context`)."""
        return self.max_len != self._window

    def hold_context(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Cross-attention: a context is not a stream that slides past a window (every query
        may see every context token), so the cache holds all S tokens, in order, widening its
        slots to S if S > W until `reset()`."""
        S = k.shape[2] if isinstance(k, Tensor) and k.dim() == 4 else 0
        if not self.length and S > self.max_len:
            self._reserve_kv(k, v)  # a named error for a context that does not fit, before allocating
            self.k = self.k.new_zeros(self.k.shape[:2] + (S,) + self.k.shape[3:])
            self.v = self.v.new_zeros(self.v.shape[:2] + (S,) + self.v.shape[3:])
            self.max_len = S
        return super().hold_context(k, v)

    def _state(self, n_new: int) -> tuple:
        # the buffers themselves too: hold_context may replace them by wider ones
        return super()._state(n_new), self.k, self.v, self.max_len

    def _put_back(self, state: tuple) -> None:
        inner, self.k, self.v, self.max_len = state
        super()._put_back(inner)

    def reset(self) -> None:
        """Forget every cached token; a cache widened for a context goes back to W slots."""
        if self.holds_context:
            self.k = self.k.new_zeros(self.k.shape[:2] + (self._window,) + self.k.shape[3:])
            self.v = self.v.new_zeros(self.v.shape[:2] + (self._window,) + self.v.shape[3:])
            self.max_len = self._window
        super().reset()

    def _slots(self, start: int, n: int) -> Tensor:
        W = self.window
        written = min(n, W)  # only the last W new tokens are kept
        return torch.arange(start + n - written, start + n, device=self.k.device) % W

    def update(self, k: Tensor, v: Tensor, *, ordered: bool = True, static: bool = False) -> tuple[Tensor, Tensor]:
        """Add k `(B, Hkv, T, D)`, v `(B, Hkv, T, Dv)`; return the visible keys and values
        `(B, Hkv, min(length, W - 1) + T, .)` in chronological order.

        `ordered=False`, for ONE token (T = 1): return every cached key and value
        `(B, Hkv, min(length, W), .)` as views of the slots, in slot order, not
        chronological. The one query sees all of them (they are the last W tokens, its own
        included), so a mask that depends only on positions (causal, the window) allows
        every one and their order does not change the attention: no copy, no mask.
        Position-dependent scores (ALiBi, a caller's mask, weights a caller reads per key)
        need the ordered keys. `static=True` is refused: a rolling cache runs eagerly.
        """
        if static:
            raise ValueError("a RollingKVCache runs eagerly; under torch.compile use a static cache "
                             "(new_cache(..., rolling=False))")
        if not ordered:
            return self._update_one_unordered(k, v)
        start, _ = self._reserve_kv(k, v)
        W, T = self.window, k.shape[2]
        kept = min(start, W - 1)  # old tokens that the first new query can still see
        old = torch.arange(start - kept, start, device=self.k.device) % W
        k_all = torch.cat([self.k.index_select(2, old), k], dim=2)  # (B, Hkv, kept + T, D)
        v_all = torch.cat([self.v.index_select(2, old), v], dim=2)  # (B, Hkv, kept + T, Dv)
        slots = self._slots(start, T)
        self.k.index_copy_(2, slots, k[:, :, T - len(slots):])
        self.v.index_copy_(2, slots, v[:, :, T - len(slots):])
        self._advance_to(start + T)
        return k_all, v_all

    def _update_one_unordered(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if isinstance(k, Tensor) and k.dim() == 4 and k.shape[2] != 1:
            raise ValueError(f"update(..., ordered=False) adds one token; received {k.shape[2]} (use ordered=True)")
        start, _ = self._reserve_kv(k, v)
        slot = start % self.window
        self.k[:, :, slot:slot + 1] = k
        self.v[:, :, slot:slot + 1] = v
        self._advance_to(start + 1)
        n = min(start + 1, self.window)
        return self.k[:, :, :n], self.v[:, :, :n]

    def __repr__(self) -> str:
        B, Hkv, W, D = self.k.shape
        return (f"RollingKVCache(B={B}, Hkv={Hkv}, window={W}, D={D}, Dv={self.v.shape[-1]}, "
                f"length={self.length}, dtype={self.dtype})")


class LatentCache(_StaticCache):
    """MLA's cache: the compressed latent plus the shared RoPE key, `(B, S_max, R + rope_dim)`.

    It stores kv_rank + rope_dim values per token, whatever the number of heads.
    """

    _seq_dim = 1
    _layout = "(B, S, R + rope_dim)"
    _buffers = ("buf",)

    def __init__(self, batch_size: int, max_len: int, kv_rank: int, rope_dim: int = 0, *,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        for name, value in (("batch_size", batch_size), ("max_len", max_len), ("kv_rank", kv_rank)):
            check_positive_int(name, value)
        check_nonnegative_int("rope_dim", rope_dim)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        super().__init__(max_len, device)
        self.kv_rank = kv_rank
        self.rope_dim = rope_dim
        self.buf = _zeros((batch_size, max_len, kv_rank + rope_dim), dtype, device)


    def update(self, latent: Tensor) -> Tensor:
        """Append latent `(B, T, R + rope_dim)`; return all cached `(B, S, R + rope_dim)`."""
        start, end = self._reserve("latent", latent, self.buf)
        self.buf[:, start:end] = latent
        self._advance_to(end)
        return self.buf[:, :end]

    def __repr__(self) -> str:
        B, S, W = self.buf.shape
        return (f"LatentCache(B={B}, max_len={S}, kv_rank={self.kv_rank}, rope_dim={self.rope_dim}, "
                f"length={self.length}, dtype={self.dtype})")
