"""KV caches: static, preallocated buffers for decoding (the gpt-fast design).

`KVCache` holds keys `(B, Hkv, S_max, D)` and values `(B, Hkv, S_max, Dv)`: Hkv heads,
not H, which is the whole point of GQA and MQA. `update` writes the new tokens at the
current length and returns views of everything cached so far. `LatentCache` holds
MLA's compressed latent `(B, S_max, R + rope_dim)` instead.

Under `torch.compile`, a Python int length would be specialised and recompiled at every
step, so the length lives in a 0-d tensor. Eager `update` reads it and returns views of
the cached tokens (exact shapes, no wasted work); compiled code uses `update_static`,
which writes at the tensor position and returns the whole buffers, to be masked by
position (the gpt-fast design): one graph serves every decode step (tested).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["KVCache", "LatentCache"]


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int; received {value!r}")


class _StaticCache:
    """Shared bookkeeping: a length within a fixed capacity along dim `seq_dim`."""

    _seq_dim: int

    def __init__(self, max_len: int, device=None):
        self.max_len = max_len
        self.position = torch.zeros((), dtype=torch.long, device=device)  # tokens cached so far

    @property
    def length(self) -> int:
        """Tokens cached so far."""
        return int(self.position)

    def reset(self) -> None:
        """Forget every cached token (the buffers are kept and reused)."""
        self.position.zero_()

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
        if end > self.max_len:
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

    def __init__(self, batch_size: int, n_kv_heads: int, max_len: int, head_dim: int,
                 v_head_dim: int | None = None, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        for name, value in (("batch_size", batch_size), ("n_kv_heads", n_kv_heads),
                            ("max_len", max_len), ("head_dim", head_dim)):
            _check_positive(name, value)
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        _check_positive("v_head_dim", v_head_dim)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"cache dtype must be a floating torch.dtype; received {dtype!r}")
        super().__init__(max_len, device)
        self.k = torch.zeros(batch_size, n_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(batch_size, n_kv_heads, max_len, v_head_dim, dtype=dtype, device=device)

    @property
    def batch_size(self) -> int:
        return self.k.shape[0]

    @property
    def n_kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the preallocated buffers: 2 * B * Hkv * S_max * D * itemsize for D == Dv."""
        return self.k.nbytes + self.v.nbytes

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append k `(B, Hkv, T, D)`, v `(B, Hkv, T, Dv)`; return all cached `(B, Hkv, S, .)`."""
        start, end = self._reserve("k", k, self.k)
        self._reserve("v", v, self.v)
        if k.shape[2] != v.shape[2]:
            raise ValueError(f"k and v must add the same number of tokens; received "
                             f"{k.shape[2]} and {v.shape[2]}")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.position.fill_(end)
        return self.k[:, :, :end], self.v[:, :, :end]

    def update_static(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v at the tensor position; return the whole buffers `(B, Hkv, S_max, .)`.

        For compiled decoding: no Python int is read, so shapes stay static. Keys at
        positions >= `position` are stale and must be masked by the caller. Overflow is
        not checked here (that would need the length on the host).
        """
        idx = self.position + torch.arange(k.shape[2], device=self.position.device)
        self.k.index_copy_(2, idx, k)
        self.v.index_copy_(2, idx, v)
        self.position.add_(k.shape[2])
        return self.k, self.v

    def __repr__(self) -> str:
        B, Hkv, S, D = self.k.shape
        return (f"KVCache(B={B}, Hkv={Hkv}, max_len={S}, D={D}, Dv={self.v.shape[-1]}, "
                f"length={self.length}, dtype={self.dtype})")


class LatentCache(_StaticCache):
    """MLA's cache: the compressed latent plus the shared RoPE key, `(B, S_max, R + rope_dim)`.

    It stores kv_rank + rope_dim values per token, whatever the number of heads.
    """

    _seq_dim = 1
    _layout = "(B, S, R + rope_dim)"

    def __init__(self, batch_size: int, max_len: int, kv_rank: int, rope_dim: int = 0, *,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        for name, value in (("batch_size", batch_size), ("max_len", max_len), ("kv_rank", kv_rank)):
            _check_positive(name, value)
        if isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or rope_dim < 0:
            raise ValueError(f"rope_dim must be an int >= 0; received {rope_dim!r}")
        dtype = torch.get_default_dtype() if dtype is None else dtype
        super().__init__(max_len, device)
        self.kv_rank = kv_rank
        self.rope_dim = rope_dim
        self.buf = torch.zeros(batch_size, max_len, kv_rank + rope_dim, dtype=dtype, device=device)

    @property
    def batch_size(self) -> int:
        return self.buf.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.buf.dtype

    @property
    def nbytes(self) -> int:
        """B * S_max * (kv_rank + rope_dim) * itemsize."""
        return self.buf.nbytes

    def update(self, latent: Tensor) -> Tensor:
        """Append latent `(B, T, R + rope_dim)`; return all cached `(B, S, R + rope_dim)`."""
        start, end = self._reserve("latent", latent, self.buf)
        self.buf[:, start:end] = latent
        self.position.fill_(end)
        return self.buf[:, :end]

    def update_static(self, latent: Tensor) -> Tensor:
        """Write at the tensor position; return the whole buffer `(B, S_max, R + rope_dim)`
        (see `KVCache.update_static`)."""
        idx = self.position + torch.arange(latent.shape[1], device=self.position.device)
        self.buf.index_copy_(1, idx, latent)
        self.position.add_(latent.shape[1])
        return self.buf

    def __repr__(self) -> str:
        B, S, W = self.buf.shape
        return (f"LatentCache(B={B}, max_len={S}, kv_rank={self.kv_rank}, rope_dim={self.rope_dim}, "
                f"length={self.length}, dtype={self.dtype})")
