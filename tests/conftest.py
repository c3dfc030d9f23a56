import os
import sys

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


def _hf_state():
    """transformers' and huggingface_hub's process-wide switches, if they are imported (a test
    that never touched them does not pay for importing them)."""
    if "transformers.utils.logging" not in sys.modules:
        return None
    hf_logging = sys.modules["transformers.utils.logging"]
    hub = sys.modules.get("huggingface_hub.utils.tqdm")
    return (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled(),
            dict(getattr(hub, "progress_bar_states", {}) or {}))


@pytest.fixture(autouse=True)
def _process_state():
    """Every test starts from the process state the one before it found, whatever it leaked:
    the environment, torch's default dtype, grad mode and thread count, transformers'
    verbosity and progress bars. The suite runs in random order (pytest-randomly), so no
    test may depend on another's leftovers."""
    env = dict(os.environ)
    dtype, grad, threads = torch.get_default_dtype(), torch.is_grad_enabled(), torch.get_num_threads()
    hf = _hf_state()
    yield
    if dict(os.environ) != env:
        for key in set(os.environ) - set(env):
            del os.environ[key]
        os.environ.update(env)
    if torch.get_default_dtype() != dtype:
        torch.set_default_dtype(dtype)
    torch.set_grad_enabled(grad)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    if hf is not None and _hf_state() != hf:
        hf_logging = sys.modules["transformers.utils.logging"]
        hf_logging.set_verbosity(hf[0])
        hf_logging._tqdm_active = hf[1]
        hub = sys.modules.get("huggingface_hub.utils.tqdm")
        if isinstance(getattr(hub, "progress_bar_states", None), dict):
            hub.progress_bar_states.clear()
            hub.progress_bar_states.update(hf[2])


def pytest_sessionstart(session):
    """Print the random order's seed even under -q (which hides pytest-randomly's header line),
    so a failure that depends on the order can be replayed."""
    seed = getattr(session.config.option, "randomly_seed", None)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and isinstance(seed, int) and not hasattr(session.config, "workerinput"):
        reporter.write_line(f"random test order: -p randomly --randomly-seed={seed} replays it "
                            f"(-p no:randomly for file order)")


@pytest.fixture
def one_torch_thread():
    """Small models: one intra-op thread, so two test processes do not oversubscribe 2 cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
