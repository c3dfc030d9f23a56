"""Under pytest-xdist (`make test`: -n 2) each worker compiles into an inductor cache of its
own (tests/conftest.py), so two workers never write one cold cache at once; the compile a
test triggers lands there."""

from __future__ import annotations

import os

import pytest
import torch


def test_each_worker_compiles_into_a_cache_of_its_own():
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        pytest.skip("one process: nothing to share a cache with (make test runs this under -n 2)")
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")
    assert os.path.basename(folder).endswith(f"_{worker}"), folder


@pytest.mark.slow
def test_a_flex_compile_writes_into_this_workers_cache():
    pytest.importorskip("torch.nn.attention.flex_attention")
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        pytest.skip("one process: the shared default cache is the only one")
    from multihead.functional import scaled_dot_product_attention as sdpa

    folder = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    q = torch.randn(1, 2, 8, 8)
    sdpa(q, q, q, causal=True, backend="flex")
    assert os.path.isdir(folder) and any(os.scandir(folder)), folder
