import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Under pytest-xdist every worker is a process of its own: one torch thread each, or the
# workers fight over the 2 cores (measured 2.3x slower for the model tests).
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, torch.get_num_threads())))

# One tolerance table per dtype: (atol, rtol) against the float64 NumPy reference.
TOL = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
}


def assert_close(actual, expected, dtype=None, *, atol=None, rtol=None, what=""):
    """Compare with the dtype's tolerance; the failure message prints the max difference."""
    a = actual.detach().double().cpu().numpy() if isinstance(actual, torch.Tensor) else np.asarray(actual, float)
    e = expected.detach().double().cpu().numpy() if isinstance(expected, torch.Tensor) else np.asarray(expected, float)
    dtype = dtype or (actual.dtype if isinstance(actual, torch.Tensor) else torch.float64)
    t_atol, t_rtol = TOL[dtype]
    atol = t_atol if atol is None else atol
    rtol = t_rtol if rtol is None else rtol
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    assert not np.isnan(a).any(), f"{what}: NaN in result"
    diff = np.abs(a - e)
    bound = atol + rtol * np.abs(e)
    worst = np.unravel_index(np.argmax(diff - bound), diff.shape) if diff.size else ()
    assert (diff <= bound).all(), (
        f"{what}: max |diff| = {diff.max():.3e} at {worst} (actual {a[worst]:.6g}, expected {e[worst]:.6g}); "
        f"atol={atol:g} rtol={rtol:g} for {dtype}"
    )
    return float(diff.max()) if diff.size else 0.0


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    np.random.seed(0)


@pytest.fixture
def one_torch_thread():
    """Small models: one intra-op thread, so two test processes do not oversubscribe 2 cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
