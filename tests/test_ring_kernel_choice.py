"""ring_attention's per-block kernel: the fused CPU op only where this torch has it."""

from __future__ import annotations

import torch

from multihead.distributed import ring


def test_the_fused_cpu_kernel_is_used_only_where_torch_has_it(monkeypatch):
    # ring_attention reports no kernel: the choice is read from the function that makes it
    pick, flash, explicit = ring._pick_kernel, ring._Flash, ring._Explicit
    q = torch.zeros(1, 2, 4, 8)
    monkeypatch.setattr(ring, "HAS_CPU_FLASH", True)  # a torch with the fused op, whatever this one has
    assert pick(q, None) is flash
    assert pick(q, "explicit") is explicit
    assert pick(q.to(torch.int32), None) is explicit
    monkeypatch.setattr(ring, "HAS_CPU_FLASH", False)  # and a torch without it
    assert pick(q, None) is explicit
