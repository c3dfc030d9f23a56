"""ring_attention's per-block kernel: the fused CPU op only where this torch has it."""

from __future__ import annotations

import torch

from multihead.distributed import ring


def test_the_fused_cpu_kernel_is_used_only_where_torch_has_it(monkeypatch):
    q = torch.zeros(1, 2, 4, 8)
    monkeypatch.setattr(ring, "HAS_CPU_FLASH", True)
    assert ring._pick_kernel(q, None) is ring._Flash
    assert ring._pick_kernel(q, "explicit") is ring._Explicit
    assert ring._pick_kernel(q.to(torch.int32), None) is ring._Explicit
    monkeypatch.setattr(ring, "HAS_CPU_FLASH", False)
    assert ring._pick_kernel(q, None) is ring._Explicit
